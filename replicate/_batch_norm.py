"""Batch normalization in training with the whole batch's statistics.

On one device a batch-norm kernel in training (`FusedBatchNorm*` with
`is_training`: Keras' fused layer, `tf.compat.v1.layers`, tf-slim, canned
estimators' `batch_norm=True` on images, a direct
`tf.compat.v1.nn.fused_batch_norm`) normalises with the batch's mean and
variance, and its gradients run through them. Each tower's kernel sees its
shard only; `_whole` hands every such kernel of the towers here, after
they are built, and every reader of its outputs is given the whole batch's
(`sync_batch_norm=True`, the default). Batch norm written with reductions
(`tf.nn.moments`, the non-fused layers) needs nothing: its reductions are
the whole batch's by construction (`_whole`).

Two ways, both one device's result:

- where the towers are CPUs of one machine (one memory: a tensor passed
  between them is shared, not copied), one kernel in training runs on the
  towers' shards concatenated, on the consolidation device, and each tower
  reads its rows of the output (a ReLU reading them runs there too, once:
  TensorFlow's graph optimiser fuses it into the kernel on one device);
- otherwise each tower's shard moments come from the kernel itself, are
  merged on the consolidation device (Chan et al.'s pairwise update, no
  cancellation between large sums), and each tower normalises its rows
  with the kernel in inference mode; the gradients through the statistics
  that kernel does not give are written out (`_merged`).
"""

import weakref
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf
from absl import logging

from replicate import _aggregate
from replicate import _context

# tf.compat.v1.nn.fused_batch_norm raises a smaller epsilon to this.
FUSED_MIN_EPSILON = 1.001e-5


def _shard_count(x, axes):
  """Values per statistic in this tower's shard: a float where static."""
  dims = [x.shape[a] for a in axes]
  if all(d is not None for d in dims):
    return float(np.prod(dims))
  return tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)


_KERNEL_MOMENTS_GRADIENT = "ReplicateShardMomentsOfFusedBatchNorm"


def _kernel_moments(x, data_format: str, epsilon: float):
  """This shard's [mean, Bessel-corrected variance] from one fused kernel.

  The kernel in training mode computes its batch's moments in the passes it
  makes anyway (its normalised output goes unused: the layer normalises
  with the whole batch's statistics), cheaper than reductions. The hub
  turns the variance into a sum of squared distances (times n - 1).
  Returns a [2, channels] stack.
  """
  channels = x.shape[1 if data_format.startswith("NC") else -1]
  ones = tf.ones([channels], x.dtype)  # scale and offset: y goes unused
  empty = tf.constant([], x.dtype)
  with tf.compat.v1.get_default_graph().gradient_override_map(
      {"FusedBatchNormV3": _KERNEL_MOMENTS_GRADIENT}):
    moments = tf.raw_ops.FusedBatchNormV3(
        x=x, scale=ones, offset=ones, mean=empty, variance=empty,
        epsilon=epsilon, data_format=data_format, is_training=True)
  return tf.stack([moments.batch_mean, moments.batch_variance])


@tf.RegisterGradient(_KERNEL_MOMENTS_GRADIENT)
def _kernel_moments_gradient(op, unused_dy, dmean, dcorrected, *unused):
  """d x = dmean / n + 2 (x - mean) dcorrected / (n - 1): an affine map.

  The fused kernel in inference mode computes it in one op (given variance
  1 - epsilon it divides by 1) where elementwise ops take four.
  """
  x, mean = op.inputs[0], op.outputs[1]
  data_format = op.get_attr("data_format").decode()
  epsilon = op.get_attr("epsilon")
  channel = 1 if data_format.startswith("NC") else x.shape.rank - 1
  axes = [a for a in range(x.shape.rank) if a != channel]
  count = _shard_count(x, axes)
  bessel = (max(count - 1.0, 1.0) if isinstance(count, float) else
            tf.maximum(count - 1.0, 1.0))
  dmean = _zero_if_none(dmean, mean)
  dcorrected = _zero_if_none(dcorrected, mean)
  dx, _, _ = tf.compat.v1.nn.fused_batch_norm(
      x, dcorrected * (2.0 / bessel), dmean / count, mean=mean,
      variance=tf.constant(np.full(x.shape[channel], 1.0 - epsilon),
                           x.dtype),
      epsilon=epsilon, data_format=data_format, is_training=False)
  return dx, None, None, None, None


