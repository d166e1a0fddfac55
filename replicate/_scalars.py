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

from absl import logging
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
    if tensor.shape.rank != 0:
      return False
    if op.type == "Sum":
      # A sum of per-example values whose static shape folded them into
      # constants (`ones_like` of a loss) reads no edge of the batch.
      return self._over_batch(op.inputs[0]) and (
          self._first_is_shard(op.inputs[0]) or
          reaches_inputs(self._replication, [tensor]))
    if op.type in _SIZES:
      return reaches_inputs(self._replication, [tensor])
    return is_folded_shard_shape(op, self._replication.sizes[0])

  def _over_batch(self, tensor: tf.Tensor) -> bool:
    """Whether `tensor`'s first dimension may be the batch's (the shard's)."""
    if tensor.shape.rank is None:
      return True
    if tensor.shape.rank == 0:
      return False
    first = tf.compat.dimension_value(tensor.shape[0])
    size = self._replication.sizes[0]
    return first is None or not isinstance(size, int) or first == size

  def _first_is_shard(self, tensor: tf.Tensor) -> bool:
    """Whether `tensor`'s static first dimension is tower 0's shard size."""
    size = self._replication.sizes[0]
    return bool(tensor.shape.rank) and isinstance(size, int) and (
        tf.compat.dimension_value(tensor.shape[0]) == size)

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


# Reductions a metric applies to the values it is fed: fed a rank-0 tensor,
# it takes the per-batch scalar for a batch of one value.
_REDUCTIONS = frozenset(["Sum", "Mean", "Max", "Min", "Prod"])


