"""The whole batch's moments from the towers' shards, with their gradients.

Each tower's shard gives its count, mean and variance (from the kernel in
training itself); they merge pairwise (Chan et al.: no cancellation between
large sums) into the batch's, and the gradients through the statistics the
kernel does not give are written out.
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from replicate import _context
from replicate._batch import sums


def shard_count(x: tf.Tensor, axes: Sequence[int]) -> Union[float, tf.Tensor]:
  """Values per statistic in this tower's shard: a float where static."""
  dims = [x.shape[a] for a in axes]
  if all(d is not None for d in dims):
    return float(np.prod(dims))
  return tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)


_KERNEL_MOMENTS_GRADIENT = "ReplicateShardMomentsOfFusedBatchNorm"


def kernel_moments(x: tf.Tensor, data_format: str, epsilon: float) -> tf.Tensor:
  """This shard's [mean, Bessel-corrected variance] from one fused kernel.

  The kernel in training mode computes its batch's moments in the passes it
  makes anyway (its normalised output goes unused: the layer normalises
  with the whole batch's statistics), cheaper than reductions. The
  consolidation device turns the variance into a sum of squared distances
  (times n - 1).
  Returns a [2, channels] stack.
  """
  channels = x.shape[1 if data_format.startswith("NC") else -1]
  ones = tf.ones([channels], x.dtype)  # scale and offset: y goes unused
  empty = tf.constant([], x.dtype)
  with tf.compat.v1.get_default_graph().gradient_override_map(
      {"FusedBatchNormV3": _KERNEL_MOMENTS_GRADIENT}):
    moments = tf.raw_ops.FusedBatchNormV3(
        x=x,
        scale=ones,
        offset=ones,
        mean=empty,
        variance=empty,
        epsilon=epsilon,
        data_format=data_format,
        is_training=True)
  return tf.stack([moments.batch_mean, moments.batch_variance])


@tf.RegisterGradient(_KERNEL_MOMENTS_GRADIENT)
def _kernel_moments_gradient(
    op: tf.Operation, unused_dy: Optional[tf.Tensor],
    dmean: Optional[tf.Tensor], dcorrected: Optional[tf.Tensor], *unused:
    Optional[tf.Tensor]) -> Tuple[tf.Tensor, None, None, None, None]:
  """d x = dmean / n + 2 (x - mean) dcorrected / (n - 1): an affine map.

  The fused kernel in inference mode computes it in one op (given variance
  1 - epsilon it divides by 1) where elementwise ops take four.
  """
  x, mean = op.inputs[0], op.outputs[1]
  data_format = op.get_attr("data_format").decode()
  epsilon = op.get_attr("epsilon")
  channel = 1 if data_format.startswith("NC") else x.shape.rank - 1
  axes = [a for a in range(x.shape.rank) if a != channel]
  count = shard_count(x, axes)
  bessel = (
      max(count - 1.0, 1.0) if isinstance(count, float) else tf.maximum(
          count - 1.0, 1.0))
  dmean = zero_if_none(dmean, mean)
  dcorrected = zero_if_none(dcorrected, mean)
  dx, _, _ = tf.compat.v1.nn.fused_batch_norm(
      x,
      dcorrected * (2.0 / bessel),
      dmean / count,
      mean=mean,
      variance=tf.constant(np.full(x.shape[channel], 1.0 - epsilon), x.dtype),
      epsilon=epsilon,
      data_format=data_format,
      is_training=False)
  return dx, None, None, None, None


