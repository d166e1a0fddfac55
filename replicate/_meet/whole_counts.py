"""One device's counts and positions where a tower computed its own.

`_batch.rows` reports a shard's size read as a value (`SizeUse`) and
positions of the tower's rows read as values (`PositionUse`); `Rewiring`
hands them the whole batch's, built here: a shape or size summed over the
towers (phantom rows left out), the arithmetic on it copied onto the sum,
and each tower's positions offset by the rows of the towers before it.
"""

from typing import Any, Callable, Dict, Optional, Sequence

import tensorflow as tf

from replicate import _context
from replicate._batch import row_kinds
from replicate._meet import combining

# Copies an op onto other inputs: (op, inputs, device, name) -> the copy.
CopyOp = Callable[
    [tf.Operation, Sequence[tf.Tensor], Optional[str], Optional[str]],
    tf.Operation]


class WholeCounts:
  """The whole batch's sizes and positions, each built once.

  Args:
    replication: the replication in progress.
    kind: a tensor's kind (`_batch.row_kinds`) in tower 0.
    counterpart: tower `index`'s tensor for tower 0's.
    copy_op: copies an op onto other inputs.
  """

  def __init__(self, replication: _context.Replication, kind: Callable[[Any],
                                                                       Any],
               counterpart: Callable[[tf.Tensor, int],
                                     tf.Tensor], copy_op: CopyOp) -> None:
    self._replication = replication
    self._kind = kind
    self._counterpart = counterpart
    self._copy_op = copy_op
    self._sizes: Dict[Any, tf.Tensor] = {}
    self._positions: Dict[Any, tf.Tensor] = {}

  def positions(self, tensor0: tf.Tensor, index: int) -> tf.Tensor:
    """Tower `index`'s rows of one device's positions for tower 0's
    positions tensor `tensor0` (`_batch.rows`: a range of a count of rows,
    or integer values computed from one): the tower's own plus the rows of
    the towers before it."""
    key = (tensor0.ref(), index)
    if key in self._positions:
      return self._positions[key]
    replication = self._replication
    op0 = tensor0.op
    own = self._counterpart(tensor0, index)
    with tf.name_scope(f"{op0.name}_whole_batch/"), tf.device(
        replication.placed[index]):
      if op0.type == "Range":
        before = [
            tf.size(self._counterpart(tensor0, other), out_type=tensor0.dtype)
            for other in range(index)
        ]
        whole = own if not before else own + combining.combine(
            "sum", before, replication.validity[:index])
        valid = replication.is_valid(index)
        if valid is not True:
          # A phantom row is a copy of the batch's last row: its position.
          last = whole - tf.size(own, out_type=tensor0.dtype)
          whole = last if valid is False else tf.where(valid, whole, last)
      else:
        inputs = []
        for t in op0.inputs:
          kind = self._kind(t)
          if isinstance(kind, row_kinds.Positions):
            inputs.append(self.positions(t, index))
          elif isinstance(kind, row_kinds.Size):
            inputs.append(self.size(t))
          else:
            inputs.append(self._counterpart(t, index))
        whole = self._copy_op(op0, inputs, replication.placed[index],
                              op0.name.replace("/", "_") +
                              f"_whole_{index}").outputs[tensor0.value_index]
    self._positions[key] = whole
    return whole

  def size(self, tensor0: tf.Tensor) -> tf.Tensor:
    """The whole batch's value of tower 0's shard-size tensor `tensor0`."""
    key = tensor0.ref()
    if key in self._sizes:
      return self._sizes[key]
    replication = self._replication
    op = tensor0.op
    kind = self._kind(tensor0)
    with tf.name_scope(f"{op.name}_whole_batch/"):
      if op.type in ("Shape", "ShapeN", "Size") and isinstance(
          self._kind(
              op.inputs[tensor0.value_index if op.type == "ShapeN" else 0]),
          (row_kinds.Rows, row_kinds.Listed)):
        whole = self._shape(op, tensor0)
      elif not op.inputs or not any(
          isinstance(self._kind(t), row_kinds.Size) for t in op.inputs):
        whole = self._handed_size(tensor0, kind)
      else:
        inputs = [
            self.size(t) if isinstance(self._kind(t), row_kinds.Size) else t
            for t in op.inputs
        ]
        whole = self._copy_op(op, inputs, replication.meeting_device,
                              op.name.replace("/", "_") +
                              "_whole").outputs[tensor0.value_index]
    self._sizes[key] = whole
    return whole

  def _shape(self, op: tf.Operation, tensor0: tf.Tensor) -> tf.Tensor:
    replication = self._replication
    x0 = op.inputs[tensor0.value_index if op.type == "ShapeN" else 0]
    rows = self._kind(x0)
    dtype = tensor0.dtype
    parts = []
    for index in range(replication.num_towers):
      x = self._counterpart(x0, index)
      with tf.device(replication.placed[index]):
        if op.type == "Size":
          parts.append(tf.size(x, out_type=dtype))
        else:
          parts.append(tf.shape(x, out_type=dtype)[rows.axis])
    total = combining.combine("sum", parts, replication.validity,
                              replication.trainers)
    if op.type == "Size":
      return total
    shape = tf.shape(x0, out_type=dtype)
    return tf.concat([shape[:rows.axis], [total], shape[rows.axis + 1:]], 0)

  def _handed_size(self, tensor0: tf.Tensor, kind: Any) -> tf.Tensor:
    """A size the tower was handed: a sparse shard's dense shape."""
    replication = self._replication
    if not isinstance(kind, row_kinds.Size) or kind.scalar or (kind.entries
                                                               != frozenset([0
                                                                            ])):
      raise ValueError(
          f"{tensor0.name} is computed from the tower's shard size in a way "
          "replicate cannot make the whole batch's; compute counts with "
          "tf.shape / tf.size of the batch's tensors.")
    parts = [
        self._counterpart(tensor0, index)[0]
        for index in range(replication.num_towers)
    ]
    total = combining.combine("sum", parts, replication.validity,
                              replication.trainers)
    return tf.concat([[total], tensor0[1:]], 0)