def _merged(replication, shards, head, args, corrected=False):
  """The whole batch's statistics from every tower's shard moments.

  `shards`: per tower (its [mean, m2] stack, its count). Chan et al.'s
  update: the whole batch's squared distances are the shards' own plus
  each shard's count times its mean's squared distance from the whole
  batch's mean, every term a sum of squares (no difference of large sums),
  so float32 keeps the two-pass accuracy. A tower computing on a phantom
  row (see _split) counts nothing.

  `head(mean, variance, count, *args)` -> (outputs, backward) builds what
  the layer needs from the (keepdims) statistics, and `backward(*doutputs)`
  -> (dmean, dvariance, *dargs). The merge and `head` are one custom
  gradient, written out: automatic differentiation of this per-channel
  arithmetic (broadcast reductions, gated tuples) builds ten times the ops.
  `args` (tower 0's) are `head`'s further differentiable inputs. With
  `corrected`, each shard's second statistic is its Bessel-corrected
  variance (see `_kernel_moments`), times n_i - 1 here. Returns `head`'s
  outputs.
  """
  kept = [(shard, ok) for shard, ok in zip(shards, replication.validity)
          if ok is not False]
  rank = kept[0][0][0].shape.rank - 1
  counts = [shard[1] for shard, _ in kept]
  stats = [shard[0] for shard, _ in kept]
  dtype = stats[0].dtype
  if all(ok is True for _, ok in kept) and all(
      isinstance(c, float) for c in counts):
    # Static shards: each shard's weights are constants.
    count = sum(counts)
    counts = np.reshape(np.array(counts, np.float64), [-1] + [1] * rank)
    weights = tf.constant(counts / count, dtype)
    m2_weights = tf.constant(
        (np.maximum(counts - 1.0, 0.0) if corrected else np.ones_like(counts))
        / count, dtype)
  else:
    oks = [ok for _, ok in kept]
    counts = [_aggregate.gate(tf.cast(c, dtype), ok)
              for c, ok in zip(counts, oks)]
    stats = [_aggregate.gate(t, ok) for t, ok in zip(stats, oks)]
    counts = tf.reshape(tf.stack(counts), [-1] + [1] * rank)
    count = tf.reduce_sum(counts)
    weights = counts / count
    m2_weights = (tf.maximum(counts - 1.0, 0.0) if corrected else
                  tf.ones_like(counts)) / count
  stacked = stats[0][None] if len(stats) == 1 else tf.stack(stats)

  means, m2s = tf.unstack(stacked, axis=1)
  mean = tf.reduce_sum(weights * means, 0)
  distance = means - mean
  variance = tf.reduce_sum(m2s * m2_weights + weights * tf.square(distance),
                           0)
  outputs, backward = head(mean, variance, count, *args)

  def grad(*doutputs):
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


def _with_gradient(outputs, inputs, backward):
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
  _context.graph_store(graph, _BACKWARDS)[passed[0].op.name] = (
      backward, len(outputs))
  return passed[:len(outputs)]


@tf.RegisterGradient(_WRITTEN_OUT_GRADIENT)
def _written_out_gradient(op, *doutputs):
  backward, num_outputs = _context.graph_store(op.graph, _BACKWARDS)[op.name]
  # The outputs' own inputs (the forward arithmetic) get no gradient: the
  # inputs get `backward`'s.
  return [None] * num_outputs + list(backward(*doutputs[:num_outputs]))


def _zero_if_none(gradient, like):
  return tf.zeros_like(like) if gradient is None else gradient


class _Kernel:
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


