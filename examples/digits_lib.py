"""The digits example's data, model and hooks, shared by its programs.

`digits.py` (one machine) and `cluster.py` (a TF_CONFIG cluster) train the
same model on the same data; this module holds what they share and defines
no flags, so tests can import it too.
"""

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from sklearn import datasets
from sklearn import model_selection
import tensorflow as tf

import replicate

NUM_CLASSES = 10
IMAGE_SIZE = 8
TEST_FRACTION = 0.2
DEFAULT_CPU_TOWERS = 4
DROPOUT = 0.2

Arrays = Tuple[np.ndarray, np.ndarray]


def load_digits() -> Tuple[Arrays, Arrays]:
  """Loads the digits, scaled to [0, 1], split 80/20 into train and test.

  The split is random but fixed (seeded, stratified by digit), so every run
  tests on the same 360 images.

  Returns:
    `((train_images, train_labels), (test_images, test_labels))`: images
    float32 of shape [n, 8, 8], labels int32 of shape [n].
  """
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  train_x, test_x, train_y, test_y = model_selection.train_test_split(
      images, labels, test_size=TEST_FRACTION, random_state=0, stratify=labels)
  return (train_x, train_y), (test_x, test_y)


def train_input_fn(images: np.ndarray,
                   labels: np.ndarray,
                   batch_size: int,
                   num_shards: int = 1,
                   index: int = 0) -> tf.data.Dataset:
  """Shuffled, repeated training batches of `{'image': ...}` and labels.

  With `num_shards` > 1 the batches come from shard `index` of the images
  only (every `num_shards`-th image): each trainer of a cluster reads its own.
  The order is seeded, so a trainer reads the same batches on every run.
  """
  dataset = tf.data.Dataset.from_tensor_slices(({"image": images}, labels))
  dataset = dataset.shard(num_shards, index)
  dataset = dataset.shuffle(len(images), seed=0).repeat()
  return dataset.batch(batch_size, drop_remainder=True).prefetch(2)


def eval_input_fn(images: np.ndarray, labels: Optional[np.ndarray],
                  batch_size: int) -> tf.data.Dataset:
  """One pass over the data in order.

  The last batch is usually smaller and need not divide by the number of
  towers: replicate splits it into shards that differ by at most one.
  """
  features = {"image": images}
  data = features if labels is None else (features, labels)
  return tf.data.Dataset.from_tensor_slices(data).batch(batch_size)


def build_logits(images: tf.Tensor,
                 model: str,
                 training: bool,
                 dropout: float = DROPOUT) -> tf.Tensor:
  """The network: images [batch, 8, 8] to logits [batch, 10].

  Keras layers are used on purpose: they ignore variable-scope reuse, and
  replicate still gives every tower the same, single set of weights.
  """
  if model == "cnn":
    x = tf.reshape(images, [-1, IMAGE_SIZE, IMAGE_SIZE, 1])
    x = tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = tf.keras.layers.MaxPool2D(2)(x)
    x = tf.keras.layers.Flatten()(x)
  else:
    x = tf.reshape(images, [-1, IMAGE_SIZE * IMAGE_SIZE])
  x = tf.keras.layers.Dense(128, activation="relu")(x)
  x = tf.keras.layers.Dropout(dropout)(x, training=training)
  return tf.keras.layers.Dense(NUM_CLASSES)(x)


def model_fn(features: Dict[str, tf.Tensor], labels: Optional[tf.Tensor],
             mode: str, params: Dict[str, Any]) -> tf.estimator.EstimatorSpec:
  """An ordinary Estimator model_fn; nothing in it knows about towers.

  Args:
    features: `{'image': float32 [batch, 8, 8]}`.
    labels: int32 [batch] digit labels, or None in PREDICT mode.
    mode: a `tf.estimator.ModeKeys`.
    params: `{'model': 'mlp' or 'cnn', 'learning_rate': float}`, and
      optionally `'dropout'` (the dropout rate; `DROPOUT` by default) and
      `'optimizer'` (see `make_optimizer`).

  Returns:
    The EstimatorSpec for `mode`.
  """
  training = mode == tf.estimator.ModeKeys.TRAIN
  logits = build_logits(features["image"], params["model"], training,
                        params.get("dropout", DROPOUT))
  probabilities = tf.nn.softmax(logits)
  classes = tf.argmax(logits, axis=1, output_type=tf.int32)
  predictions = {"classes": classes, "probabilities": probabilities}

  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(
        mode,
        predictions=predictions,
        export_outputs={
            "serving_default": tf.estimator.export.PredictOutput(predictions)
        })

  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == tf.estimator.ModeKeys.EVAL:
    metrics = {"accuracy": tf.compat.v1.metrics.accuracy(labels, classes)}
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops=metrics)

  optimizer = replicate.TowerOptimizer(make_optimizer(params))
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def make_optimizer(params: Dict[str, Any]) -> tf.compat.v1.train.Optimizer:
  """Adam, or plain gradient descent for params['optimizer'] == 'sgd'."""
  if params.get("optimizer", "adam") == "sgd":
    return tf.compat.v1.train.GradientDescentOptimizer(params["learning_rate"])
  return tf.compat.v1.train.AdamOptimizer(params["learning_rate"])


