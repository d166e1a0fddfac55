"""Batch normalization with the whole batch's statistics (`sync_batch_norm`).

On one device a batch-norm layer in training normalises with the batch's
mean and variance, and its gradients run through them. A tower sees only
its shard, so while the towers are built for training, Keras'
`BatchNormalization` (which `tf.compat.v1.layers.batch_normalization` and
the canned DNN estimators' `batch_norm=True` use too) computes its moments
from `replicate.batch_sum` of the towers' partial sums: the whole batch's
mean and variance, in two passes as `tf.nn.moments` computes them, and
differentiable through every tower. A layer Keras would fuse gets the same
arithmetic as the fused kernel (biased variance to normalise, Bessel-
corrected variance for the moving average). Layers with
`virtual_batch_size` keep their own statistics (their ghost batches do not
follow the towers' shards), and so does a fused layer whose `training` is
a tensor rather than a Python bool (its kernel runs inside a tf.cond).
"""

import contextlib
import threading

import tensorflow as tf
from absl import logging

from replicate import _collectives
from replicate import _context

try:
  # Keras' batch normalization has no public hook for its moments; these
  # private methods are where every flavour of the layer computes them.
  from keras.src.layers.normalization import batch_normalization as _keras_bn  # pylint: disable=g-import-not-at-top
  from keras.src.utils import control_flow_util as _control_flow_util  # pylint: disable=g-import-not-at-top
except ImportError:
  _keras_bn = None

_lock = threading.Lock()
_installed = {"count": 0, "originals": None}


def _whole_batch(layer, axes) -> bool:
  replication = _context.current_replication()
  return (replication is not None and replication.sync_batch_norm and
          replication.num_towers > 1 and replication.tower is not None and
          0 in axes and layer.virtual_batch_size is None)


def whole_batch_moments(x, axes, keep_dims: bool, weights=None):
  """The whole batch's (mean, variance, count) over `axes`, from every tower.

  Two passes, as `tf.nn.moments` / `tf.nn.weighted_moments`: the mean, then
  the mean squared distance from it (the mean held constant for the
  gradient), each a sum over the towers.
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


def _moments(original):
  def calculate_mean_and_var(layer, inputs, reduction_axes, keep_dims,
                             mask=None):
    if not _whole_batch(layer, reduction_axes):
      return original(layer, inputs, reduction_axes, keep_dims, mask=mask)
    weights = None
    if mask is not None:
      weights = tf.expand_dims(tf.cast(mask, inputs.dtype), axis=-1)
    mean, variance, _ = whole_batch_moments(inputs, reduction_axes, keep_dims,
                                            weights)
    return mean, variance
  return calculate_mean_and_var


def _fused(original):
  def fused_batch_norm(layer, inputs, mask, training):
    channel = 1 if layer._data_format.startswith("NC") else -1  # pylint: disable=protected-access
    rank = inputs.shape.rank
    axes = [a for a in range(rank) if a != channel % rank]
    training_value = _control_flow_util.constant_value(training)
    if not _whole_batch(layer, axes) or training_value is not True:
      if training_value is None and _whole_batch(layer, axes):
        logging.warning(
            "replicate: %s has a tensor `training`; it normalises with each "
            "tower's statistics (pass a Python bool for the whole batch's)",
            layer.name)
      return original(layer, inputs, mask, training)
    return _fused_whole_batch(layer, inputs, axes, channel % rank)
  return fused_batch_norm


def _fused_whole_batch(layer, inputs, axes, channel):
  """What the fused kernel computes in training, on the whole batch."""
  # pylint: disable=protected-access
  dtype = layer._param_dtype
  x = tf.cast(inputs, dtype)
  mean, variance, count = whole_batch_moments(x, axes, keep_dims=False)
  shape = [1] * inputs.shape.rank
  shape[channel] = -1
  reshape = lambda t: None if t is None else tf.reshape(t, shape)
  outputs = tf.nn.batch_normalization(
      x, reshape(mean), reshape(variance),
      reshape(layer.beta if layer.center else None),
      reshape(layer.gamma if layer.scale else None), layer.epsilon)
  corrected = variance * count / tf.maximum(count - 1.0, 1.0)
  momentum = tf.convert_to_tensor(layer.momentum)
  size = tf.shape(inputs)[0] if layer._support_zero_size_input() else None
  layer.add_update(lambda: layer._assign_moving_average(
      layer.moving_mean, mean, momentum, size))
  layer.add_update(lambda: layer._assign_moving_average(
      layer.moving_variance, corrected, momentum, size))
  # pylint: enable=protected-access
  return tf.cast(outputs, inputs.dtype)


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