class MetricsOfScalars:
  """Metric state fed a per-batch scalar, made one device's.

  A streaming metric (`tf.compat.v1.metrics.mean(loss)`, a Keras `Mean` of
  the loss, MultiHead's `loss/<head>`) fed a rank-0 tensor reduces it as a
  batch of one value (a `Sum` over no axis) and counts one value per batch.
  One device adds the whole batch's scalar once per step; every tower adding
  its shard's would give a wrong sum and N counts. So tower 0 makes the
  step's writes, with the whole batch's scalar (see `Scalars`) in place of
  its own, and later towers write nothing. The writes that belong to such a
  metric are those computed from the scalar, and those ordered after it (a
  count: `tf.compat.v1.metrics` orders it after the values, Keras after the
  total) that read nothing of the batch.
  """

  def __init__(self, replication: Replication, specs: Sequence[Any]):
    self._replication = replication
    self._specs = specs
    self._scalars = Scalars(replication, specs)
    self._tower_0 = {op.name for op in replication.tower_ops[0]}
    # A reduction the loss is computed through is the model's, not a
    # metric's: never rewired.
    loss = getattr(specs[0], "loss", None) if specs else None
    model = _data_ancestors([loss] if isinstance(loss, tf.Tensor) else [],
                            self._tower_0)
    self._reductions = {
        op.name for op in replication.tower_ops[0]
        if op.type in _REDUCTIONS and op.inputs and op.name not in model
        and op.inputs[0].shape.rank == 0
        and reaches_inputs(replication, [op.inputs[0]])}
    self._fed = self._reductions | {
        self._graph_op(name).inputs[0].op.name for name in self._reductions}
    self._rewired = set()

  def _graph_op(self, name):
    return self._replication.graph.get_operation_by_name(name)

  def make_tower_0s(self, write: tf.Operation, variable_name: str) -> bool:
    """Whether tower 0's `write` (rewired to the batch's scalar) is the step's.

    Raises:
      ValueError: in EVAL, the write is computed from a per-batch scalar
        that has no whole-batch value here, or from it and the tower's
        examples.
    """
    if not self._reductions:
      return False
    reductions, reaches_batch = self._data_sources(write)
    if reductions:
      if not self._check(write, variable_name, reductions, reaches_batch):
        return False
      for reduction in reductions:
        self._rewire(reduction, write, variable_name)
      return True
    return not reaches_batch and self._ordered_after_scalar(write)

  def _data_sources(self, write):
    """(reductions of per-batch scalars, whether examples are read otherwise).

    A shard's shape folded into a constant does not count: a metric's count
    of a rank-0 value (`tf.size`, 1) folds alike.
    """
    pending = [t.op for t in write.inputs[1:]]
    seen, reductions, reaches_batch = set(), [], False
    while pending:
      op = pending.pop()
      if op.name in seen:
        continue
      seen.add(op.name)
      if op.name in self._reductions:
        reductions.append(op)
      elif op.name in self._replication.split_op_names:
        reaches_batch = True
      elif op.name in self._tower_0:
        pending.extend(t.op for t in op.inputs)
    return reductions, reaches_batch

  def _ordered_after_scalar(self, write):
    """Whether the write depends (data or order) on a per-batch scalar."""
    pending = [write]
    seen = set()
    while pending:
      op = pending.pop()
      if op.name in seen:
        continue
      seen.add(op.name)
      if op is not write and op.name in self._fed:
        return True
      if op.name in self._tower_0:
        pending.extend(t.op for t in op.inputs)
        pending.extend(op.control_inputs)
    return False

  def _check(self, write, variable_name, reductions, reaches_batch):
    """Whether every per-batch scalar of the write has a whole-batch value."""
    fault = None
    if reaches_batch:
      fault = "together with the examples of the batch"
    else:
      for reduction in reductions:
        if self._scalars.whole_batch(reduction.inputs[0]) is None:
          scalar = reduction.inputs[0]
          fault = (f"{scalar.name!r} ({scalar.op.type}), which has no "
                   "whole-batch value known to replicate")
          break
    if fault is None:
      return True
    if getattr(self._specs[0], "mode", None) != tf.estimator.ModeKeys.EVAL:
      # Outside EVAL the Estimator never runs eval_metric_ops: left to the
      # variable's aggregation, as a write the step does not make.
      return False
    raise ValueError(
        f"Metric {self._metric_name(write, variable_name)!r} is fed a "
        f"per-batch scalar: {variable_name!r} is written from a rank-0 value "
        f"of each tower's shard, {fault}; N towers would count N values per "
        "batch where one device counts one. Feed the metric per-example "
        "values (e.g. tf.compat.v1.metrics.mean(per_example_values, "
        "weights)), or a scalar replicate can make the whole batch's: the "
        "loss, a weighted mean (tf.compat.v1.losses or a Keras loss), a ratio "
        "of sums or a sum over the batch.")

  def _rewire(self, reduction, write, variable_name):
    if reduction.name in self._rewired:
      return
    whole = self._scalars.whole_batch(reduction.inputs[0])
    # Ops have no public way to change an input once built; the reduction
    # belongs to the metric (it reduces a rank-0 value as a batch of one).
    reduction._update_input(0, whole)  # pylint: disable=protected-access
    self._rewired.add(reduction.name)
    logging.info("replicate: metric %r of a per-batch scalar gets the whole "
                 "batch's value (%s), written once",
                 self._metric_name(write, variable_name), reduction.name)

  def _metric_name(self, write, default):
    """The eval_metric_ops key whose update makes `write`, else `default`."""
    metrics = getattr(self._specs[0], "eval_metric_ops", None) or {}
    for key, metric in metrics.items():
      update = metric[1] if isinstance(metric, tuple) else None
      if update is not None and _depends_on(update, write, self._tower_0):
        return key
    return default


def _depends_on(tensor_or_op, op: tf.Operation, inside) -> bool:
  start = getattr(tensor_or_op, "op", tensor_or_op)
  pending, seen = [start], set()
  while pending:
    current = pending.pop()
    if current is op:
      return True
    if current.name in seen or current.name not in inside:
      continue
    seen.add(current.name)
    pending.extend(t.op for t in current.inputs)
    pending.extend(current.control_inputs)
  return False


def _data_ancestors(tensors, inside) -> set:
  """Names of the ops in `inside` that `tensors` are computed from."""
  pending, seen = [t.op for t in tensors], set()
  while pending:
    op = pending.pop()
    if op.name in seen or op.name not in inside:
      continue
    seen.add(op.name)
    pending.extend(t.op for t in op.inputs)
  return seen
