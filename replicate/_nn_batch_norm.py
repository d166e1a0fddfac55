"""Batch statistics written with TensorFlow's own ops, on the whole batch.

Model code that normalises without Keras' layer (tf-slim's and tf.contrib's
`batch_norm`, hand-written `tf.nn.moments` + `tf.nn.batch_normalization`,
`tf.compat.v1.nn.fused_batch_norm` in training) takes moments over the
batch axis: on one device, the whole batch's. While synchronised batch norm
applies, such a call in a tower meets the other towers as Keras' layer does
(see `_batch_norm`): `tf.nn.moments` / `tf.compat.v1.nn.moments` and
`weighted_moments` over axes that include 0 return the whole batch's
moments, and `fused_batch_norm(is_training=True)` normalises with them and
returns them. The axes must include axis 0, as Keras' layers take it to be
the batch axis, and one whose static size, where known, is the tower's
shard size (a time-major sequence's axis 0 is time). Left
alone (each tower's statistics, as before): calls inside a `tf.cond` /
`tf.while_loop` or a `tf.function` (one tower cannot meet the others from
there, logged), the calls of a Keras batch-norm layer that keeps its own
statistics (ghost batches), and Keras' LayerNormalization, which runs the
fused kernel on each example with the batch folded into its channels.
"""

from typing import Callable, Dict

import numpy as np
import tensorflow as tf
from absl import logging

from replicate import _batch_norm
from replicate import _context
from replicate import _patches

# The public functions live here; tf.nn.moments and tf.nn.weighted_moments
# (v2) call this module's v1 functions by their global names.
from tensorflow.python.ops import nn_impl as _nn_impl  # pylint: disable=g-direct-tensorflow-import

try:
  # The layer whose batch-norm kernel calls are not batch statistics.
  from keras.src.layers.normalization import layer_normalization as _keras_ln  # pylint: disable=g-import-not-at-top
except ImportError:
  _keras_ln = None

_NAMES = ("moments", "weighted_moments", "fused_batch_norm")


def _axes(x, axes):
  """`axes` of `x` as non-negative ints, or None where `x`'s rank is unknown."""
  rank = x.shape.rank
  if rank is None:
    return None
  if isinstance(axes, int):
    axes = [axes]
  return sorted({int(a) % rank for a in axes})


def _reduces_batch_axis(x, axes, replication) -> bool:
  """Whether one of `axes` of `x` can be the tower's batch axis.

  Its static size, where known, must be the tower's static shard size (one
  phantom row for an empty shard, see `_split`): moments over time of a
  time-major sequence reduce no batch axis, moments over time and batch
  do.
  """
  size = replication.size()
  static = isinstance(size, (int, np.integer))
  for axis in axes:
    dim = x.shape[axis]
    if dim is None or (static and (dim == size or (size == 0 and dim == 1))):
      return True
  return False


def _whole_batch(x, axes) -> bool:
  """Whether this call, in a tower, takes the whole batch's statistics."""
  replication = _context.replication_on_thread()
  if (replication is None or not replication.sync_batch_norm or
      replication.num_towers < 2 or replication.tower is None or
      _batch_norm.in_keras_layer() or axes is None or 0 not in axes or
      not _reduces_batch_axis(x, axes, replication)):
    return False
  graph = tf.compat.v1.get_default_graph()
  if graph is replication.graph and not _context.in_v1_control_flow(graph):
    return True
  logging.warning(
      "replicate: batch statistics of %s are built inside a tf.cond, "
      "tf.while_loop or tf.function: each tower's own (build them outside "
      "it for the whole batch's)", x.name)
  return False


def _in_float32(x):
  """float16 counts in float32, as tf.nn.moments does."""
  return tf.cast(x, tf.float32) if x.dtype == tf.float16 else x


