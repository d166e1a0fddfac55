"""Building the towers: one call of the user's model_fn per device.

Each tower builds on a thread of its own (see `_lockstep`), under its own
name scope (none for tower 0, `tower_i/` after), its own device function,
and a variable creator that hands later towers the variables tower 0
created, so that one set of model variables is shared whatever API created
them (get_variable, tf.compat.v1.layers or Keras layers, which ignore
variable-scope reuse). What a graph keeps for all threads (Keras' layer
name counters, the UPDATE_OPS, LOSSES and SUMMARIES collections) is saved
and restored whenever a tower pauses and resumes, so each tower sees what
the unwrapped model_fn would.
"""

import contextlib
from typing import Any, Callable, List, NamedTuple, Sequence

import tensorflow as tf
from absl import logging

from replicate import _context
from replicate import _lockstep
from replicate import _sharing
from replicate._context import Replication
from replicate._context import Tower

_GraphKeys = tf.compat.v1.GraphKeys
# Collections each tower keeps its own view of: what was there before the
# towers, and what the tower added.
_PER_TOWER = (_GraphKeys.UPDATE_OPS, _GraphKeys.LOSSES)


class _Captured(NamedTuple):
  """The calling thread's graph scopes, for the tower threads to enter."""
  name_scope: str
  variable_scope: Any
  devices: Any
  control_dependencies: List[Any]
  colocation: Any
  creators: List[Any]

  @classmethod
  def now(cls, graph: tf.Graph) -> "_Captured":
    # A graph keeps these per thread and has no public way to hand them to
    # another thread; tf.distribute's MirroredStrategy copies them likewise.
    # pylint: disable=protected-access
    return cls(graph.get_name_scope(), tf.compat.v1.get_variable_scope(),
               graph._device_function_stack.copy(),
               list(graph._control_dependencies_stack),
               graph._colocation_stack.copy(),
               list(graph._variable_creator_stack))

  @contextlib.contextmanager
  def entered(self, graph: tf.Graph):
    with graph.as_default():
      # pylint: disable=protected-access
      graph._device_function_stack = self.devices.copy()
      graph._control_dependencies_stack = list(self.control_dependencies)
      graph._colocation_stack = self.colocation.copy()
      graph._variable_creator_stack = list(self.creators)
      # pylint: enable=protected-access
      with _context.absolute_name_scope(graph, self.name_scope), \
          tf.compat.v1.variable_scope(self.variable_scope):
        yield


class _TowerView:
  """One tower's share of what the graph keeps for every thread."""

  def __init__(self, replication: Replication, index: int,
               counters: _sharing.NameCounters):
    self._replication = replication
    self._index = index
    self._counters = counters.copy()
    self._collections = {key: list(replication.collections_before[key])
                         for key in _PER_TOWER}
    self._summaries_before = set()

  def resume(self):
    graph = self._replication.graph
    self._replication.tower = Tower(self._index, self._replication.num_towers,
                                    self._replication.devices[self._index])
    self._counters.restore()
    for key, items in self._collections.items():
      graph.get_collection_ref(key)[:] = items
    self._summaries_before = {
        id(s) for s in graph.get_collection(_GraphKeys.SUMMARIES)}

  def pause(self):
    graph = self._replication.graph
    self._counters.save()
    for key in self._collections:
      self._collections[key] = list(graph.get_collection(key))
    if self._index > 0:
      # TensorBoard shows tower 0's summaries, under the unwrapped names
      # (those of per-batch scalars, the loss's, get the whole batch's value:
      # see _summaries); those of the combined update (e.g. a gradient
      # transform's) stay.
      summaries = graph.get_collection_ref(_GraphKeys.SUMMARIES)
      summaries[:] = [s for s in summaries if id(s) in self._summaries_before
                      or s.op.name in self._replication.apply_ops]


@contextlib.contextmanager
def _tower_scope(replication: Replication, index: int,
                 device_function: Callable[[tf.Operation], str]):
  """Builds tower `index`: its name scope, reuse, devices and variables."""
  graph = replication.graph
  with contextlib.ExitStack() as stack:
    stack.enter_context(_context.on_tower_thread(replication))
    if index > 0:
      stack.enter_context(tf.compat.v1.variable_scope(
          replication.root_variable_scope, reuse=True))
      name_root = stack.enter_context(graph.name_scope(f"tower_{index}"))
    else:
      name_root = (replication.root_name_scope + "/"
                   if replication.root_name_scope else "")
    stack.enter_context(tf.compat.v1.device(device_function))
    stack.enter_context(tf.compat.v1.variable_creator_scope(
        _sharing.variable_creator(replication, index, name_root)))
    logging.info("replicate: building tower %d of %d on %s", index,
                 replication.num_towers, replication.devices[index])
    yield


class _Segments:
  """Records the ops a tower builds, stretch by stretch between pauses."""

  def __init__(self, graph: tf.Graph, view: _TowerView):
    self._graph = graph
    self._view = view
    self._mark = 0
    self.ops: List[tf.Operation] = []

  def start(self):
    self._view.resume()
    # The graph's op counter: ops are numbered 1, 2, ... as created and
    # never removed, so this is len(get_operations()) without the list.
    self._mark = self._graph.version

  def end(self):
    self.ops.extend(self._graph.get_operations()[self._mark:])
    self._view.pause()


def build_towers(replication: Replication, build: Callable[[int], Any],
                 device_functions: Sequence[Callable[[tf.Operation], str]]):
  """Calls `build(i)` once per tower, in lockstep; returns the results.

  Records each tower's ops in `replication.tower_ops` (tower order).
  """
  graph = replication.graph
  captured = _Captured.now(graph)
  counters = _sharing.NameCounters()
  segments = [_Segments(graph, _TowerView(replication, i, counters))
              for i in range(replication.num_towers)]
  replication.created = [{} for _ in segments]

  def hooks(thread):
    thread.on_resume = segments[thread.index].start
    thread.on_pause = segments[thread.index].end

  @contextlib.contextmanager
  def enter(index):
    with captured.entered(graph):
      segments[index].start()
      try:
        with _tower_scope(replication, index, device_functions[index]):
          yield
      finally:
        segments[index].end()

  results = _lockstep.run_towers(
      [lambda i=i: build(i) for i in range(replication.num_towers)],
      enter, hooks)
  # What follows the towers sees tower 0's names and collections, as after
  # the unwrapped model_fn.
  segments[0].start()
  replication.tower = None
  replication.tower_ops = [s.ops for s in segments]
  for ops in replication.tower_ops:
    replication.tower_op_names.update(op.name for op in ops)
  return results
