"""Batch normalization with the whole batch's statistics (`sync_batch_norm`).

On one device a batch-norm layer in training normalises with the batch's
mean and variance, and its gradients run through them. A tower sees only
its shard, so while the towers are built for training, Keras'
`BatchNormalization` (which `tf.compat.v1.layers.batch_normalization` and
the canned DNN estimators' `batch_norm=True` use too) takes its moments
from one meeting of the towers per layer (see `_lockstep`): each tower
computes its shard's count, mean and sum of squared distances from that
mean (two passes, as `tf.nn.moments` and the fused kernel do), and the hub
merges them into the whole batch's (Chan et al.'s pairwise update: no
cancellation between large sums). Gradients run back through the merge to
every tower. A layer Keras would fuse still normalises with the fused
kernel, in inference mode, given the whole batch's statistics (see
`_normalisation_parameters` for how their gradients flow), and updates
its moving statistics as the fused kernel would (Bessel-corrected
variance). Layers with `virtual_batch_size` keep their own statistics
(their ghost batches do not follow the towers' shards), and so does a
fused layer whose `training` is a tensor rather than a Python bool (its
kernel runs inside a tf.cond).
"""

import contextlib
import threading

import numpy as np
import tensorflow as tf
from absl import logging

from replicate import _aggregate
from replicate import _collectives
from replicate import _context
from replicate import _lockstep

try:
  # Keras' batch normalization has no public hook for its moments; these
  # private methods are where every flavour of the layer computes them.
  from keras.src.layers.normalization import batch_normalization as _keras_bn  # pylint: disable=g-import-not-at-top
  from keras.src.utils import control_flow_util as _control_flow_util  # pylint: disable=g-import-not-at-top
except ImportError:
  _keras_bn = None

_lock = threading.Lock()
_installed = {"count": 0, "originals": None}
# tf.compat.v1.nn.fused_batch_norm raises a smaller epsilon to this.
_FUSED_MIN_EPSILON = 1.001e-5
_MEETING = "synchronised batch normalization"


def _whole_batch(layer, axes) -> bool:
  replication = _context.current_replication()
  return (replication is not None and replication.sync_batch_norm and
          replication.num_towers > 1 and replication.tower is not None and
          0 in axes and layer.virtual_batch_size is None)


def whole_batch_moments(x, axes, keep_dims: bool, weights=None):
  """The whole batch's (mean, variance, count) over `axes`, from every tower.

  Two passes, as `tf.nn.moments` / `tf.nn.weighted_moments`: the mean, then
  the mean squared distance from it (the mean held constant for the
  gradient), each a sum over the towers. Used for masked layers; unmasked
  ones take the leaner `_shard_moments` / `_merged` route.
  """
  axes = list(axes)
  ones = tf.ones_like(x) if weights is None else tf.broadcast_to(
      tf.cast(weights, x.dtype), tf.shape(x))
  with tf.name_scope("whole_batch_moments"):
    count, total = _collectives.batch_sum([
        tf.reduce_sum(ones, axes, keepdims=True),
        tf.reduce_sum(x * ones, axes, keepdims=True)])
    mean = total / count
    distance = tf.reduce_sum(
        ones * tf.math.squared_difference(x, tf.stop_gradient(mean)), axes,
        keepdims=True)
    variance = _collectives.batch_sum(distance) / count
    if not keep_dims:
      mean, variance, count = (tf.squeeze(t, axes)
                               for t in (mean, variance, count))
  return mean, variance, count


def _shard_count(x, axes):
  """Values per statistic in this tower's shard: a float where static."""
  dims = [x.shape[a] for a in axes]
  if all(d is not None for d in dims):
    return float(np.prod(dims))
  return tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)


def _shard_moments(x, axes, count):
  """This shard's mean and sum of squared distances from it (keepdims).

  A custom gradient: dx = dmean / count + 2 (x - mean) dm2, three
  elementwise ops where automatic differentiation of the reductions and
  the squared difference builds about fifteen.
  """
  axes_t = tf.constant(axes, tf.int32)

  @tf.custom_gradient
  def moments(x):
    mean = tf.reduce_mean(x, axes_t, keepdims=True)
    m2 = tf.reduce_sum(tf.math.squared_difference(x, mean), axes_t,
                       keepdims=True)

    def grad(dmean, dm2):
      parts = []
      if dm2 is not None:
        parts.append((x - mean) * (2.0 * dm2))
      if dmean is not None:
        parts.append(dmean / count)
      if not parts:
        return tf.zeros_like(x)
      return parts[0] if len(parts) == 1 else parts[0] + parts[1]

    return (mean, m2), grad

  return moments(x)


