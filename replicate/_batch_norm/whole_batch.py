"""Batch normalization in training with the whole batch's statistics.

On one device a batch-norm kernel in training (`FusedBatchNorm*` with
`is_training`: Keras' fused layer, `tf.compat.v1.layers`, tf-slim, canned
estimators' `batch_norm=True` on images, a direct
`tf.compat.v1.nn.fused_batch_norm`) normalises with the batch's mean and
variance, and its gradients run through them. Each tower's kernel sees its
shard only; `_meet.rewiring` hands every such kernel of the towers here, after
they are built, and every reader of its outputs is given the whole batch's
(`sync_batch_norm=True`, the default). Batch norm written with reductions
(`tf.nn.moments`, the non-fused layers) needs nothing: its reductions are
the whole batch's by construction (`_meet.rewiring`).

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
  that kernel does not give are written out (`moments.merged`).
"""

from typing import Callable, List, Optional, Sequence, Tuple, Union
import weakref

from absl import logging
import tensorflow as tf

from replicate import _context
from replicate._batch_norm import moments


def whole_batch(
    replication: _context.Replication, op: tf.Operation,
    shards: Sequence[tf.Tensor]) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
  """Each tower's rows and the batch statistics, for kernel `op` (tower 0's).

  `shards`: every tower's input of the kernel. Returns (each tower's
  normalised rows, [batch mean, batch variance] as the kernel in training
  returns them: the variance Bessel-corrected, both moved towards the
  running statistics it was given with an `exponential_avg_factor`).
  """
  kernel = moments.Kernel(op)
  with tf.name_scope(op.name + "_whole_batch/"):
    if _CONCATENATE_ON_HOST and _on_one_host(replication):
      return _on_concatenation(replication, kernel, shards)
    return _through_hub(replication, kernel, shards)


# Whether towers on one machine's CPUs normalise the concatenated batch
# (tests turn it off to exercise the consolidation device on virtual CPUs).
_CONCATENATE_ON_HOST = True
_logged_host: "weakref.WeakSet[tf.Graph]" = weakref.WeakSet()


def _on_one_host(replication: _context.Replication) -> bool:
  """Whether every tower is a CPU of the consolidation device's task: one
  memory, one pool."""
  spec = tf.DeviceSpec.from_string(replication.consolidation_device or "")
  place = (spec.job, spec.replica, spec.task)
  specs = [tf.DeviceSpec.from_string(d or "") for d in replication.devices]
  shared = bool(specs) and all(
      s.device_type == "CPU" and (s.job, s.replica, s.task) == place
      for s in specs)
  if shared and replication.graph not in _logged_host:
    _logged_host.add(replication.graph)
    logging.info(
        "replicate: the towers are CPUs of one machine: each fused batch-norm "
        "kernel in training runs once, on the concatenated batch, on %s",
        replication.consolidation_device)
  return shared


# Per graph: a tower's rows of a kernel's output -> (the output, placement).
_WHOLE_OUTPUTS = "batch-norm outputs on the concatenated batch"


def _on_concatenation(
    replication: _context.Replication, kernel: moments.Kernel,
    shards: Sequence[tf.Tensor]) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
  """One kernel in training on the towers' shards, concatenated.

  What one device runs, on the same rows in the same order: its outputs,
  statistics and gradients are one device's.
  """
  with tf.device(replication.meeting_device):
    whole, place = _concatenated(replication, shards)
    outputs = tf.raw_ops.FusedBatchNormV3(
        x=whole,
        scale=kernel.scale,
        offset=kernel.offset,
        mean=kernel.mean,
        variance=kernel.variance,
        epsilon=kernel.epsilon,
        exponential_avg_factor=kernel.factor,
        data_format=kernel.data_format,
        is_training=True)
    rows = place(outputs.y)
  store = _context.graph_store(replication.graph, _WHOLE_OUTPUTS)
  for tower_rows in rows:
    store[tower_rows.ref()] = (outputs.y, place)
  return rows, [outputs.batch_mean, outputs.batch_variance]


