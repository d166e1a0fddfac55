"""Benchmark workloads: synthetic data, input_fns and model_fns.

Every variant trains the same model on the same examples: weights come from
seeded initializers (named per layer, so they do not depend on graph op
order), the data from a seeded NumPy generator, and the optimizer is wrapped
in `replicate.TowerOptimizer` (a pass-through outside replication).
"""

from typing import Callable, Dict, Tuple

import numpy as np
import tensorflow as tf

import replicate

NUM_CLASSES = 10
IMAGE_SHAPE = (28, 28, 1)
NUM_INPUTS = 28 * 28
WORKLOADS = ("mlp", "cnn", "cnn_bn", "resnet50", "mlp_top_k",
             "mlp_top_k_by_hand", "mlp_clipped_before_use")

Arrays = Tuple[np.ndarray, np.ndarray]


def synthetic_data(num_examples: int, seed: int) -> Arrays:
  """Features [n, 784] float32 and labels [n] int32 from a random teacher.

  The labels are a fixed linear function of the features, so the loss
  falls during training and the final losses of the variants compare.
  """
  rng = np.random.RandomState(seed)
  x = rng.randn(num_examples, NUM_INPUTS).astype(np.float32)
  teacher = rng.randn(NUM_INPUTS, NUM_CLASSES).astype(np.float32)
  y = np.argmax(x @ teacher, axis=1).astype(np.int32)
  return x, y


def input_fn(data: Arrays, batch_size: int) -> Callable[[], tf.data.Dataset]:
  """An Estimator input_fn over `data`, in order, repeating.

  `batch_size` is the size of one dataset element: the global batch for the
  plain and replicate variants, global / N for MirroredStrategy, whose
  replicas each pull their own element (N consecutive elements are one
  global batch, so every variant sees the same examples per step).
  """
  x, y = data

  def fn():
    dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y))
    dataset = dataset.repeat().batch(batch_size, drop_remainder=True)
    return dataset.prefetch(2)

  return fn


def _initializer(seed: int):
  return tf.compat.v1.glorot_uniform_initializer(seed=seed)


def _dense(x, units: int, name: str, seed: int, activation=None):
  return tf.compat.v1.layers.dense(
      x,
      units,
      activation=activation,
      name=name,
      kernel_initializer=_initializer(seed))


def mlp_logits(x: tf.Tensor, training: bool) -> tf.Tensor:
  """784-512-512-10 with ReLU."""
  del training
  h = _dense(x, 512, "hidden1", 1, tf.nn.relu)
  h = _dense(h, 512, "hidden2", 2, tf.nn.relu)
  return _dense(h, NUM_CLASSES, "logits", 3)


def mlp_clipped_before_use_logits(x: tf.Tensor, training: bool) -> tf.Tensor:
  """The mlp, its first kernel clipped at the start of each step (a write
  outside the optimizer's update, before the forward pass reads it: what
  MIRRORED does not copy)."""
  del training
  with tf.compat.v1.variable_scope("hidden1"):
    kernel = tf.compat.v1.get_variable(
        "kernel", [NUM_INPUTS, 512], initializer=_initializer(1))
    bias = tf.compat.v1.get_variable(
        "bias", [512], initializer=tf.compat.v1.zeros_initializer())
    clip = kernel.assign(tf.clip_by_value(kernel, -0.05, 0.05))
    with tf.control_dependencies([clip]):
      h = tf.nn.relu(tf.matmul(x, kernel.read_value()) + bias)
  h = _dense(h, 512, "hidden2", 2, tf.nn.relu)
  return _dense(h, NUM_CLASSES, "logits", 3)


def _conv(x, filters: int, name: str, seed: int):
  return tf.compat.v1.layers.conv2d(
      x,
      filters,
      3,
      padding="same",
      activation=tf.nn.relu,
      name=name,
      kernel_initializer=_initializer(seed))


def _conv_bn(x, filters: int, name: str, seed: int, training: bool):
  """conv3x3 (no bias: batch norm's offset replaces it), batch norm, ReLU.

  `tf.compat.v1.layers.batch_normalization` puts its moving-statistics
  updates in UPDATE_OPS; in training it normalises with the batch's
  statistics, which `replicate` makes the whole batch's (sync_batch_norm).
  """
  h = tf.compat.v1.layers.conv2d(
      x,
      filters,
      3,
      padding="same",
      use_bias=False,
      name=name,
      kernel_initializer=_initializer(seed))
  h = tf.compat.v1.layers.batch_normalization(
      h, training=training, name=name + "_bn")
  return tf.nn.relu(h)


def cnn_logits(x: tf.Tensor,
               training: bool,
               batch_norm: bool = False) -> tf.Tensor:
  """conv3x3(16)-pool-conv3x3(32)-pool-dense(64)-dense(10) on 28x28x1.

  With `batch_norm`, each conv is followed by batch normalization (before
  its ReLU): the cnn_bn workload.
  """

  def conv(h, filters, name, seed):
    if batch_norm:
      return _conv_bn(h, filters, name, seed, training)
    return _conv(h, filters, name, seed)

  h = tf.reshape(x, (-1,) + IMAGE_SHAPE)
  h = conv(h, 16, "conv1", 1)
  h = tf.compat.v1.layers.max_pooling2d(h, 2, 2, name="pool1")
  h = conv(h, 32, "conv2", 2)
  h = tf.compat.v1.layers.max_pooling2d(h, 2, 2, name="pool2")
  h = tf.compat.v1.layers.flatten(h, name="flatten")
  h = _dense(h, 64, "dense", 3, tf.nn.relu)
  return _dense(h, NUM_CLASSES, "logits", 4)