def _moments(original: Callable) -> Callable:
  def moments(x, axes, shift=None, name=None, keep_dims=None, keepdims=None):
    kept = bool(keepdims if keepdims is not None else keep_dims)
    x = tf.convert_to_tensor(x)
    axes_list = _axes(x, axes)
    if not _whole_batch(x, axes_list):
      return original(x, axes, shift=shift, name=name, keep_dims=keep_dims,
                      keepdims=keepdims)
    with tf.name_scope(name or "moments"):
      mean, variance = _batch_norm.meet(
          _in_float32(x), axes_list, (),
          _batch_norm.moments_head(axes_list, kept))
      return tf.cast(mean, x.dtype), tf.cast(variance, x.dtype)
  return moments


def _weighted_moments(original: Callable) -> Callable:
  def weighted_moments(x, axes, frequency_weights, name=None, keep_dims=None,
                       keepdims=None):
    kept = bool(keepdims if keepdims is not None else keep_dims)
    x = tf.convert_to_tensor(x)
    axes_list = _axes(x, axes)
    if not _whole_batch(x, axes_list):
      return original(x, axes, frequency_weights, name=name,
                      keep_dims=keep_dims, keepdims=keepdims)
    with tf.name_scope(name or "weighted_moments"):
      counted = _in_float32(x)
      mean, variance, _ = _batch_norm.whole_batch_moments(
          counted, axes_list, kept,
          tf.cast(frequency_weights, counted.dtype))
      return tf.cast(mean, x.dtype), tf.cast(variance, x.dtype)
  return weighted_moments


def _fused_batch_norm(original: Callable) -> Callable:
  def fused_batch_norm(x, scale, offset, mean=None, variance=None,
                       epsilon=0.001, data_format="NHWC", is_training=True,
                       name=None, exponential_avg_factor=1.0):
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    channel = 1 if data_format.startswith("NC") else -1
    axes = (None if rank is None else
            [a for a in range(rank) if a != channel % rank])
    average = exponential_avg_factor != 1.0
    training = isinstance(is_training, (bool, np.bool_)) and is_training
    if not training or (average and mean is None) or not _whole_batch(x, axes):
      return original(x, scale, offset, mean=mean, variance=variance,
                      epsilon=epsilon, data_format=data_format,
                      is_training=is_training, name=name,
                      exponential_avg_factor=exponential_avg_factor)
    with tf.name_scope(name or "FusedBatchNormV3"):
      params = running = None
      if _context.current_replication().tower.index == 0:
        params = (tf.convert_to_tensor(scale), tf.convert_to_tensor(offset))
      if average:
        running = (tf.convert_to_tensor(mean), tf.convert_to_tensor(variance),
                   exponential_avg_factor)
      y, batch_mean, batch_variance = _batch_norm.fused_whole_batch(
          x, params, max(epsilon, _batch_norm.FUSED_MIN_EPSILON),
          data_format, axes, running)
      return y, batch_mean, batch_variance
  return fused_batch_norm


_WRAPPERS: Dict[str, Callable[[Callable], Callable]] = {
    "moments": _moments,
    "weighted_moments": _weighted_moments,
    "fused_batch_norm": _fused_batch_norm,
}


def _layer_norm_call(original: Callable) -> Callable:
  def call(layer, *args, **kwargs):
    with _batch_norm.keras_decides():
      return original(layer, *args, **kwargs)
  return call


def _install() -> _patches.Patched:
  """Routes every TensorFlow module's name for the three functions.

  Keras' LayerNormalization normalises each example with the fused batch
  norm kernel (the batch folded into its channels): it keeps its own.
  """
  originals = [(name, getattr(_nn_impl, name)) for name in _NAMES]
  patched = []
  if _keras_ln is not None:
    layer = _keras_ln.LayerNormalization
    patched.append((layer, "call", layer.call))
    layer.call = _layer_norm_call(layer.call)
  for name, original in originals:
    patched.extend(_patches.rebind(name, original, _WRAPPERS[name](original)))
  return patched


_PATCHES = _patches.Patches("tf.nn batch statistics", _install)


def synchronized(replication: _context.Replication):
  """tf.nn batch statistics built inside are the whole batch's (see above)."""
  return _PATCHES.applied(replication.sync_batch_norm and
                          replication.num_towers > 1)