def _merged(replication, shards):
  """The whole batch's (mean, variance, count) from every tower's moments.

  Chan et al.'s update: the whole batch's squared distances are the
  shards' own plus each shard's count times its mean's squared distance
  from the whole batch's mean. Every term is a sum of squares (no
  difference of large sums), so float32 keeps the two-pass accuracy.
  A tower computing on a phantom row (see _split) counts nothing.
  """
  kept = [(shard, ok) for shard, ok in zip(shards, replication.validity)
          if ok is not False]
  rank = kept[0][0][0].shape.rank
  counts = [shard[2] for shard, _ in kept]
  means = [shard[0] for shard, _ in kept]
  m2s = [shard[1] for shard, _ in kept]
  if all(ok is True for _, ok in kept) and all(
      isinstance(c, float) for c in counts):
    dtype = means[0].dtype.as_numpy_dtype
    count = sum(counts)
    counts = np.reshape(np.array(counts, dtype), [-1] + [1] * rank)
  else:
    oks = [ok for _, ok in kept]
    counts = [_aggregate.gate(tf.cast(c, means[0].dtype), ok)
              for c, ok in zip(counts, oks)]
    means = [_aggregate.gate(m, ok) for m, ok in zip(means, oks)]
    m2s = [_aggregate.gate(m, ok) for m, ok in zip(m2s, oks)]
    counts = tf.reshape(tf.stack(counts), [-1] + [1] * rank)
    count = tf.reduce_sum(counts)
  means = tf.stack(means)
  mean = tf.reduce_sum(counts * means, 0) / count
  between = tf.reduce_sum(counts * tf.math.squared_difference(means, mean), 0)
  variance = (tf.add_n(m2s) + between) / count
  return mean, variance, count


def _meet(x, axes, extra, finish):
  """Meets the other towers with this shard's moments of `x` over `axes`.

  `finish(mean, variance, count, extra)` runs once, on the hub, with the
  whole batch's statistics (keepdims shape) and tower 0's `extra`; every
  tower gets its result.
  """
  replication = _context.current_replication()
  count = _shard_count(x, axes)
  mean, m2 = _shard_moments(x, axes, count)

  def combine(values):
    with tf.device(replication.hub), tf.name_scope("sync_batch_norm"):
      stats = _merged(replication, [v[:3] for v in values])
      result = finish(*stats, values[0][3])
    return [result] * len(values)

  return _lockstep.meet(_MEETING, (mean, m2, count, extra), combine)


def _moments(original):
  def calculate_mean_and_var(layer, inputs, reduction_axes, keep_dims,
                             mask=None):
    if not _whole_batch(layer, reduction_axes):
      return original(layer, inputs, reduction_axes, keep_dims, mask=mask)
    if mask is not None:
      weights = tf.expand_dims(tf.cast(mask, inputs.dtype), axis=-1)
      mean, variance, _ = whole_batch_moments(inputs, reduction_axes,
                                              keep_dims, weights)
      return mean, variance
    axes = list(reduction_axes)

    def finish(mean, variance, count, extra):
      del count, extra
      if keep_dims:
        return mean, variance
      return tf.squeeze(mean, axes), tf.squeeze(variance, axes)

    return _meet(inputs, axes, None, finish)
  return calculate_mean_and_var


def _learning_phase(training) -> bool:
  """Whether `training` is Keras' learning-phase placeholder.

  A functional Keras model built in a graph first calls its layers on its
  `Input`s with that placeholder: ops that never run in training.
  """
  return (isinstance(training, tf.Tensor) and
          training.op.name.split("/")[-1].startswith("keras_learning_phase"))


def _fused(original):
  def fused_batch_norm(layer, inputs, mask, training):
    channel = 1 if layer._data_format.startswith("NC") else -1  # pylint: disable=protected-access
    rank = inputs.shape.rank
    axes = [a for a in range(rank) if a != channel % rank]
    training_value = _control_flow_util.constant_value(training)
    if not _whole_batch(layer, axes) or training_value is not True:
      if (training_value is None and _whole_batch(layer, axes) and
          not _learning_phase(training)):
        logging.warning(
            "replicate: %s has a tensor `training`; it normalises with each "
            "tower's statistics (pass a Python bool for the whole batch's)",
            layer.name)
      return original(layer, inputs, mask, training)
    return _fused_whole_batch(layer, inputs, axes)
  return fused_batch_norm


