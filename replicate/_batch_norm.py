"""Batch normalization with the whole batch's statistics (`sync_batch_norm`).

On one device a batch-norm layer in training normalises with the batch's
mean and variance, and its gradients run through them. A tower sees only
its shard, so while the towers are built for training, Keras'
`BatchNormalization` (which `tf.compat.v1.layers.batch_normalization` and
the canned DNN estimators' `batch_norm=True` use too) takes its moments
from one meeting of the towers per layer (see `_lockstep`): each tower
brings its shard's count, mean and sum of squared distances from that mean
(two passes, as `tf.nn.moments` and the fused kernel make them), and the
hub merges them into the whole batch's (Chan et al.'s pairwise update: no
cancellation between large sums). Gradients run back through the merge to
every tower. A layer Keras would fuse gets its shard moments from the fused
kernel in training mode, normalises with the fused kernel in inference
mode given the whole batch's statistics (the gradients that kernel does
not give, written out on the hub and per tower, are kernel calls too), and
updates its moving statistics as the fused kernel would (Bessel-corrected
variance). Where the towers are CPUs of one machine (one memory: a tensor
passed between them is shared, not copied), a fused layer instead runs the
kernel once, on the hub, on the towers' shards concatenated: one device's
kernel on one device's rows, for one copy of the inputs and of their
gradient (a ReLU of the output runs there too: see `_host_relu`). Layers
with `virtual_batch_size` keep their own statistics (their ghost batches
do not follow the towers' shards), and so does a fused layer whose
`training` is a tensor rather than a Python bool (its kernel runs inside a
tf.cond).
"""


import contextlib
import threading
import weakref

import numpy as np
import tensorflow as tf
from absl import logging

from replicate import _aggregate
from replicate import _collectives
from replicate import _context
from replicate import _host_relu
from replicate import _lockstep
from replicate import _patches

try:
  # Keras' batch normalization has no public hook for its moments; these
  # private methods are where every flavour of the layer computes them.
  from keras.src.layers.normalization import batch_normalization as _keras_bn  # pylint: disable=g-import-not-at-top
  from keras.src.utils import control_flow_util as _control_flow_util  # pylint: disable=g-import-not-at-top
except ImportError:
  _keras_bn = None

# tf.compat.v1.nn.fused_batch_norm raises a smaller epsilon to this.
FUSED_MIN_EPSILON = 1.001e-5
_MEETING = "synchronised batch normalization"


def _whole_batch(layer, axes) -> bool:
  replication = _context.current_replication()
  synced = (replication is not None and replication.sync_batch_norm and
            replication.num_towers > 1 and replication.tower is not None)
  if synced and layer.virtual_batch_size is not None:
    if replication.tower.index == 0:
      logging.warning(
          "replicate: %s has virtual_batch_size=%d: its ghost batches are "
          "drawn from each tower's shard, not from the whole batch as on "
          "one device", layer.name, layer.virtual_batch_size)
    return False
  return synced and 0 in axes


