"""The variance between the towers' shards, for moving variances.

A batch-norm layer in each tower measures its shard's variance; one device
measures the whole batch's, which also holds the spread of the shards' means
around the batch mean:

  var(batch) = sum_i f_i * (var_i + (mean_i - mean)^2),  f_i = n_i / n.

Before the towers' moving-variance writes are averaged (MEAN aggregation),
each tower's variance statistic, where the write consumes it, gets its
between-shard term, so that the average is one device's variance. The
statistics recognised are a mean over the batch axis of squared differences
from the batch mean, as `tf.nn.moments` (Keras and v1 batch norm on non-4-D
inputs) and `tf.math.reduce_variance` build it, and
`FusedBatchNorm*`'s (4-D inputs), which is Bessel-corrected:

  var(batch) = (sum_i (n_i - 1) var_i + n_i (mean_i - mean)^2) / (n - 1).
"""

from typing import (
    Any,
    Callable,
    FrozenSet,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    cast,
)

from absl import logging
import tensorflow as tf

from replicate import _graph
from replicate import _tf
from replicate._batch import sums

# Ops that pass a statistic on unchanged in value (shape and dtype aside).
_VALUE_PRESERVING = frozenset(
    ["Identity", "Squeeze", "Reshape", "ExpandDims", "Cast"])
# Ops between a variance's squared differences and the batch mean they take.
_PASS_MEAN = frozenset(["StopGradient", "Identity"])
# Ops a statistic may pass through on its way to the write: those, or an
# elementwise combination with the variable's value and a decay.
_PATH_OPS = _VALUE_PRESERVING | frozenset(
    ["Sub", "Mul", "AddV2", "Add", "RealDiv"])
_FUSED = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
_MAX_DEPTH = 8


class _Statistic(NamedTuple):
  consumer: tf.Operation  # the op on the write's path to rewire
  position: int  # which input of the consumer
  variance: tf.Tensor  # the shard's variance
  mean: tf.Tensor  # the shard's mean, same shape as variance
  sample_size: Optional[tf.Tensor]  # values per channel (Bessel-corrected only)


# The edges (op, input position) from a write back to an op reading a
# statistic.
_Path = Tuple[Tuple[tf.Operation, int], ...]


def add_between_shard_variance(
    writes: Sequence[tf.Operation], weights: Sequence[Any],
    weighted_sum: Callable[[List[tf.Tensor]], tf.Tensor]) -> bool:
  """Adds the between-shard term to each tower's variance before a MEAN.

  Args:
    writes: the towers' writes to one variable, tower 0 first.
    weights: each tower's share of the batch (floats or scalar tensors).
    weighted_sum: `values -> sum_i weights[i] * values[i]`, ignoring towers
      of weight 0.

  Returns:
    Whether the writes were moving variances and got the term.
  """
  found = [_find_statistic(write) for write in writes]
  if any(s is None for s in found):
    return False
  statistics = cast(List[_Statistic], found)  # None is ruled out above
  bessel = statistics[0].sample_size is not None
  if any((s.sample_size is not None) != bessel for s in statistics):
    return False
  batch_mean = weighted_sum([s.mean for s in statistics])
  if bessel:
    # A tower of weight 0 holds no example (a phantom row's, see
    # _prepare.split).
    counts = [
        sums.gate(tf.cast(s.sample_size, s.variance.dtype), weight > 0)
        for s, weight in zip(statistics, weights)
    ]
    total = tf.add_n(counts)
  for index, statistic in enumerate(statistics):
    variance, mean = statistic.variance, statistic.mean
    spread = tf.math.squared_difference(mean, batch_mean)
    if bessel:
      count = counts[index]
      # Scale so that sum_i (count_i / total) * corrected is one device's.
      several = total > 1.0
      denominator = tf.where(several, total - 1.0, 1.0)
      share = tf.math.divide_no_nan(count - 1.0, count)
      corrected = tf.where(several,
                           (variance * share + spread) * (total / denominator),
                           variance)
    else:
      corrected = variance + spread
    _replace_input(statistic, corrected)
  logging.info("replicate: %s gets the variance between the towers' shards",
               writes[0].inputs[0].op.name)
  return True


def _replace_input(statistic: _Statistic, corrected: tf.Tensor) -> None:
  old = statistic.consumer.inputs[statistic.position]
  corrected = tf.reshape(tf.cast(corrected, old.dtype), tf.shape(old))
  # Ops have no public way to change an input once built.
  _tf.update_input(statistic.consumer, statistic.position, corrected)