def serving_input_receiver_fn() -> tf.estimator.export.ServingInputReceiver:
  """Serving inputs: a batch of 8x8 images fed through a placeholder.

  A graph fed by placeholders pins no device, so the SavedModel exported
  from a multi-GPU (or multi-CPU) run loads and serves on any machine.
  """
  images = tf.compat.v1.placeholder(
      tf.float32, [None, IMAGE_SIZE, IMAGE_SIZE], name="image")
  return tf.estimator.export.ServingInputReceiver({"image": images},
                                                  {"image": images})


class ProgressHook(tf.estimator.SessionRunHook):
  """Prints the loss every `every` steps and measures training throughput.

  Timing starts after the first step, so graph building, session creation
  and the first step's one-time set-up are left out; it stops after the last
  step.

  Args:
    loss: the loss tensor to print: the merged loss over all towers.
    every: print every this many global steps (and on the first and last
      step of this run).
    batch_size: examples per step, for the throughput.
    steps: how many steps this `train()` call runs.
  """

  def __init__(self, loss: tf.Tensor, every: int, batch_size: int, steps: int):
    self._loss = loss
    self._every = max(1, every)
    self._batch_size = batch_size
    self._steps = steps
    self._step = 0
    self._done = 0
    self._start: Optional[float] = None
    self._end: Optional[float] = None
    self._timed_steps = 0

  def after_create_session(self, session, coord):
    del coord  # Unused.
    self._step = int(session.run(tf.compat.v1.train.get_global_step()))

  def before_run(self, run_context):
    # The loss is computed by the training step anyway: no extra work.
    return tf.estimator.SessionRunArgs(self._loss)

  def after_run(self, run_context, run_values):
    now = time.perf_counter()
    if self._start is None:
      self._start = now
    else:
      self._timed_steps += 1
      self._end = now
    self._step += 1
    self._done += 1
    if (self._step % self._every == 0 or self._done in (1, self._steps)):
      print(
          f"step {self._step:5d}  loss {float(run_values.results):.4f}",
          flush=True)

  @property
  def examples_per_sec(self) -> float:
    """Training examples per second over the timed steps (0 if none)."""
    if not self._timed_steps or self._end <= self._start:
      return 0.0
    return self._timed_steps * self._batch_size / (self._end - self._start)


def with_training_hooks(
    model_fn: Callable[..., tf.estimator.EstimatorSpec],
    make_hooks: Callable[[tf.estimator.EstimatorSpec],
                         List[tf.estimator.SessionRunHook]],
) -> Callable[..., tf.estimator.EstimatorSpec]:
  """Adds hooks, built on the merged TRAIN spec, to a (replicated) model_fn.

  A hook passed to `Estimator.train(hooks=...)` cannot see the model's loss
  tensor; one returned in the spec can. Adding it here, outside
  `replicate_model_fn`, gives it the loss summed over every tower rather
  than one tower's share.

  Args:
    model_fn: a model_fn with the full Estimator signature.
    make_hooks: called with the merged TRAIN `EstimatorSpec`, returns a list
      of `SessionRunHook`s.

  Returns:
    A model_fn with the same signature.
  """

  def model_fn_with_hooks(features, labels, mode, params, config):
    spec = model_fn(features, labels, mode, params, config)
    if mode == tf.estimator.ModeKeys.TRAIN:
      hooks = list(spec.training_hooks) + list(make_hooks(spec))
      spec = tf.estimator.EstimatorSpec(
          **dict(spec._asdict(), training_hooks=hooks))
    return spec

  return model_fn_with_hooks


def configure_devices(
    towers: Optional[int]
) -> Tuple[Optional[List[str]], Optional[tf.compat.v1.ConfigProto]]:
  """Picks the tower devices; without a GPU, creates virtual CPU devices.

  Must run before anything initialises TensorFlow's devices: the virtual CPU
  devices cannot be added afterwards.

  Args:
    towers: the number of towers, or None for the default (every GPU, or
      `DEFAULT_CPU_TOWERS` virtual CPUs).

  Returns:
    `(devices, session_config)`: `devices` for `replicate_model_fn` (None:
    every local GPU) and the session config the Estimator must use (None:
    TensorFlow's default).

  Raises:
    ValueError: `towers` is not positive, or more than the GPUs there are.
  """
  if towers is not None and towers < 1:
    raise ValueError(f"--towers={towers}: need at least one tower.")
  gpus = tf.config.list_physical_devices("GPU")
  if gpus:
    if towers is None or towers == len(gpus):
      return None, None
    if towers > len(gpus):
      raise ValueError(f"--towers={towers} but there are only {len(gpus)} "
                       "GPUs; pass at most that many.")
    return [f"/device:GPU:{i}" for i in range(towers)], None
  towers = towers or DEFAULT_CPU_TOWERS
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * towers)
  session_config = tf.compat.v1.ConfigProto(
      device_count={"CPU": towers}, allow_soft_placement=True)
  return [f"/device:CPU:{i}" for i in range(towers)], session_config
