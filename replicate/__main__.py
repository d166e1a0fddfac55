"""`python -m replicate`: a self-check for a new machine.

Prints the versions, the local devices and what `replicate` would do with
them (towers, variable placement, consolidation device), then trains a tiny
model on one device and on N towers (every local GPU, or N virtual CPUs)
and checks that they reach the same weights. The last line says OK or what
is wrong; the exit status is 0 or 1.

    python -m replicate              # GPUs, or 2 virtual CPUs
    python -m replicate --towers=4
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # pylint: disable=g-import-not-at-top,g-bad-import-order
import importlib.metadata
import platform
import sys
import time
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

import replicate
from replicate import testing
from replicate._prepare import devices as _devices

_DEFAULT_CPU_TOWERS = 2
_STEPS = 3
_BATCH = 16
_FEATURES = 4


def _versions() -> List[str]:
  where = os.path.dirname(replicate.__file__)
  lines = [
      f"replicate {replicate.__version__} ({where})",
      f"Python {platform.python_version()}", f"TensorFlow {tf.__version__}"
  ]
  # From TensorFlow 2.16 on, tf.keras is tf-keras (Keras 2), not keras.
  for package in ("tensorflow-estimator", "keras", "tf-keras", "numpy"):
    try:
      lines.append(f"{package} {importlib.metadata.version(package)}")
    except importlib.metadata.PackageNotFoundError:
      if package != "tf-keras":
        lines.append(f"{package} not installed")
  lines.append(f"tf.keras: {tf.keras.__name__.split('.')[0]}")
  return lines


def _tower_devices(towers: Optional[int]) -> List[str]:
  """Every GPU (or the first `towers`), else `towers` virtual CPUs.

  Runs before anything initialises TensorFlow's devices, so that the
  virtual CPUs can still be made.
  """
  if towers is not None and towers < 1:
    raise ValueError(f"--towers={towers}: pass at least 1.")
  gpus = tf.config.list_physical_devices("GPU")
  if gpus:
    count = len(gpus) if towers is None else min(towers, len(gpus))
    return [f"/device:GPU:{i}" for i in range(count)]
  return testing.virtual_cpus(towers or _DEFAULT_CPU_TOWERS)


def _placement_lines(devices: List[str]) -> List[str]:
  chosen = _devices.resolve_devices(None)
  consolidation_device = _devices.consolidation_device(devices)
  return [
      "local devices: " +
      ", ".join(d.name for d in tf.config.list_logical_devices()),
      f"devices=None would use: {chosen}" +
      ("" if len(chosen) > 1 else " (one device: the model_fn runs "
       "unsplit; pass devices=[...] for several towers)"),
      f"this check's towers: {devices}",
      f"default variable placement: "
      f"{_devices.default_placement(devices).name}",
      f"variable placement SHARED: every variable on {consolidation_device}",
      f"variable placement ROUND_ROBIN: spread over {devices}",
      f"variable placement MIRRORED: a copy on each of {devices}, "
      "gradients summed between them",
      "consolidation device (inputs split, results merged): "
      f"{consolidation_device}",
  ]


def _dense(inputs: tf.Tensor, units: int, name: str) -> tf.Tensor:
  with tf.compat.v1.variable_scope(name):
    kernel = tf.compat.v1.get_variable("kernel", [inputs.shape[1], units])
    bias = tf.compat.v1.get_variable(
        "bias", [units], initializer=tf.zeros_initializer())
  return tf.matmul(inputs, kernel) + bias


def _model_fn(features: Dict[str, tf.Tensor], labels: tf.Tensor,
              mode: str) -> tf.estimator.EstimatorSpec:
  """A two-layer classifier with Adagrad: small enough to build fast."""
  hidden = tf.nn.tanh(_dense(features["x"], 8, "hidden"))
  logits = _dense(hidden, 2, "logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = replicate.TowerOptimizer(tf.compat.v1.train.AdagradOptimizer(0.5))
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _input_fn() -> tf.data.Dataset:
  rng = np.random.RandomState(0)
  x = rng.randn(_BATCH * _STEPS, _FEATURES).astype(np.float32)
  labels = (x[:, 0] > x[:, 1]).astype(np.int64)
  dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, labels))
  return dataset.repeat().batch(_BATCH)


def _check(devices: List[str]) -> str:
  """Trains on one device and on `devices`; returns the OK line or raises."""
  start = time.perf_counter()
  summary = testing.assert_replicates(
      _model_fn, _input_fn, towers=[devices], steps=_STEPS, modes=("train",))
  return (f"OK: 1 device and {len(devices)} towers trained the same "
          f"{summary.variables} variables in {_STEPS} steps (largest "
          f"difference {summary.closest_to_tolerance:.2g} of the tolerance; "
          f"{time.perf_counter() - start:.1f} s)")


def main(argv: Optional[List[str]] = None) -> int:
  """Runs the self-check; returns the exit status."""
  parser = argparse.ArgumentParser(
      prog="python -m replicate", description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "--towers",
      type=int,
      default=None,
      help="towers to check: at most the GPUs there are; "
      f"without GPUs, virtual CPUs (default "
      f"{_DEFAULT_CPU_TOWERS})")
  args = parser.parse_args(argv)
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  for line in _versions():
    print(line)
  try:
    devices = _tower_devices(args.towers)
    for line in _placement_lines(devices):
      print(line, flush=True)
    print(_check(devices))
  except Exception as e:  # pylint: disable=broad-except
    message = " ".join(str(e).split())
    print(f"FAILED: {type(e).__name__}: {message}")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