def whole_batch_moments(x, axes, keep_dims: bool, weights=None):
  """The whole batch's (mean, variance, count) over `axes`, from every tower.

  Two passes, as `tf.nn.moments` / `tf.nn.weighted_moments`: the mean, then
  the mean squared distance from it (the mean held constant for the
  gradient), each a sum over the towers; zero where the weights sum to
  zero, as `tf.nn.weighted_moments`. Used for masked layers and weighted
  moments; unmasked ones take the leaner `_shard_moments` / `_merged` route.
  """
  axes = list(axes)
  ones = tf.ones_like(x) if weights is None else tf.broadcast_to(
      tf.cast(weights, x.dtype), tf.shape(x))
  with tf.name_scope("whole_batch_moments"):
    count, total = _collectives.batch_sum([
        tf.reduce_sum(ones, axes, keepdims=True),
        tf.reduce_sum(x * ones, axes, keepdims=True)])
    mean = tf.math.divide_no_nan(total, count)
    distance = tf.reduce_sum(
        ones * tf.math.squared_difference(x, tf.stop_gradient(mean)), axes,
        keepdims=True)
    variance = tf.math.divide_no_nan(_collectives.batch_sum(distance), count)
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
  """This shard's [mean, sum of squared distances from it] (keepdims shape).

  Two passes, as the fused kernel. A custom gradient, d x = dmean / count
  + 2 (x - mean) dm2: four ops where automatic differentiation of the
  reductions builds about fifteen.
  """
  axes_t = tf.constant(axes, tf.int32)
  mean = tf.reduce_mean(x, axes_t, keepdims=True)
  m2 = tf.reduce_sum(tf.math.squared_difference(x, mean), axes_t,
                     keepdims=True)
  stats = tf.stack([mean, m2])

  def grad(dstats):
    dmean, dm2 = tf.unstack(_zero_if_none(dstats, stats))
    return [(x - mean) * (2.0 * dm2) + dmean / count]

  return _with_gradient([stats], [x], grad)[0]


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
  (it watches for variables: a third of the hub's build time): one IdentityN
  whose registered gradient looks `backward` up.
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


def meet(x, axes, args, head, fused_format=None, epsilon=None):
  """Meets the other towers with this shard's moments of `x` over `axes`.

  `head` (see `_merged`) runs once, on the hub, with the whole batch's
  statistics and tower 0's `args`; every tower gets its outputs. With
  `fused_format` (a data format), the fused kernel computes the moments.
  """
  replication = _context.current_replication()
  count = _shard_count(x, axes)
  if fused_format:
    stats = _kernel_moments(x, fused_format, epsilon)
  else:
    stats = _shard_moments(x, axes, count)

  def combine(values):
    with tf.device(replication.hub), tf.name_scope("sync_batch_norm"):
      result = _merged(replication, [v[:2] for v in values], head,
                       values[0][2], corrected=bool(fused_format))
    return [result] * len(values)

  return _lockstep.meet(_MEETING, (stats, count, args), combine)


def moments_head(axes, keep_dims: bool):
  """A `meet` head giving (mean, variance), squeezed over `axes` unless kept."""
  def head(mean, variance, count):
    del count
    if keep_dims:
      return (mean, variance), lambda dmean, dvariance: (
          _zero_if_none(dmean, mean), _zero_if_none(dvariance, variance))
    shape = _shape(mean)
    return (tf.squeeze(mean, axes), tf.squeeze(variance, axes)), (
        lambda dmean, dvariance: (
            tf.reshape(_zero_if_none(dmean, mean), shape),
            tf.reshape(_zero_if_none(dvariance, variance), shape)))
  return head


def _moments(original):
  def calculate_mean_and_var(layer, inputs, reduction_axes, keep_dims,
                             mask=None):
    if not _whole_batch(layer, reduction_axes):
      with keras_decides():
        return original(layer, inputs, reduction_axes, keep_dims, mask=mask)
    if mask is not None:
      weights = tf.expand_dims(tf.cast(mask, inputs.dtype), axis=-1)
      mean, variance, _ = whole_batch_moments(inputs, reduction_axes,
                                              keep_dims, weights)
      return mean, variance
    axes = list(reduction_axes)
    return meet(inputs, axes, (), moments_head(axes, keep_dims))
  return calculate_mean_and_var


_local = threading.local()


@contextlib.contextmanager
def keras_decides():
  """Inside, Keras' layer keeps the statistics it chose (see `_nn_batch_norm`).

  A layer left to its own statistics (ghost batches, a tensor `training`)
  calls `tf.nn.moments` / `fused_batch_norm` itself.
  """
  before = getattr(_local, "keras", False)
  _local.keras = True
  try:
    yield
  finally:
    _local.keras = before


def in_keras_layer() -> bool:
  """Whether a Keras layer that keeps its own statistics is being built."""
  return getattr(_local, "keras", False)


def _shape(t):
  return t.shape.as_list() if t.shape.is_fully_defined() else tf.shape(t)


def _zero_if_none(gradient, like):
  return tf.zeros_like(like) if gradient is None else gradient


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
      with keras_decides():
        return original(layer, inputs, mask, training)
    return _fused_whole_batch(layer, inputs, axes)
  return fused_batch_norm


def _fused_whole_batch(layer, inputs, axes):
  """The fused kernel's training step, on the whole batch's statistics."""
  # pylint: disable=protected-access
  dtype = layer._param_dtype
  params = None
  if _context.current_replication().tower.index == 0:
    # The hub normalises with tower 0's reads: the other towers read none.
    params = tuple(tf.convert_to_tensor(
        getattr(layer, name) if used else fill(layer._param_shape, dtype))
                   for name, used, fill in (("gamma", layer.scale, tf.ones),
                                            ("beta", layer.center, tf.zeros)))
  outputs, mean, corrected = fused_whole_batch(
      inputs, params, max(layer.epsilon, FUSED_MIN_EPSILON),
      layer._data_format, axes)
  momentum = tf.convert_to_tensor(layer.momentum)
  size = tf.shape(inputs)[0] if layer._support_zero_size_input() else None
  layer.add_update(lambda: layer._assign_moving_average(
      layer.moving_mean, mean, momentum, size))
  layer.add_update(lambda: layer._assign_moving_average(
      layer.moving_variance, corrected, momentum, size))
  # pylint: enable=protected-access
  return outputs


def fused_whole_batch(inputs, params, epsilon: float, data_format: str,
                      axes, running=None):
  """The fused kernel in training, normalising with the whole batch's moments.

  `params`: tower 0's (scale, offset), float32 for half-precision inputs
  (the other towers' are not read: pass None); `running`: the tower's
  (mean, variance, exponential_avg_factor) when the kernel should move
  running statistics towards the batch's, else None. Returns (outputs, the
  batch mean, the Bessel-corrected batch variance) or the moved running
  statistics, as the kernel in training mode does (and, as its gradient,
  passing no gradient back from the returned statistics).
  """
  replication = _context.current_replication()
  if _CONCATENATE_ON_HOST and _on_one_host(replication):
    return _fused_on_concatenation(replication, inputs, params, epsilon,
                                   data_format, running)
  outputs, mean, corrected = _fused_through_hub(inputs, params, epsilon,
                                                data_format, axes)
  if running is not None:
    # The kernel's running statistics: the inputs moved towards the batch's.
    moving_mean, moving_variance, factor = running
    mean = (1.0 - factor) * moving_mean + factor * mean
    corrected = (1.0 - factor) * moving_variance + factor * corrected
  return outputs, mean, corrected


# Whether towers on one machine's CPUs normalise the concatenated batch
# (tests turn it off to exercise the hub on virtual CPUs).
_CONCATENATE_ON_HOST = True
_logged_host = weakref.WeakSet()


def _on_one_host(replication) -> bool:
  """Whether every tower is a CPU of the hub's task: one memory, one pool.

  There a tensor passed between towers is shared, not copied: the
  concatenated batch costs one copy.
  """
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
        "layer in training runs one kernel on the concatenated batch on %s",
        replication.hub)
  return shared


