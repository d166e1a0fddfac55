"""Building the towers: one call of the user's model_fn per device, in turn.

Each tower's call runs to its end before the next begins, as one device's
calls do: no Python state of the model_fn or of its libraries (tf-slim's
scope stack, a model object's attributes, name counters) ever sees two
towers at once. Towers 1, 2, ..., N-1 are built first, tower 0 last: a
call that needs every tower (a meeting, see `_meet.meetings`) hands the earlier
towers stand-ins and is built once when tower 0, the last to arrive, makes
it, so that tower 0's code gets the real result (a gradient's structure
included) as on one device.

Each tower builds under its own name and variable scope (none for tower
0: the unwrapped names, `tower_i/` for the others), its own device
function, and a variable creator giving every tower the variables the
first tower built created (under the unwrapped names), however they are
created (get_variable, tf.compat.v1.layers, Keras layers, which ignore
variable-scope reuse). Each tower starts from the graph's name counters as
they stood before the towers and sees one device's collections, variable
store and names (`_towers.views`), so it names its layers, finds its
losses, updates and variables as the unwrapped model_fn would; TensorBoard
shows tower 0's summaries.
"""

import contextlib
from typing import Any, Callable, Iterator, List, Sequence

from absl import logging
import tensorflow as tf

from replicate import _context
from replicate import _tf
from replicate._context import Replication
from replicate._context import Tower
from replicate._towers import sharing


def order(num_towers: int) -> List[int]:
  """The order the towers are built in: 1, ..., N-1, then 0."""
  return list(range(1, num_towers)) + [0]


@contextlib.contextmanager
def _tower_scope(
    replication: Replication, index: int,
    device_function: Callable[[tf.Operation], str]) -> Iterator[None]:
  """Builds tower `index`: its scopes, devices and variables."""
  graph = replication.graph
  with contextlib.ExitStack() as stack:
    if index > 0:
      segment = f"tower_{index}"
      # The same scope in every replication of the graph (a model_fn called
      # twice: adversarial regularization), so the calls' names agree.
      scope = stack.enter_context(
          graph.name_scope(replication.tower_prefix(index)))
      stack.enter_context(
          _tf.tower_root(graph, scope.rstrip("/"), segment,
                         replication.views.read))
      # The variable scope agrees with the name scope, as on one device;
      # `get_variable` names reach the variable store without the segment.
      stack.enter_context(
          tf.compat.v1.variable_scope(
              segment,
              auxiliary_name_scope=False,
              custom_getter=sharing.towerless_getter(segment)))
    else:
      stack.enter_context(
          _context.absolute_name_scope(graph, replication.root_name_scope))
      stack.enter_context(
          _tf.tower_root(graph, None, None, replication.views.read))
    stack.enter_context(tf.compat.v1.device(device_function))
    stack.enter_context(
        tf.compat.v1.variable_creator_scope(
            sharing.variable_creator(replication, index)))
    logging.info("replicate: building tower %d of %d on %s", index,
                 replication.num_towers, replication.devices[index])
    yield


def build_towers(
    replication: Replication, build: Callable[[int], Any],
    device_functions: Sequence[Callable[[tf.Operation], str]]) -> List[Any]:
  """Calls `build(i)` once per tower, one after another; tower 0 last.

  Each call sees one device's graph (`replication.views`); afterwards the
  graph holds one device's collections. Records each tower's range of ops
  in `replication.ranges`, and its ops in `replication.tower_ops` (tower
  order) once every tower is built.
  """
  graph = replication.graph
  counters = _tf.NameCounters()
  num_towers = replication.num_towers
  towers = order(num_towers)
  replication.creator = towers[0]
  replication.created = [{} for _ in range(num_towers)]
  results = [None] * num_towers
  views = replication.views
  try:
    for index in towers:
      counters.restore()
      views.enter(
          replication.tower_prefix(index), replication.tower_prefix(0),
          index == replication.creator)
      replication.tower = Tower(index, num_towers, replication.devices[index])
      replication.ranges[index] = [graph.version, None]
      try:
        with _tower_scope(replication, index, device_functions[index]):
          results[index] = build(index)
        if index == 0:
          views.share_imported()
      finally:
        views.leave(index)
      replication.ranges[index][1] = graph.version
  finally:
    replication.tower = None
    views.merge()
  replication.tower_ops = [replication.model_ops(i) for i in range(num_towers)]
  for ops in replication.tower_ops:
    replication.tower_op_names.update(op.name for op in ops)
  return results