def merged(replication: _context.Replication,
           shards: Sequence[Tuple[tf.Tensor, Union[float, tf.Tensor]]],
           head: Callable[..., Tuple[Sequence[tf.Tensor], Callable[..., Any]]],
           args: Sequence[tf.Tensor],
           corrected: bool = False) -> List[tf.Tensor]:
  """The whole batch's statistics from every tower's shard moments.

  `shards`: per tower (its [mean, m2] stack, its count). Chan et al.'s
  update: the whole batch's squared distances are the shards' own plus
  each shard's count times its mean's squared distance from the whole
  batch's mean, every term a sum of squares (no difference of large sums),
  so float32 keeps the two-pass accuracy. A tower computing on a phantom
  row (see _prepare.split) counts nothing.

  `head(mean, variance, count, *args)` -> (outputs, backward) builds what
  the layer needs from the (keepdims) statistics, and `backward(*doutputs)`
  -> (dmean, dvariance, *dargs). The merge and `head` are one custom
  gradient, written out: automatic differentiation of this per-channel
  arithmetic (broadcast reductions, gated tuples) builds ten times the ops.
  `args` (tower 0's) are `head`'s further differentiable inputs. With
  `corrected`, each shard's second statistic is its Bessel-corrected
  variance (see `kernel_moments`), times n_i - 1 here. Returns `head`'s
  outputs.
  """
  kept = [(shard, ok)
          for shard, ok in zip(shards, replication.validity)
          if ok is not False]
  rank = kept[0][0][0].shape.rank - 1
  # Floats, then an array of them; or tensors, then their stack.
  counts: Any = [shard[1] for shard, _ in kept]
  stats = [shard[0] for shard, _ in kept]
  dtype = stats[0].dtype
  if all(ok is True for _, ok in kept) and all(
      isinstance(c, float) for c in counts):
    # Static shards: each shard's weights are constants.
    count = sum(counts)
    counts = np.reshape(np.array(counts, np.float64), [-1] + [1] * rank)
    weights = tf.constant(counts / count, dtype)
    m2_weights = tf.constant(
        (np.maximum(counts - 1.0, 0.0) if corrected else np.ones_like(counts)) /
        count, dtype)
  else:
    oks = [ok for _, ok in kept]
    counts = [sums.gate(tf.cast(c, dtype), ok) for c, ok in zip(counts, oks)]
    stats = [sums.gate(t, ok) for t, ok in zip(stats, oks)]
    counts = tf.reshape(tf.stack(counts), [-1] + [1] * rank)
    count = tf.reduce_sum(counts)
    weights = counts / count
    m2_weights = (tf.maximum(counts - 1.0, 0.0)
                  if corrected else tf.ones_like(counts)) / count
  stacked = stats[0][None] if len(stats) == 1 else tf.stack(stats)

  means, m2s = tf.unstack(stacked, axis=1)
  mean = tf.reduce_sum(weights * means, 0)
  distance = means - mean
  variance = tf.reduce_sum(m2s * m2_weights + weights * tf.square(distance), 0)
  outputs, backward = head(mean, variance, count, *args)

  def grad(*doutputs: Optional[tf.Tensor]) -> List[Any]:
    dmean, dvariance, *dargs = backward(*doutputs)
    # d mean / d mean_i = n_i / n; d variance / d mean_i = 2 n_i (mean_i
    # - mean) / n (the whole mean's own term sums to zero); d variance /
    # d m2_i = 1 / n (times n_i - 1 for a corrected variance).
    dmeans = weights * (dmean + 2.0 * distance * dvariance)
    dm2s = dvariance * m2_weights
    return [tf.stack([dmeans, dm2s], axis=1)] + list(dargs)

  return _with_gradient(outputs, [stacked, *args], grad)


_WRITTEN_OUT_GRADIENT = "ReplicateBatchNormWrittenOutGradient"
# Per graph (`_context.graph_store`), written-out gradient functions by the
# name of their IdentityN.
_BACKWARDS = "written-out gradients"


def _with_gradient(outputs: Sequence[tf.Tensor], inputs: Sequence[tf.Tensor],
                   backward: Callable[..., Any]) -> List[tf.Tensor]:
  """`outputs`, computed from `inputs`, with the gradient `backward`.

  `backward(*doutputs)` -> the gradients of `inputs`. What
  `tf.custom_gradient` does in a graph, without its per-call bookkeeping
  (it watches for variables): one IdentityN whose registered gradient looks
  `backward` up.
  """
  outputs, inputs = list(outputs), list(inputs)
  graph = outputs[0].graph
  with graph.gradient_override_map({"IdentityN": _WRITTEN_OUT_GRADIENT}):
    passed = tf.raw_ops.IdentityN(input=outputs + inputs)
  _context.graph_store(graph,
                       _BACKWARDS)[passed[0].op.name] = (backward, len(outputs))
  return passed[:len(outputs)]


@tf.RegisterGradient(_WRITTEN_OUT_GRADIENT)
def _written_out_gradient(op: tf.Operation, *doutputs:
                          Optional[tf.Tensor]) -> List[Any]:
  backward, num_outputs = _context.graph_store(op.graph, _BACKWARDS)[op.name]
  # The outputs' own inputs (the forward arithmetic) get no gradient: the
  # inputs get `backward`'s.
  return [None] * num_outputs + list(backward(*doutputs[:num_outputs]))


def zero_if_none(gradient: Optional[tf.Tensor], like: tf.Tensor) -> tf.Tensor:
  return tf.zeros_like(like) if gradient is None else gradient


class Kernel:
  """The attributes and inputs of one tower-0 kernel in training."""

  def __init__(self, op: tf.Operation):
    self.op = op
    self.data_format = op.get_attr("data_format").decode()
    self.epsilon = op.get_attr("epsilon")
    try:
      self.factor = op.get_attr("exponential_avg_factor")
    except ValueError:
      self.factor = 1.0
    self.scale, self.offset, self.mean, self.variance = op.inputs[1:5]
    rank = op.inputs[0].shape.rank
    channel = 1 if self.data_format.startswith("NC") else rank - 1
    self.axes = [a for a in range(rank) if a != channel]