def _concatenated(
    replication: _context.Replication, shards: Sequence[tf.Tensor]
) -> Tuple[tf.Tensor, Callable[[tf.Tensor], List[tf.Tensor]]]:
  """The batch's rows from every tower's shard, and how to give them back.

  Returns (the batch, place): `place(outputs of the batch)` -> each tower's
  rows of them. A tower computing on a phantom row (see _prepare.split) adds no
  row to the batch; it gets the batch's last row (its phantom row's original).
  """
  validity = replication.validity
  kept = [x for x, ok in zip(shards, validity) if ok is not False]
  rows = [
      x.shape[0] if x.shape[0] is not None else tf.shape(x)[0] for x in kept
  ]
  whole = kept[0] if len(kept) == 1 else tf.concat(kept, 0)
  real = whole
  if any(ok is not True and ok is not False for ok in validity):
    # Dynamic shards: towers past the batch's last row read a phantom row.
    batch = tf.cast(
        tf.add_n([
            tf.cast(s, tf.int64)
            for s, ok in zip(replication.sizes, validity)
            if ok is not False
        ]), tf.int32)
    real = whole[:batch]

  def place(outputs: tf.Tensor) -> List[tf.Tensor]:
    if real is not whole:
      phantoms = tf.shape(whole)[0] - tf.shape(real)[0]
      tile = tf.concat(
          [[phantoms], tf.ones([outputs.shape.rank - 1], tf.int32)], 0)
      # Only a batch smaller than the towers has phantom rows: the others
      # pass the outputs on uncopied.
      outputs = tf.cond(
          phantoms > 0,
          lambda: tf.concat([outputs, tf.tile(outputs[-1:], tile)], 0),
          lambda: outputs)
    parts = [outputs] if len(kept) == 1 else tf.split(outputs, rows, 0)
    parts = iter(parts)
    return [next(parts) if ok is not False else outputs[-1:] for ok in validity]

  return real, place


def relu_once(
    replication: _context.Replication, rows: Sequence[tf.Tensor]
) -> List[Tuple[int, Tuple[tf.Operation, tf.Tensor]]]:
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
  with tf.device(replication.meeting_device):
    activated = place(tf.nn.relu(whole))
  return [(index, (relu, tower_rows))
          for index, (tower_relus,
                      tower_rows) in enumerate(zip(relus, activated))
          for relu in tower_relus]


def _through_hub(
    replication: _context.Replication, kernel: moments.Kernel,
    shards: Sequence[tf.Tensor]) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
  """Shard moments merged on the consolidation device; each tower normalises
  its rows."""
  dtype = kernel.scale.dtype
  inputs = [x if x.dtype == dtype else tf.cast(x, dtype) for x in shards]
  stats = []
  for index, x in enumerate(inputs):
    with tf.device(replication.placed[index]):
      stats.append((moments.kernel_moments(x, kernel.data_format,
                                           kernel.epsilon),
                    moments.shard_count(x, kernel.axes)))
  epsilon = kernel.epsilon

  def head(
      mean: tf.Tensor, variance: tf.Tensor, count: Union[float, tf.Tensor],
      gamma: tf.Tensor, beta: tf.Tensor
  ) -> Tuple[Tuple[tf.Tensor, ...], Callable[..., Tuple[tf.Tensor, ...]]]:
    """On the consolidation device: the kernel's inputs and the batch
    statistics' values."""
    r = tf.math.rsqrt(variance + epsilon)
    if isinstance(count, float):
      bessel = count / max(count - 1.0, 1.0)
    else:
      bessel = count / tf.maximum(count - 1.0, 1.0)
    corrected = variance * bessel

    def backward(
        dscale: Optional[tf.Tensor], doffset: Optional[tf.Tensor], *unused:
        Optional[tf.Tensor]
    ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
      # The kernel in inference mode holds mean and variance constant; one
      # device's gradient also runs through them: y = gamma (x - mean) r +
      # beta gives d/dmean = -sum(dy) gamma r = -doffset gamma r and
      # d/dvariance = -sum(dy (x - mean) r) gamma r^2 / 2 = -dscale gamma
      # r^2 / 2 (dscale, doffset: the kernel's gradients of scale, offset).
      # The returned batch statistics pass no gradient, as the training
      # kernel's gradient in TensorFlow ignores them.
      del unused
      dscale = moments.zero_if_none(dscale, gamma)
      doffset = moments.zero_if_none(doffset, beta)
      gamma_r = gamma * r
      return -doffset * gamma_r, -0.5 * dscale * gamma_r * r, dscale, doffset

    return (gamma, beta, mean, variance, corrected), backward

  with tf.device(replication.meeting_device):
    scale, offset, mean, variance, corrected = moments.merged(
        replication, stats, head, (kernel.scale, kernel.offset), corrected=True)
  rows = []
  for index, (x, shard) in enumerate(zip(inputs, shards)):
    with tf.device(replication.placed[index]):
      y, _, _ = tf.compat.v1.nn.fused_batch_norm(
          x,
          scale,
          offset,
          mean=mean,
          variance=variance,
          epsilon=epsilon,
          data_format=kernel.data_format,
          is_training=False)
      rows.append(y if y.dtype == shard.dtype else tf.cast(y, shard.dtype))
  if kernel.factor != 1.0:
    with tf.device(replication.meeting_device):
      factor = kernel.factor
      mean = (1.0 - factor) * kernel.mean + factor * mean
      corrected = (1.0 - factor) * kernel.variance + factor * corrected
  return rows, [mean, corrected]