def whole_batch(replication: _context.Replication, op: tf.Operation,
                shards: Sequence[tf.Tensor]
                ) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
  """Each tower's rows and the batch statistics, for kernel `op` (tower 0's).

  `shards`: every tower's input of the kernel. Returns (each tower's
  normalised rows, [batch mean, batch variance] as the kernel in training
  returns them: the variance Bessel-corrected, both moved towards the
  running statistics it was given with an `exponential_avg_factor`).
  """
  kernel = _Kernel(op)
  with tf.name_scope(op.name + "_whole_batch/"):
    if _CONCATENATE_ON_HOST and _on_one_host(replication):
      return _on_concatenation(replication, kernel, shards)
    return _through_hub(replication, kernel, shards)


# Whether towers on one machine's CPUs normalise the concatenated batch
# (tests turn it off to exercise the hub on virtual CPUs).
_CONCATENATE_ON_HOST = True
_logged_host = weakref.WeakSet()


def _on_one_host(replication) -> bool:
  """Whether every tower is a CPU of the hub's task: one memory, one pool."""
  hub = tf.DeviceSpec.from_string(replication.hub or "")
  place = (hub.job, hub.replica, hub.task)
  specs = [tf.DeviceSpec.from_string(d or "") for d in replication.devices]
  shared = bool(specs) and all(
      s.device_type == "CPU" and (s.job, s.replica, s.task) == place
      for s in specs)
  if shared and replication.graph not in _logged_host:
    _logged_host.add(replication.graph)
    logging.info(
        "replicate: the towers are CPUs of one machine: each fused batch-norm "
        "kernel in training runs once, on the concatenated batch, on %s",
        replication.hub)
  return shared


# Per graph: a tower's rows of a kernel's output -> (the output, placement).
_WHOLE_OUTPUTS = "batch-norm outputs on the concatenated batch"


def _on_concatenation(replication, kernel: _Kernel, shards):
  """One kernel in training on the towers' shards, concatenated.

  What one device runs, on the same rows in the same order: its outputs,
  statistics and gradients are one device's.
  """
  with tf.device(replication.hub):
    whole, place = _concatenated(replication, shards)
    outputs = tf.raw_ops.FusedBatchNormV3(
        x=whole, scale=kernel.scale, offset=kernel.offset, mean=kernel.mean,
        variance=kernel.variance, epsilon=kernel.epsilon,
        exponential_avg_factor=kernel.factor,
        data_format=kernel.data_format, is_training=True)
    rows = place(outputs.y)
  store = _context.graph_store(replication.graph, _WHOLE_OUTPUTS)
  for tower_rows in rows:
    store[tower_rows.ref()] = (outputs.y, place)
  return rows, [outputs.batch_mean, outputs.batch_variance]


def _concatenated(replication, shards):
  """The batch's rows from every tower's shard, and how to give them back.

  Returns (the batch, place): `place(outputs of the batch)` -> each tower's
  rows of them. A tower computing on a phantom row (see _split) adds no row
  to the batch; it gets the batch's last row (its phantom row's original).
  """
  validity = replication.validity
  kept = [x for x, ok in zip(shards, validity) if ok is not False]
  rows = [x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]
          for x in kept]
  whole = kept[0] if len(kept) == 1 else tf.concat(kept, 0)
  real = whole
  if any(ok is not True and ok is not False for ok in validity):
    # Dynamic shards: towers past the batch's last row read a phantom row.
    batch = tf.cast(tf.add_n([tf.cast(s, tf.int64) for s, ok in
                              zip(replication.sizes, validity)
                              if ok is not False]), tf.int32)
    real = whole[:batch]

  def place(outputs):
    if real is not whole:
      phantoms = tf.shape(whole)[0] - tf.shape(real)[0]
      tile = tf.concat([[phantoms], tf.ones([outputs.shape.rank - 1],
                                            tf.int32)], 0)
      # Only a batch smaller than the towers has phantom rows: the others
      # pass the outputs on uncopied.
      outputs = tf.cond(
          phantoms > 0,
          lambda: tf.concat([outputs, tf.tile(outputs[-1:], tile)], 0),
          lambda: outputs)
    parts = [outputs] if len(kept) == 1 else tf.split(outputs, rows, 0)
    parts = iter(parts)
    return [next(parts) if ok is not False else outputs[-1:]
            for ok in validity]

  return real, place


