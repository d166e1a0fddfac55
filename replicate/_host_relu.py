"""The ReLU after a batch-norm layer normalised on the concatenated batch.

Where the towers are CPUs of one machine, a fused batch-norm layer in
training runs one kernel on the towers' shards concatenated and hands each
tower its rows of the output (see `_batch_norm`). The ReLU that usually
follows would then run in each tower on its rows, where TensorFlow's graph
optimiser (grappler's remapper) cannot fuse it into the kernel as it does
on one device. So while the towers are built, `tf.nn.relu` of such rows
(every TensorFlow module's name for it; Keras' `relu` activation and `ReLU`
layer call it) runs once on the kernel's whole output, before the rows are
handed out: the function is elementwise, so each tower gets the values its
own ReLU would compute. The tower's result is an Identity of its rows,
built where the tower called the ReLU (its name, device and control
dependencies). A call inside a v1 `tf.cond` / `tf.while_loop` stays the
tower's own.
"""

from typing import Any, Callable, Dict, List

import tensorflow as tf

from replicate import _context
from replicate import _patches


class WholeBatch:
  """A result computed on the towers' concatenated rows, handed out per tower.

  Args:
    replication: the towers' replication.
    whole: the result on the concatenated batch.
    place: `place(result on the batch)` -> each tower's rows of it, in tower
      order (see `_batch_norm._concatenated`).
  """

  def __init__(self, replication: _context.Replication, whole: tf.Tensor,
               place: Callable[[tf.Tensor], List[tf.Tensor]]):
    self._replication = replication
    self._whole = whole
    self._place = place
    self._scope = replication.graph.get_name_scope()
    self._applied: Dict[str, List[tf.Tensor]] = {}

  def hand_out(self) -> List[tf.Tensor]:
    """Each tower's rows, recorded so that a ReLU of them can find this."""
    rows = self._place(self._whole)
    for index, tower_rows in enumerate(rows):
      self._replication.host_rows[tower_rows.ref()] = (self, index)
    return rows

  def applied(self, name: str, function: Callable[..., tf.Tensor]
              ) -> List[tf.Tensor]:
    """Each tower's rows of `function(whole)`, built once, on the hub."""
    if name not in self._applied:
      graph = self._replication.graph
      with graph.control_dependencies(None), \
          graph.device(self._replication.hub), \
          _context.absolute_name_scope(graph, self._scope):
        self._applied[name] = WholeBatch(
            self._replication, function(self._whole, name=name),
            self._place).hand_out()
    return self._applied[name]


def _rows_of_whole_batch(features: Any):
  """(WholeBatch, tower index) if `features` are a tower's rows, else None."""
  replication = _context.current_replication()
  if (replication is None or replication.tower is None or
      not isinstance(features, tf.Tensor)):
    return None
  found = replication.host_rows.get(features.ref())
  if found is None or _context.in_v1_control_flow(replication.graph):
    return None
  return found


def _relu(original: Callable[..., tf.Tensor]) -> Callable[..., tf.Tensor]:
  def relu(features, name=None):
    found = _rows_of_whole_batch(features)
    if found is None:
      return original(features, name=name)
    whole_batch, index = found
    rows = whole_batch.applied("Relu", original)[index]
    return tf.identity(rows, name=name or "Relu")
  return relu


def _install() -> _patches.Patched:
  # tf.nn.relu is the one function every TensorFlow module binds as `relu`
  # (gen_nn_ops' generated op wrapper).
  original = tf.nn.relu
  return _patches.rebind("relu", original, _relu(original))


_PATCHES = _patches.Patches("tf.nn.relu of whole-batch rows", _install)


def routed(replication: _context.Replication):
  """A ReLU built inside runs on the whole batch's rows where it can."""
  return _PATCHES.applied(replication.sync_batch_norm and
                          replication.num_towers > 1)