def _find_statistic(write: tf.Operation) -> Optional[_Statistic]:
  """The one batch-variance statistic on the path to the written value.

  Its `consumer` and `position` are where the write's path may be rewired
  without changing any tensor read elsewhere (see `_rewire_point`).
  """
  found = []
  pending: List[Tuple[tf.Operation, int, int, _Path]] = [(write, 1, 0, ())]
  while pending:
    op, position, depth, path = pending.pop()
    path += ((op, position),)
    tensor = op.inputs[position]
    statistic = _statistic(op, position, tensor)
    if statistic is not None:
      found.append((statistic, path))
      continue
    source = tensor.op
    if source.type in _PATH_OPS and depth < _MAX_DEPTH:
      pending.extend(
          (source, i, depth + 1, path) for i in range(len(source.inputs)))
  if len(found) != 1:
    return None
  statistic, path = found[0]
  point = _rewire_point(path)
  if point is None:
    logging.warning(
        "replicate: %s is not given the variance between the towers' shards: "
        "its statistic is read by the model on the way to the write, and "
        "not only through value-preserving ops; the moving variance is the "
        "shards' mean variance", write.inputs[0].op.name)
    return None
  return statistic._replace(consumer=point[0], position=point[1])


def _rewire_point(path: _Path) -> Optional[Tuple[tf.Operation, int]]:
  """Where a corrected statistic may enter the write's path, or None.

  `path` is the edges (op, input position) from the write back to the op
  reading the statistic. The statistic's tensor, or one on its way, may be
  read elsewhere too (unfused batch norm normalises with the very tensor
  the moving-variance update reads); those readers, the normalisation and
  its gradients, must keep the value they were built with. So the edge is
  the one nearest the write whose tensor has readers off the path: the
  tensors after it feed the write only. The ops between the statistic and
  that edge must pass the value on unchanged, so that the corrected value
  reshaped and cast stands for their output.
  """
  on_path = {op for op, _ in path}
  point = len(path) - 1
  for index, (op, position) in enumerate(path):
    if any(c not in on_path for c in op.inputs[position].consumers()):
      point = index
      break
  if all(op.type in _VALUE_PRESERVING for op, _ in path[point + 1:]):
    return path[point]
  return None


def _statistic(consumer: tf.Operation, position: int,
               tensor: tf.Tensor) -> Optional[_Statistic]:
  op = tensor.op
  if op.type in _FUSED and tensor.value_index == 2 and op.get_attr(
      "is_training"):
    x, mean = op.inputs[0], op.outputs[1]
    count = tf.cast(tf.size(x), tf.float64) / tf.cast(tf.size(mean), tf.float64)
    return _Statistic(consumer, position, tensor, mean, count)
  if op.type != "Mean":
    return None
  difference = _squared_difference(op.inputs[0].op)
  if difference is None:
    return None
  values, mean = difference
  mean = _graph.look_through(mean, _PASS_MEAN)
  if mean.op.type != "Mean" or mean.op.inputs[0] is not values:
    return None
  axes = _axes(op)
  if axes is None or 0 not in axes or axes != _axes(mean.op):
    return None
  return _Statistic(consumer, position, tensor,
                    tf.reshape(mean, tf.shape(tensor)), None)


def _squared_difference(
    op: tf.Operation) -> Optional[Tuple[tf.Tensor, tf.Tensor]]:
  """(x, m) for SquaredDifference(x, m) or Square(x - m); else None."""
  if op.type == "SquaredDifference":
    return op.inputs[0], op.inputs[1]
  if op.type == "Square" and op.inputs[0].op.type == "Sub":
    return op.inputs[0].op.inputs[0], op.inputs[0].op.inputs[1]
  return None


def _axes(mean_op: tf.Operation) -> Optional[FrozenSet[int]]:
  """The axes a Mean op averages over, made non-negative; None if unknown."""
  axes = tf.get_static_value(mean_op.inputs[1])
  rank = mean_op.inputs[0].shape.rank
  if axes is None:
    return None
  axes = [int(a) for a in tf.nest.flatten(axes.tolist())]
  if any(a < 0 for a in axes):
    if rank is None:
      return None
    axes = [a % rank for a in axes]
  return frozenset(axes)