def _fused_on_concatenation(replication, inputs, params, epsilon: float,
                            data_format: str, running):
  """One fused kernel in training on the towers' shards, concatenated.

  What one device runs, on the same rows in the same order: its outputs,
  statistics and gradients are one device's. Costs a copy of the inputs
  forward and of the outputs' gradients backward (the split back and the
  gradient's slices share buffers).
  """
  def combine(values):
    scale, offset = values[0][1]
    tower_running = values[0][2]
    with tf.device(replication.hub), tf.name_scope("sync_batch_norm"):
      whole, place = _concatenated(replication, [v[0] for v in values])
      if tower_running is None:
        mean = variance = tf.constant([], scale.dtype)
        factor = 1.0
      else:
        mean, variance, factor = tower_running
      y, batch_mean, batch_variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
          x=whole, scale=scale, offset=offset, mean=mean, variance=variance,
          epsilon=epsilon, exponential_avg_factor=factor,
          data_format=data_format, is_training=True)
      rows = _host_relu.WholeBatch(replication, y, place).hand_out()
      return [(y_i, batch_mean, batch_variance) for y_i in rows]

  return _lockstep.meet(_MEETING, (inputs, params, running), combine)


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


def _fused_through_hub(inputs, params, epsilon: float, data_format: str,
                       axes):
  """`fused_whole_batch` on devices apart: the towers' moments meet."""
  dtype = (params[0].dtype if params is not None else
           tf.float32 if inputs.dtype in (tf.float16, tf.bfloat16) else
           inputs.dtype)
  x = inputs if inputs.dtype == dtype else tf.cast(inputs, dtype)

  def head(mean, variance, count, gamma, beta):
    """On the hub: the kernel's inputs and the batch statistics' values.

    `mean` and `variance` are per channel (`_kernel_moments`' shape).
    """
    r = tf.math.rsqrt(variance + epsilon)
    # The fused kernel's batch variance output is Bessel-corrected.
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

  scale, offset, mean, variance, corrected = meet(
      x, axes, params, head, data_format, epsilon)
  # Half-precision inputs normalise in float32: the kernel's gradient and
  # the moments' (written out) nearly cancel, and the training kernel adds
  # them in float32 before it rounds.
  outputs, _, _ = tf.compat.v1.nn.fused_batch_norm(
      x, scale, offset, mean=mean, variance=variance,
      epsilon=epsilon, data_format=data_format, is_training=False)
  if outputs.dtype != inputs.dtype:
    outputs = tf.cast(outputs, inputs.dtype)
  return outputs, mean, corrected


def _install() -> _patches.Patched:
  base = _keras_bn.BatchNormalizationBase
  # pylint: disable=protected-access
  originals = [(base, "_calculate_mean_and_var", base._calculate_mean_and_var),
               (base, "_fused_batch_norm", base._fused_batch_norm)]
  base._calculate_mean_and_var = _moments(originals[0][2])
  base._fused_batch_norm = _fused(originals[1][2])
  # pylint: enable=protected-access
  return originals


_PATCHES = _patches.Patches("Keras batch norm's moments", _install)


def synchronized(replication: _context.Replication):
  """Batch norm built inside uses the whole batch's statistics (see above)."""
  return _PATCHES.applied(replication.sync_batch_norm and
                          replication.num_towers > 1 and
                          _keras_bn is not None)
