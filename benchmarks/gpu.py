r"""Images (examples) per second on every GPU of this machine, in one command.

Synthetic data, Keras ResNet-50 and a BERT-base-sized Transformer encoder
(12 layers, width 768, 12 heads, 128 tokens), float32 and mixed precision
(a float16 compute policy, float32 variables, a dynamic loss scale), on
one GPU unwrapped and on 2, 4, ... all GPUs: replicate's MIRRORED and
ROUND_ROBIN and `tf.distribute.MirroredStrategy`, each with the same
per-GPU batch. Prints the machine (GPUs, driver, their interconnect from
`nvidia-smi topo -m`, TensorFlow's build, the CUDA JIT cache settings) and a
markdown table: examples/sec and the scaling over one GPU; `--out` writes
the same as JSON.

  python benchmarks/gpu.py                       # every GPU, both models
  python benchmarks/gpu.py --models=resnet50 --precisions=mixed --out=r.json

Without GPUs, `--cpus=N` stands N virtual CPU devices in for them (and
`--tiny` shrinks the models): the suite runs it so, for one step.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402  # pylint: disable=g-import-not-at-top
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import replicate  # noqa: E402  # isort: skip

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["resnet50", "transformer"], "Models.")
flags.DEFINE_list("precisions", ["float32", "mixed"], "float32, mixed.")
flags.DEFINE_list(
    "variants", ["mirrored", "round_robin", "strategy"],
    "Besides one GPU unwrapped: mirrored, round_robin, strategy.")
flags.DEFINE_list("towers", [], "Device counts (default 2, 4, ... all).")
flags.DEFINE_integer("batch_per_device", 32, "Examples per device per step.")
flags.DEFINE_integer("steps", 30, "Timed steps.")
flags.DEFINE_integer("warmup", 10, "Steps before timing.")
flags.DEFINE_integer("cpus", 0, "Virtual CPU devices standing in for GPUs.")
flags.DEFINE_bool("tiny", False, "Tiny models (to check the script runs).")
flags.DEFINE_string("out", None, "Write the results as JSON.")

_CLASSES = 1000


def _command(*args: str) -> Optional[str]:
  try:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=30,
        check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


def machine() -> Dict[str, Any]:
  """What the results were measured on."""
  build = tf.sysconfig.get_build_info()
  return {
      "gpus":
          _command("nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                   "--format=csv,noheader"),
      "interconnect":
          _command("nvidia-smi", "topo", "-m"),
      "tensorflow":
          tf.__version__,
      "cuda_build":
          build.get("cuda_version"),
      "cudnn_build":
          build.get("cudnn_version"),
      "cuda_cache_path":
          os.environ.get("CUDA_CACHE_PATH"),
      "cuda_cache_maxsize":
          os.environ.get("CUDA_CACHE_MAXSIZE"),
      "python":
          sys.version.split()[0],
  }


def _devices() -> List[str]:
  if FLAGS.cpus:
    return [f"/device:CPU:{i}" for i in range(FLAGS.cpus)]
  return [
      f"/device:GPU:{i}"
      for i in range(len(tf.config.list_physical_devices("GPU")))
  ]


def _resnet50(inputs: tf.Tensor) -> tf.Tensor:
  if FLAGS.tiny:
    h = tf.keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    h = tf.keras.layers.GlobalAveragePooling2D()(h)
    return tf.keras.layers.Dense(_CLASSES, dtype="float32")(h)
  model = tf.keras.applications.ResNet50(
      weights=None,
      input_shape=inputs.shape[1:],
      classes=_CLASSES,
      classifier_activation=None)
  return tf.cast(model(inputs), tf.float32)


def _transformer(tokens: tf.Tensor) -> tf.Tensor:
  layers, width, heads = (2, 32, 2) if FLAGS.tiny else (12, 768, 12)
  h = tf.keras.layers.Embedding(30522, width)(tokens)
  for _ in range(layers):
    attended = tf.keras.layers.MultiHeadAttention(heads, width // heads)(h, h)
    h = tf.keras.layers.LayerNormalization()(h + attended)
    hidden = tf.keras.layers.Dense(4 * width, activation="gelu")(h)
    h = tf.keras.layers.LayerNormalization()(
        h + tf.keras.layers.Dense(width)(hidden))
  return tf.keras.layers.Dense(_CLASSES, dtype="float32")(h[:, 0])


def _shape(model: str) -> List[int]:
  if model == "resnet50":
    return [32, 32, 3] if FLAGS.tiny else [224, 224, 3]
  return [16 if FLAGS.tiny else 128]


def _model_fn(features, labels, mode, params):
  """A classifier of the model, its loss scaled in mixed precision."""
  del params
  precision, model = _SETTINGS["precision"], _SETTINGS["model"]
  tf.keras.mixed_precision.set_global_policy("mixed_float16" if precision ==
                                             "mixed" else "float32")
  try:
    network = _resnet50 if model == "resnet50" else _transformer
    logits = network(features)
  finally:
    tf.keras.mixed_precision.set_global_policy("float32")
  loss = tf.reduce_mean(
      tf.keras.losses.sparse_categorical_crossentropy(
          labels, logits, from_logits=True))
  optimizer = tf.keras.optimizers.legacy.SGD(0.01, momentum=0.9)
  if precision == "mixed":
    optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
  optimizer = replicate.TowerOptimizer(optimizer)
  optimizer.iterations = tf.compat.v1.train.get_global_step()
  train_op = optimizer.get_updates(loss, tf.compat.v1.trainable_variables())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op[0])


_SETTINGS: Dict[str, str] = {}


def _input_fn(model: str, batch: int) -> Callable[[], tf.data.Dataset]:
  shape = _shape(model)

  def input_fn():
    rng = np.random.RandomState(0)
    if model == "resnet50":
      x = rng.rand(batch, *shape).astype(np.float32)
    else:
      x = rng.randint(0, 30522, [batch, *shape]).astype(np.int32)
    y = rng.randint(0, _CLASSES, batch).astype(np.int32)
    return tf.data.Dataset.from_tensors((x, y)).repeat()

  return input_fn


class _Timer(tf.estimator.SessionRunHook):
  """Seconds of the timed steps, after the warm-up."""

  def __init__(self, warmup: int) -> None:
    self._warmup, self._step, self._start = warmup, 0, None
    self.seconds = 0.0

  def before_run(self, run_context: Any) -> None:
    if self._step == self._warmup:
      self._start = time.perf_counter()

  def after_run(self, run_context: Any, run_values: Any) -> None:
    self._step += 1

  def end(self, session: Any) -> None:
    if self._start is not None:
      self.seconds = time.perf_counter() - self._start


def run(model: str, precision: str, variant: str, devices: List[str]) -> float:
  """Examples per second of one configuration."""
  _SETTINGS.update(model=model, precision=precision)
  config = {
      "save_checkpoints_steps": None,
      "save_checkpoints_secs": None,
      "save_summary_steps": None,
      "log_step_count_steps": None
  }
  session = tf.compat.v1.ConfigProto(allow_soft_placement=True)
  if FLAGS.cpus:
    session.device_count["CPU"] = FLAGS.cpus
  model_fn: Any = _model_fn
  if variant == "strategy":
    config["train_distribute"] = tf.distribute.MirroredStrategy(devices)
  elif variant == "plain":
    model_fn = replicate.replicate_model_fn(_model_fn, devices=devices[:1])
  else:
    model_fn = replicate.replicate_model_fn(
        _model_fn, devices=devices, variable_placement=variant)
  batch = FLAGS.batch_per_device * (1
                                    if variant == "strategy" else len(devices))
  timer = _Timer(FLAGS.warmup)
  with tempfile.TemporaryDirectory() as model_dir:
    estimator = tf.estimator.Estimator(
        model_fn,
        model_dir=model_dir,
        config=tf.estimator.RunConfig(session_config=session, **config))
    estimator.train(
        _input_fn(model, batch),
        steps=FLAGS.warmup + FLAGS.steps,
        hooks=[timer])
  return FLAGS.batch_per_device * len(devices) * FLAGS.steps / max(
      timer.seconds, 1e-9)


def _table(rows: List[Dict[str, Any]]) -> str:
  lines = [
      "| model | precision | variant | devices | examples/sec | scaling |",
      "|---|---|---|---:|---:|---:|"
  ]
  for r in rows:
    lines.append(f"| {r['model']} | {r['precision']} | {r['variant']} | "
                 f"{r['devices']} | {r['examples_per_sec']:.1f} | "
                 f"{r['scaling']:.2f} |")
  return "\n".join(lines)


def main(argv: List[str]) -> None:
  del argv
  if FLAGS.cpus:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * FLAGS.cpus)
  available = _devices()
  if not available:
    raise SystemExit("No GPU found; run with --cpus=N to check the script.")
  counts = [int(n) for n in FLAGS.towers] or [
      n for n in (2, 4, 8, 16) if n <= len(available)
  ] or [len(available)]
  info = machine()
  print(json.dumps(info, indent=1))
  rows = []
  for model in FLAGS.models:
    for precision in FLAGS.precisions:
      one = run(model, precision, "plain", available[:1])
      rows.append(
          dict(
              model=model,
              precision=precision,
              variant="plain",
              devices=1,
              examples_per_sec=one,
              scaling=1.0))
      for count in counts:
        for variant in FLAGS.variants:
          rate = run(model, precision, variant, available[:count])
          rows.append(
              dict(
                  model=model,
                  precision=precision,
                  variant=variant,
                  devices=count,
                  examples_per_sec=rate,
                  scaling=rate / one))
          print(rows[-1], flush=True)
  print(_table(rows))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump({"machine": info, "results": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