def cnn_bn_logits(x: tf.Tensor, training: bool) -> tf.Tensor:
  """The cnn with batch normalization after each conv."""
  return cnn_logits(x, training, batch_norm=True)


def resnet50_logits(x: tf.Tensor, training: bool) -> tf.Tensor:
  """Keras ResNet50 (no weights loaded; 53 fused batch-norm layers) on the
  28x28 images padded to 32x32 (its smallest input) in 3 channels.

  Its batch-norm layers put their moving-statistics updates in
  `model.updates`, not UPDATE_OPS; this call's go there, as a model_fn
  using a Keras model in a graph must do. Initial weights come from the graph's
  seed, so unlike the other workloads the variants' final losses differ.
  """
  h = tf.reshape(x, (-1,) + IMAGE_SHAPE)
  h = tf.tile(tf.pad(h, [[0, 0], [2, 2], [2, 2], [0, 0]]), [1, 1, 1, 3])
  model = tf.keras.applications.ResNet50(
      weights=None,
      input_shape=(32, 32, 3),
      classes=NUM_CLASSES,
      classifier_activation=None)
  built = {id(update) for update in model.updates}  # on its own Input
  logits = model(h, training=training)
  for update in model.updates:
    if id(update) not in built:
      tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
  return logits


# The embedding workload's table: rows and width.
VOCABULARY = 50000
EMBEDDING_WIDTH = 64


def embedding_logits(x: tf.Tensor, training: bool) -> tf.Tensor:
  """An embedding table of 50000 x 64 (12.8 MB), looked up with 16 ids per
  example drawn from the features, averaged, then a dense layer: a sparse
  gradient touching at most 16 rows per example."""
  del training
  ids = tf.math.floormod(
      tf.cast(tf.abs(x[:, :16]) * 10000.0, tf.int64), VOCABULARY)
  table = tf.compat.v1.get_variable(
      "embedding", [VOCABULARY, EMBEDDING_WIDTH],
      initializer=tf.compat.v1.random_normal_initializer(stddev=0.1, seed=7))
  pooled = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
  return _dense(pooled, NUM_CLASSES, "logits", seed=8)


_LOGITS = {
    "embedding": embedding_logits,
    "mlp": mlp_logits,
    "mlp_top_k": mlp_logits,
    "mlp_top_k_by_hand": mlp_logits,
    "mlp_clipped_before_use": mlp_clipped_before_use_logits,
    "cnn": cnn_logits,
    "cnn_bn": cnn_bn_logits,
    "resnet50": resnet50_logits
}


def _hardest_half(labels: tf.Tensor, logits: tf.Tensor,
                  by_hand: bool) -> tf.Tensor:
  """The mean of the batch's hardest half of per-example losses (online
  hard-example mining, a top-k over the batch's rows): replicate runs the
  top-k on the whole batch itself, or (`by_hand`) the model_fn gathers the
  whole batch's losses with `replicate.batch_concat` first, as it had to
  before the library ran row-mixing ops."""
  losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits)
  if by_hand:
    losses = replicate.batch_concat(losses)
  half = (tf.shape(losses)[0] + 1) // 2
  return tf.reduce_mean(tf.math.top_k(losses, half).values)


def model_fn(features: Dict[str, tf.Tensor], labels: tf.Tensor, mode: str,
             params: Dict) -> tf.estimator.EstimatorSpec:
  """Softmax classifier; params: 'workload', 'learning_rate', 'momentum'.

  Optional 'gate_gradients': the optimizer's (default GATE_OP);
  'precision': 'mixed' trains with a dynamic loss scale
  (`tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer`, its
  update in a tf.cond), float32 variables.
  """
  training = mode == tf.estimator.ModeKeys.TRAIN
  logits = _LOGITS[params["workload"]](features["x"], training)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  if params["workload"].startswith("mlp_top_k"):
    loss = _hardest_half(labels, logits, params["workload"].endswith("by_hand"))
  else:
    # Default reduction SUM_BY_NONZERO_WEIGHTS, replicate's default too.
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        eval_metric_ops={
            "accuracy":
                tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1))
        })
  optimizer = tf.compat.v1.train.MomentumOptimizer(params["learning_rate"],
                                                   params["momentum"])
  if params.get("precision") == "mixed":
    optimizer = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
        optimizer, "dynamic")
  optimizer = replicate.TowerOptimizer(optimizer)
  # Batch norm's moving-statistics updates run with each step (none for
  # mlp and cnn: an empty control dependency adds no op).
  update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(update_ops):
    train_op = optimizer.minimize(
        loss,
        tf.compat.v1.train.get_global_step(),
        gate_gradients=params.get("gate_gradients",
                                  tf.compat.v1.train.Optimizer.GATE_OP))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