def _normalisation_parameters(mean, variance, gamma, beta, epsilon):
  """(scale, offset, mean, variance) for the fused kernel in inference mode.

  In inference mode the kernel treats its mean and variance as constants
  (no gradient flows to them). It gets them held constant here, with
  `scale = gamma * r / stop_gradient(r)` (r = rsqrt(variance + epsilon))
  and `offset = beta + (stop_gradient(mean) - mean) * gamma * r`: exactly
  gamma and beta in value (x / x and x - x are exact), so the kernel
  computes what it computes on one device, while their gradients carry
  d/dmean = -sum(dy) gamma r and d/dvariance = -sum(dy xhat) gamma r^2 / 2,
  the statistics' part of one device's gradient. Built once per layer on
  the hub, so each tower adds no op for it.
  """
  held_mean = tf.stop_gradient(mean)
  r = tf.math.rsqrt(variance + epsilon)
  gamma_r = gamma * r
  scale = gamma * (r / tf.stop_gradient(r))
  offset = beta + (held_mean - mean) * gamma_r
  return scale, offset, held_mean, tf.stop_gradient(variance)


def _fused_whole_batch(layer, inputs, axes):
  """The fused kernel's training step, on the whole batch's statistics."""
  # pylint: disable=protected-access
  dtype = layer._param_dtype
  x = inputs if inputs.dtype == dtype else tf.cast(inputs, dtype)
  params = None
  if _context.current_replication().tower.index == 0:
    # The hub normalises with tower 0's reads: the other towers read none.
    params = tuple(tf.convert_to_tensor(
        getattr(layer, name) if used else fill(layer._param_shape, dtype))
                   for name, used, fill in (("gamma", layer.scale, tf.ones),
                                            ("beta", layer.center, tf.zeros)))
  epsilon = max(layer.epsilon, _FUSED_MIN_EPSILON)

  def finish(mean, variance, count, tower0_params):
    """On the hub: the kernel's parameters, the moving statistics' inputs."""
    mean, variance = tf.reshape(mean, [-1]), tf.reshape(variance, [-1])
    normalisation = _normalisation_parameters(mean, variance, *tower0_params,
                                              epsilon)
    # The fused kernel's moving variance is Bessel-corrected.
    if isinstance(count, float):
      corrected = variance * (count / max(count - 1.0, 1.0))
    else:
      corrected = variance * count / tf.maximum(count - 1.0, 1.0)
    return normalisation, tf.stop_gradient(mean), tf.stop_gradient(corrected)

  (scale, offset, held_mean, held_variance), mean, corrected = _meet(
      x, axes, params, finish)
  outputs, _, _ = tf.compat.v1.nn.fused_batch_norm(
      inputs, scale, offset, mean=held_mean, variance=held_variance,
      epsilon=epsilon, data_format=layer._data_format, is_training=False)
  momentum = tf.convert_to_tensor(layer.momentum)
  size = tf.shape(inputs)[0] if layer._support_zero_size_input() else None
  layer.add_update(lambda: layer._assign_moving_average(
      layer.moving_mean, mean, momentum, size))
  layer.add_update(lambda: layer._assign_moving_average(
      layer.moving_variance, corrected, momentum, size))
  # pylint: enable=protected-access
  return outputs


@contextlib.contextmanager
def synchronized(replication: _context.Replication):
  """Batch norm built inside uses the whole batch's statistics (see above)."""
  if (not replication.sync_batch_norm or replication.num_towers == 1 or
      _keras_bn is None):
    yield
    return
  base = _keras_bn.BatchNormalizationBase
  with _lock:
    if not _installed["count"]:
      # pylint: disable=protected-access
      _installed["originals"] = (base._calculate_mean_and_var,
                                 base._fused_batch_norm)
      base._calculate_mean_and_var = _moments(_installed["originals"][0])
      base._fused_batch_norm = _fused(_installed["originals"][1])
      # pylint: enable=protected-access
    _installed["count"] += 1
  try:
    yield
  finally:
    with _lock:
      _installed["count"] -= 1
      if not _installed["count"]:
        # pylint: disable=protected-access
        base._calculate_mean_and_var, base._fused_batch_norm = (
            _installed["originals"])
