"""Trains a canned wide-and-deep estimator on every local device with replicate.

The breast-cancer data set bundled with scikit-learn (569 tumours, 30
numeric measurements, benign or malignant; no download) is split 80/20
(seeded). A v2 `tf.estimator.DNNLinearCombinedClassifier` learns from a
numeric column (the deep part: the measurements, standardised) and
categorical ones (the wide part: three measurements bucketized into
quartiles, and their cross). It is replicated
with the same two lines as a custom model_fn: its optimizers wrapped in
`replicate.TowerOptimizer`, its `model_fn` in `replicate.replicate_model_fn`.

With GPUs, every local GPU is a tower. Without one, the host CPU is split
into `--towers` virtual CPU devices (4 by default) with
`replicate.testing`.

    python examples/canned.py
    python examples/canned.py --towers=2 --steps=500 --model_dir=/tmp/canned
    tensorboard --logdir=/tmp/canned     # loss, metrics, eval curves

It prints the loss every `--log_every` steps, then the evaluation metrics,
the training throughput in examples/sec and where the TensorBoard summaries
are.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tempfile  # pylint: disable=g-import-not-at-top,g-bad-import-order
from typing import Dict, List, Optional, Tuple

from absl import app
from absl import flags
from absl import logging

# The progress and throughput hook is the digits examples' (same directory).
from digits_lib import ProgressHook
from digits_lib import with_training_hooks
import numpy as np
from sklearn import datasets
from sklearn import model_selection
import tensorflow as tf

import replicate
import replicate.testing

FLAGS = flags.FLAGS
flags.DEFINE_integer(
    "towers", None,
    "Number of towers. Default: every local GPU, or 4 virtual CPU devices "
    "when there is no GPU.")
flags.DEFINE_integer("steps", 150, "Training steps (global batches).")
flags.DEFINE_integer("batch_size", 64,
                     "Global batch size, split across the towers.")
flags.DEFINE_string(
    "model_dir", None,
    "Checkpoints and TensorBoard summaries. Default: a fresh "
    "temporary directory.")
flags.DEFINE_integer("log_every", 50, "Print the loss every this many steps.")

DEFAULT_CPU_TOWERS = 4
TEST_FRACTION = 0.2
# Measurements bucketized into categories for the wide part, and crossed.
BUCKETIZED = ("mean radius", "mean texture", "worst concave points")
BUCKETS = 4

Features = Dict[str, np.ndarray]


def feature_key(name: str) -> str:
  """'mean radius' -> 'mean_radius': feature names without spaces."""
  return name.replace(" ", "_")


def load_data(
) -> Tuple[Tuple[Features, np.ndarray], Tuple[Features, np.ndarray]]:
  """The breast-cancer data, split 80/20 (seeded, stratified).

  Returns:
    `((train_features, train_labels), (test_features, test_labels))`:
    features `{'measurements': float32 [n, 30]}` plus one float32 [n] array
    per measurement in BUCKETIZED; labels int32 [n], 1 for benign.
  """
  data = datasets.load_breast_cancer()
  train_x, test_x, train_y, test_y = model_selection.train_test_split(
      data.data.astype(np.float32),
      data.target.astype(np.int32),
      test_size=TEST_FRACTION,
      random_state=0,
      stratify=data.target)
  names = list(data.feature_names)

  def as_dict(x):
    features = {"measurements": x}
    features.update({feature_key(n): x[:, names.index(n)] for n in BUCKETIZED})
    return features

  return (as_dict(train_x), train_y), (as_dict(test_x), test_y)


def feature_columns(train: Features):
  """(wide, deep) feature columns; statistics come from the training set.

  Deep: the 30 measurements as one standardised numeric column, and the
  bucketized measurements as one-hot indicators. Wide: the bucketized
  measurements (categorical columns, quartiles) and their cross.
  """
  measurements = train["measurements"]
  mean, std = measurements.mean(axis=0), measurements.std(axis=0) + 1e-6
  deep = [
      tf.feature_column.numeric_column(
          "measurements",
          shape=(measurements.shape[1],),
          normalizer_fn=lambda x: (x - mean) / std)
  ]
  buckets = []
  for name in BUCKETIZED:
    values = train[feature_key(name)]
    edges = np.quantile(values, np.linspace(0, 1, BUCKETS + 1)[1:-1])
    buckets.append(
        tf.feature_column.bucketized_column(
            tf.feature_column.numeric_column(feature_key(name)),
            boundaries=sorted(float(e) for e in edges)))
  crossed = tf.feature_column.crossed_column(buckets, hash_bucket_size=64)
  wide = buckets + [crossed]
  deep += [tf.feature_column.indicator_column(b) for b in buckets]
  return wide, deep


def train_input_fn(features: Features, labels: np.ndarray,
                   batch_size: int) -> tf.data.Dataset:
  dataset = tf.data.Dataset.from_tensor_slices((features, labels))
  dataset = dataset.shuffle(len(labels), seed=0).repeat()
  return dataset.batch(batch_size, drop_remainder=True).prefetch(2)


def eval_input_fn(features: Features, labels: np.ndarray,
                  batch_size: int) -> tf.data.Dataset:
  """One pass in order; the last batch need not divide by the towers."""
  return tf.data.Dataset.from_tensor_slices(
      (features, labels)).batch(batch_size)


def configure_devices(
    towers: Optional[int]
) -> Tuple[Optional[List[str]], tf.estimator.RunConfig]:
  """Tower devices and a RunConfig; without a GPU, virtual CPU devices.

  Raises:
    ValueError: `towers` is not positive, or more than the GPUs there are.
  """
  if towers is not None and towers < 1:
    raise ValueError(f"--towers={towers}: need at least one tower.")
  gpus = tf.config.list_physical_devices("GPU")
  if gpus:
    if towers is not None and towers > len(gpus):
      raise ValueError(f"--towers={towers} but there are only {len(gpus)} "
                       "GPUs; pass at most that many.")
    devices = [f"/device:GPU:{i}" for i in range(towers or len(gpus))]
    return devices, tf.estimator.RunConfig()
  devices = replicate.testing.virtual_cpus(towers or DEFAULT_CPU_TOWERS)
  return devices, replicate.testing.run_config(len(devices))


def main(argv: List[str]) -> None:
  del argv  # Unused.
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  if not FLAGS["verbosity"].present:  # replicate logs its towers at INFO.
    logging.set_verbosity(logging.WARNING)
  devices, config = configure_devices(FLAGS.towers)
  model_dir = FLAGS.model_dir or tempfile.mkdtemp(prefix="canned_")
  config = config.replace(
      model_dir=model_dir, tf_random_seed=0, save_summary_steps=10)
  (train_x, train_y), (test_x, test_y) = load_data()
  print(f"replicate {replicate.__version__}: DNNLinearCombinedClassifier on "
        f"{len(devices)} towers {devices}")
  print(
      f"breast cancer: {len(train_y)} train, {len(test_y)} test examples; "
      f"batch {FLAGS.batch_size}, {FLAGS.steps} steps",
      flush=True)

  wide, deep = feature_columns(train_x)
  canned = tf.estimator.DNNLinearCombinedClassifier(
      linear_feature_columns=wide,
      dnn_feature_columns=deep,
      dnn_hidden_units=[32, 16],
      # Line 1 of 2: wrap the optimizers (functions build one per graph).
      linear_optimizer=replicate.TowerOptimizer(
          lambda: tf.keras.optimizers.legacy.Ftrl(0.05)),
      dnn_optimizer=replicate.TowerOptimizer(
          lambda: tf.keras.optimizers.legacy.Adagrad(0.05)),
      config=config)
  hooks: List[ProgressHook] = []

  def make_progress_hook(spec):
    hooks.append(
        ProgressHook(spec.loss, FLAGS.log_every, FLAGS.batch_size, FLAGS.steps))
    return hooks[-1:]

  estimator = tf.estimator.Estimator(
      # Line 2 of 2: wrap the model_fn.
      with_training_hooks(
          replicate.replicate_model_fn(canned.model_fn, devices=devices),
          make_progress_hook),
      config=config)

  estimator.train(
      lambda: train_input_fn(train_x, train_y, FLAGS.batch_size),
      steps=FLAGS.steps)
  metrics = estimator.evaluate(
      lambda: eval_input_fn(test_x, test_y, FLAGS.batch_size))
  for name in sorted(metrics):
    print(f"eval {name}: {float(metrics[name]):.4f}")
  print(f"training examples/sec: {hooks[-1].examples_per_sec:.1f}")
  print(f"TensorBoard summaries: tensorboard --logdir={model_dir}")


if __name__ == "__main__":
  app.run(main)
