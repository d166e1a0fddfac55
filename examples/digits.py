"""Trains a digit classifier on every local device with replicate.

The handwritten-digits data set bundled with scikit-learn (1797 8x8 images,
no download) is split 80/20 (seeded) into train and test; a small MLP or CNN
is trained with `tf.estimator.Estimator`, its model_fn wrapped once in
`replicate.replicate_model_fn` and its optimizer in
`replicate.TowerOptimizer`. Every batch is split across the towers and the
towers' summed gradients are applied once, so the result is that of one
device on the whole batch.

With GPUs, every local GPU is a tower. Without one, the host CPU is split
into `--towers` virtual CPU devices (4 by default), so the multi-device code
path runs on any machine.

Run it:

    python examples/digits.py                       # defaults: MLP, 300 steps
    python examples/digits.py --model=cnn --towers=2 --steps=500
    python examples/digits.py --export_dir=/tmp/digits_export

It prints the loss every `--log_every` steps, then the test accuracy, the
training throughput in examples/sec and a few test predictions.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tempfile  # pylint: disable=g-import-not-at-top,g-bad-import-order
from typing import List

from absl import app
from absl import flags
from absl import logging

# The data, model_fn and hooks live in digits_lib (shared with cluster.py);
# these names stay importable from this module too.
from digits_lib import ProgressHook
from digits_lib import configure_devices
from digits_lib import eval_input_fn
from digits_lib import load_digits
from digits_lib import model_fn
from digits_lib import serving_input_receiver_fn
from digits_lib import train_input_fn
from digits_lib import with_training_hooks
import tensorflow as tf

import replicate

FLAGS = flags.FLAGS
flags.DEFINE_integer(
    "towers", None,
    "Number of towers. Default: every local GPU, or 4 virtual CPU devices "
    "when there is no GPU.")
flags.DEFINE_integer("steps", 300, "Training steps (global batches).")
flags.DEFINE_integer("batch_size", 128,
                     "Global batch size, split across the towers.")
flags.DEFINE_enum("model", "mlp", ["mlp", "cnn"], "Model to train.")
flags.DEFINE_string("model_dir", None,
                    "Checkpoint directory. Default: a fresh temporary one.")
flags.DEFINE_float("learning_rate", 0.01, "Adam learning rate.")
flags.DEFINE_integer("log_every", 50, "Print the loss every this many steps.")
flags.DEFINE_string(
    "export_dir", None, "If set, export a SavedModel for serving under this "
    "directory after training.")


def main(argv: List[str]) -> None:
  """Trains, evaluates, predicts and optionally exports; prints the results."""
  del argv  # Unused.
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  if not FLAGS["verbosity"].present:  # replicate logs its towers at INFO.
    logging.set_verbosity(logging.WARNING)
  devices, session_config = configure_devices(FLAGS.towers)
  towers = devices or [d.name for d in tf.config.list_logical_devices("GPU")]
  print(
      f"replicate {replicate.__version__}: {FLAGS.model} on "
      f"{len(towers)} towers {towers}",
      flush=True)

  (train_x, train_y), (test_x, test_y) = load_digits()
  print(
      f"digits: {len(train_x)} train, {len(test_x)} test images; batch "
      f"{FLAGS.batch_size}, {FLAGS.steps} steps",
      flush=True)

  # Keras layers draw their initializers' seeds from Python's `random`:
  # seeded, every run (and every TensorFlow line) starts from one set of
  # weights.
  tf.keras.utils.set_random_seed(0)
  model_dir = FLAGS.model_dir or tempfile.mkdtemp(prefix="digits_")
  progress = []

  def make_hooks(spec: tf.estimator.EstimatorSpec) -> List[ProgressHook]:
    hook = ProgressHook(spec.loss, FLAGS.log_every, FLAGS.batch_size,
                        FLAGS.steps)
    progress.append(hook)
    return [hook]

  estimator = tf.estimator.Estimator(
      model_fn=with_training_hooks(
          replicate.replicate_model_fn(model_fn, devices=devices), make_hooks),
      model_dir=model_dir,
      params={
          "model": FLAGS.model,
          "learning_rate": FLAGS.learning_rate
      },
      config=tf.estimator.RunConfig(
          session_config=session_config, tf_random_seed=0))

  estimator.train(
      lambda: train_input_fn(train_x, train_y, FLAGS.batch_size),
      steps=FLAGS.steps)
  # Only this call's steps count: progress[-1] is the hook of this train().
  examples_per_sec = progress[-1].examples_per_sec

  results = estimator.evaluate(
      lambda: eval_input_fn(test_x, test_y, FLAGS.batch_size))
  print(f"test loss: {results['loss']:.4f} (global step "
        f"{results['global_step']})")
  print(f"test accuracy: {results['accuracy']:.4f}")
  print(f"training examples/sec: {examples_per_sec:.1f}")

  count = 10
  predicted = [
      p["classes"] for p in estimator.predict(
          lambda: eval_input_fn(test_x[:count], None, FLAGS.batch_size))
  ]
  print(f"first {count} test labels:      {test_y[:count].tolist()}")
  print(f"first {count} test predictions: {[int(c) for c in predicted]}")

  if FLAGS.export_dir:
    path = estimator.export_saved_model(FLAGS.export_dir,
                                        serving_input_receiver_fn)
    print(f"exported SavedModel: {path.decode()}")
  print(f"checkpoints: {model_dir}")


if __name__ == "__main__":
  app.run(main)
