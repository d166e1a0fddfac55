"""Per-batch scalars: a tower's rank-0 value of its shard, made the batch's.

A model_fn computes some scalars of its batch once per step: the loss, a
weighted mean (`tf.compat.v1.losses` and Keras losses divide a sum of
weighted values by a denominator: a `DivNoNan` named `value`), a ratio of
sums over the batch (a v1 head's `average_loss`), a sum over the batch.
Each tower computes its shard's; summaries and metrics of such a scalar
need the whole batch's, which is built here, on the consolidation device,
from the towers' counterparts (tower i's op of tower 0's name under
`tower_i/`):

- the loss: `_loss.combine` of the towers' losses (the very tensor the
  merged EstimatorSpec reports);
- a weighted mean or a ratio of sums: the towers' numerators summed over
  their denominators summed;
- a sum over the batch: the towers' sums added up.

A tower computing on a phantom row (see `_split`) adds nothing. Any other
scalar (a maximum, a mean that is no weighted mean) has no whole-batch
value known here.
"""

import re
from typing import Any, Optional, Sequence

import tensorflow as tf

from replicate import _aggregate
from replicate import _loss
from replicate._context import Replication

_PASS = frozenset(["Identity", "Cast"])
_RATIOS = frozenset(["DivNoNan", "RealDiv", "Div", "TrueDiv"])
_SIZES = frozenset(["Size"])
# The names `tf.shape` / `tf.size` give the constant they fold a static
# shape into.
_FOLDED_SHAPE_NAME = re.compile(r"^(Shape|Size)(?:_\d+)?$")


def skip_passes(tensor: tf.Tensor) -> tf.Tensor:
  """`tensor` before any identities and casts."""
  while tensor.op.type in _PASS and tensor.op.inputs:
    tensor = tensor.op.inputs[0]
  return tensor


def is_folded_shard_shape(op: tf.Operation, shard_size) -> bool:
  """Whether `op` is `tf.shape`/`tf.size` of a shard, folded to a constant.

  With a static shape `tf.shape(x)` and `tf.size(x)` build a Const (named
  `Shape`/`Size` by default) with no edge to `x`: a shard's size would pass
  for a constant that is the same in every tower. Taken as one: a `Shape`
  whose first dimension is the shard's size, a `Size` that it divides.
  """
  if op.type != "Const" or not isinstance(shard_size, int) or shard_size < 1:
    return False
  kind = _FOLDED_SHAPE_NAME.match(op.name.rsplit("/", 1)[-1])
  if kind is None:
    return False
  value = tf.make_ndarray(op.get_attr("value"))
  if kind.group(1) == "Shape":
    return value.ndim == 1 and value.size > 0 and int(value[0]) == shard_size
  return value.ndim == 0 and int(value) > 0 and int(value) % shard_size == 0


def reaches_inputs(replication: Replication, tensors: Sequence[tf.Tensor],
                   index: int = 0, folded: bool = True) -> bool:
  """Whether tower `index`'s `tensors` are computed from its shard (data).

  `folded`: whether a shard's shape folded into a constant counts.
  """
  inside = replication.tower_op_names
  shard_size = replication.sizes[index] if folded else None
  pending = [t.op for t in tensors]
  seen = set()
  while pending:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.name in replication.split_op_names or is_folded_shard_shape(
        op, shard_size):
      return True
    if op.name in inside:
      pending.extend(t.op for t in op.inputs)
  return False


class Scalars:
  """Finds the whole batch's value of tower 0's per-batch scalars."""

  def __init__(self, replication: Replication, specs: Sequence[Any]):
    self._replication = replication
    self._graph = replication.graph
    losses = [getattr(spec, "loss", None) for spec in specs]
    self._losses = losses if all(
        isinstance(loss, tf.Tensor) for loss in losses) else None
    self._cache = {}

  def whole_batch(self, tensor: tf.Tensor) -> Optional[tf.Tensor]:
    """The whole batch's value of tower 0's scalar `tensor`, or None.

    None where `tensor` is not rank 0, reads nothing of the batch, or is
    none of the scalars this module combines.
    """
    if tensor.shape.rank != 0 or not reaches_inputs(self._replication,
                                                    [tensor]):
      return None
    key = tensor.ref()
    if key not in self._cache:
      self._cache[key] = self._build(tensor)
    return self._cache[key]

  def _build(self, tensor):
    source = skip_passes(tensor)
    with tf.device(self._replication.hub), \
        tf.name_scope("whole_batch_scalar"):
      if self._losses is not None and source is skip_passes(self._losses[0]):
        value = _loss.combine(self._replication, self._losses)
      elif self._is_ratio(source):
        value = self._ratio(source)
      elif self._is_sum(source):
        value = self._sum(source)
      else:
        return None
      return None if value is None else tf.cast(value, tensor.dtype)

  def _is_sum(self, tensor: tf.Tensor) -> bool:
    """A sum over the batch: a Sum to rank 0, a size, or a summed loss."""
    tensor = skip_passes(tensor)
    op = tensor.op
    if (self._losses is not None and tensor is skip_passes(self._losses[0])
        and _aggregate.is_sum(self._replication.loss_reduction)):
      return True
    if op.type == "Sum" or op.type in _SIZES:
      return tensor.shape.rank == 0 and reaches_inputs(self._replication,
                                                       [tensor])
    return is_folded_shard_shape(op, self._replication.sizes[0]) and (
        tensor.shape.rank == 0)

  def _is_ratio(self, tensor: tf.Tensor) -> bool:
    """A weighted mean (`DivNoNan` named `value`) or a ratio of sums."""
    op = tensor.op
    if op.type not in _RATIOS or any(t.shape.rank != 0 for t in op.inputs):
      return False
    if op.type == "DivNoNan" and op.name.rsplit("/", 1)[-1] == "value":
      return True
    return all(self._is_sum(t) for t in op.inputs)

  def _counterparts(self, tensor: tf.Tensor):
    """Tower i's tensor of tower 0's `tensor`, per tower; None if missing."""
    root = self._replication.root_name_scope
    name = tensor.op.name
    relative = name[len(root) + 1:] if root else name
    tensors = [tensor]
    for index in range(1, self._replication.num_towers):
      other = f"tower_{index}/{relative}"
      other = f"{root}/{other}" if root else other
      try:
        op = self._graph.get_operation_by_name(other)
      except KeyError:
        return None
      if op.type != tensor.op.type:
        return None
      tensors.append(op.outputs[tensor.value_index])
    return tensors

  def _sum(self, tensor):
    tensor = skip_passes(tensor)
    if self._losses is not None and tensor is skip_passes(self._losses[0]):
      tensors = self._losses
    else:
      tensors = self._counterparts(tensor)
    if tensors is None:
      return None
    tensors = [tf.cast(t, tensor.dtype) for t in tensors]
    return _aggregate.real_sum(tensors, self._replication.validity)

  def _ratio(self, tensor):
    ratios = self._counterparts(tensor)
    if ratios is None:
      return None
    validity = self._replication.validity
    numerator = _aggregate.real_sum([r.op.inputs[0] for r in ratios], validity)
    denominator = _aggregate.real_sum([r.op.inputs[1] for r in ratios],
                                      validity)
    if tensor.op.type == "DivNoNan":
      return tf.math.divide_no_nan(numerator, denominator)
    return tf.math.truediv(numerator, tf.cast(denominator, numerator.dtype))