def relu_once(replication: _context.Replication, rows: Sequence[tf.Tensor]):
  """A ReLU of a kernel's rows runs once, on the concatenated output.

  Grappler fuses a ReLU into the kernel on one device; each tower's ReLU of
  its rows would run separately. So every tower's `tf.nn.relu` of its rows
  should read its rows of one ReLU of the whole output instead
  (elementwise: the same values). Returns (tower index, its Relu op, its
  rows of the whole ReLU) for the caller to substitute.
  """
  store = _context.graph_store(replication.graph, _WHOLE_OUTPUTS)
  relus = []
  for tower_rows in rows:
    found = store.get(tower_rows.ref())
    if found is None:
      return []
    relus.append([op for op in tower_rows.consumers() if op.type == "Relu"])
  if not all(relus):
    return []
  whole, place = store[rows[0].ref()]
  with tf.device(replication.hub):
    activated = place(tf.nn.relu(whole))
  return [(index, (relu, tower_rows))
          for index, (tower_relus, tower_rows) in enumerate(
              zip(relus, activated))
          for relu in tower_relus]


def _through_hub(replication, kernel: _Kernel, shards):
  """Shard moments merged on the hub; each tower normalises its rows."""
  dtype = kernel.scale.dtype
  inputs = [x if x.dtype == dtype else tf.cast(x, dtype) for x in shards]
  stats = []
  for index, x in enumerate(inputs):
    with tf.device(replication.placed[index]):
      stats.append((_kernel_moments(x, kernel.data_format, kernel.epsilon),
                    _shard_count(x, kernel.axes)))
  epsilon = kernel.epsilon

  def head(mean, variance, count, gamma, beta):
    """On the hub: the kernel's inputs and the batch statistics' values."""
    r = tf.math.rsqrt(variance + epsilon)
    if isinstance(count, float):
      bessel = count / max(count - 1.0, 1.0)
    else:
      bessel = count / tf.maximum(count - 1.0, 1.0)
    corrected = variance * bessel

    def backward(dscale, doffset, *unused):
      # The kernel in inference mode holds mean and variance constant; one
      # device's gradient also runs through them: y = gamma (x - mean) r +
      # beta gives d/dmean = -sum(dy) gamma r = -doffset gamma r and
      # d/dvariance = -sum(dy (x - mean) r) gamma r^2 / 2 = -dscale gamma
      # r^2 / 2 (dscale, doffset: the kernel's gradients of scale, offset).
      # The returned batch statistics pass no gradient, as the training
      # kernel's gradient in TensorFlow ignores them.
      del unused
      dscale = _zero_if_none(dscale, gamma)
      doffset = _zero_if_none(doffset, beta)
      gamma_r = gamma * r
      return -doffset * gamma_r, -0.5 * dscale * gamma_r * r, dscale, doffset

    return (gamma, beta, mean, variance, corrected), backward

  with tf.device(replication.hub):
    scale, offset, mean, variance, corrected = _merged(
        replication, stats, head, (kernel.scale, kernel.offset),
        corrected=True)
  rows = []
  for index, (x, shard) in enumerate(zip(inputs, shards)):
    with tf.device(replication.placed[index]):
      y, _, _ = tf.compat.v1.nn.fused_batch_norm(
          x, scale, offset, mean=mean, variance=variance, epsilon=epsilon,
          data_format=kernel.data_format, is_training=False)
      rows.append(y if y.dtype == shard.dtype else tf.cast(y, shard.dtype))
  if kernel.factor != 1.0:
    with tf.device(replication.hub):
      factor = kernel.factor
      mean = (1.0 - factor) * kernel.mean + factor * mean
      corrected = (1.0 - factor) * kernel.variance + factor * corrected
  return rows, [mean, corrected]
