r"""Seconds and ops to build a deep batch-norm model's TRAIN graph, per N.

The model_fn: Keras `ResNet50(weights=None, input_shape=(64, 64, 3),
classes=10)` (53 batch-norm layers, fused), `MomentumOptimizer` wrapped in
`replicate.TowerOptimizer`, UPDATE_OPS in the train_op's control
dependencies; `--quick` swaps in a 3-block batch-norm CNN (seconds, for a
smoke test). Variants, built in turn in one process, each build in a fresh
`tf.Graph`:

- `plain`: the unwrapped model_fn;
- `sync`, `unsync`: `replicate.replicate_model_fn(..., sync_batch_norm=
  True / False)` on N virtual CPUs;
- `mirrored`: the model_fn as `Estimator` + `MirroredStrategy` builds it.

Two measures: *model_fn* is the call of the (replicated) model_fn under a
graph with a dataset iterator's batch (plain, sync, unsync); *estimator* is
`Estimator.train` from the call to the first hook's `begin()` (the graph
built: input pipeline, model_fn or the strategy's call of it per replica,
loss reduction), where the run stops (no session, no step), for plain,
sync and mirrored. Ops are the ops the model_fn added, or the graph's at
`begin()`. Ratios are to plain of the same measure, medians over
`--repeats` builds taken in turn (one untimed warm-up build first).

  python benchmarks/build_cost.py --towers=1,2,4
  python benchmarks/build_cost.py --quick
  python benchmarks/build_cost.py --profile=sync:4   # cProfile one build
"""

import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # pylint: disable=g-import-not-at-top

import replicate  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_list("towers", ["1", "2", "4"], "Tower counts N.")
flags.DEFINE_list("variants", ["sync", "unsync", "mirrored"],
                  "Besides plain: sync, unsync, mirrored.")
flags.DEFINE_list(
    "measures", ["model_fn", "estimator"],
    "model_fn (the call under a graph), estimator (to the "
    "first hook's begin()).")
flags.DEFINE_bool("quick", False, "A small batch-norm CNN instead of ResNet50.")
flags.DEFINE_integer("batch_size", 32, "Global batch (static shape).")
flags.DEFINE_integer("repeats", 3, "Timed builds per graph.", lower_bound=1)
flags.DEFINE_string(
    "profile", None, "VARIANT:N: cProfile one model_fn build and print the "
    "top functions instead of the table.")
flags.DEFINE_string("result_file", None, "Where the JSON goes (else stdout).")

_IMAGE = (64, 64, 3)
_CLASSES = 10


def _small_cnn(training: bool):
  """3 conv-BN-ReLU blocks (Keras, fused batch norm) and a dense layer."""
  layers = tf.keras.layers
  blocks = []
  for filters in (16, 32, 64):
    blocks += [
        layers.Conv2D(filters, 3, strides=2, padding="same", use_bias=False),
        layers.BatchNormalization(),
        layers.ReLU()
    ]
  model = tf.keras.Sequential(
      [tf.keras.Input(_IMAGE)] + blocks +
      [layers.GlobalAveragePooling2D(),
       layers.Dense(_CLASSES)])
  del training
  return model


def _model(quick: bool):
  if quick:
    return _small_cnn(True)
  return tf.keras.applications.ResNet50(
      weights=None,
      input_shape=_IMAGE,
      classes=_CLASSES,
      classifier_activation=None)


def model_fn(features, labels, mode, params):
  """The benchmark's model_fn (params: 'quick')."""
  training = mode == tf.estimator.ModeKeys.TRAIN
  logits = _model(params["quick"])(features["x"], training=training)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.MomentumOptimizer(0.01, 0.9))
  update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(update_ops):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _dataset():
  rng = np.random.RandomState(0)
  x = rng.rand(FLAGS.batch_size, *_IMAGE).astype(np.float32)
  y = rng.randint(0, _CLASSES, FLAGS.batch_size).astype(np.int32)
  return tf.data.Dataset.from_tensors(({"x": x}, y)).repeat()


def _devices(n: int) -> List[str]:
  return [f"/device:CPU:{i}" for i in range(n)]


def _config(n: int, strategy=None) -> tf.estimator.RunConfig:
  return tf.estimator.RunConfig(
      session_config=tf.compat.v1.ConfigProto(device_count={"CPU": n}),
      train_distribute=strategy,
      save_checkpoints_steps=None,
      save_checkpoints_secs=None,
      save_summary_steps=None,
      log_step_count_steps=None)


def _wrapped(variant: str, n: int) -> Tuple[Callable, Dict[str, Any]]:
  if variant == "plain":
    return model_fn, {}
  fn = replicate.replicate_model_fn(
      model_fn, devices=_devices(n), sync_batch_norm=variant == "sync")
  return fn, {"config": _config(n)}


def build_model_fn(variant: str, n: int) -> Tuple[float, int]:
  """Seconds of the model_fn call and the ops it added."""
  fn, extra = _wrapped(variant, n)
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.set_random_seed(0)
    tf.compat.v1.train.get_or_create_global_step()
    features, labels = tf.compat.v1.data.make_one_shot_iterator(
        _dataset()).get_next()
    existing = len(graph.get_operations())
    started = time.perf_counter()
    fn(features, labels, tf.estimator.ModeKeys.TRAIN, {"quick": FLAGS.quick},
       **extra)
    seconds = time.perf_counter() - started
    ops = len(graph.get_operations()) - existing
  tf.keras.backend.clear_session()
  return seconds, ops


class _Built(Exception):
  """Raised by the hook's begin(): the graph is built, no session needed."""


class _StopAtBegin(tf.compat.v1.train.SessionRunHook):

  def __init__(self, started: float):
    self._started = started
    self.seconds = None
    self.ops = None

  def begin(self):
    self.seconds = time.perf_counter() - self._started
    self.ops = len(tf.compat.v1.get_default_graph().get_operations())
    raise _Built()


def build_estimator(variant: str, n: int) -> Tuple[float, int]:
  """Seconds from Estimator.train to the graph being built, and its ops."""
  if variant == "mirrored":
    fn = model_fn
    config = _config(n, tf.distribute.MirroredStrategy(_devices(n)))
    per_replica = FLAGS.batch_size // n

    def input_fn():
      return _dataset().unbatch().batch(per_replica, drop_remainder=True)
  else:
    fn, extra = _wrapped(variant, n)
    config = extra.get("config", _config(1))
    input_fn = _dataset
  with tempfile.TemporaryDirectory() as model_dir:
    estimator = tf.estimator.Estimator(
        fn, model_dir=model_dir, config=config, params={"quick": FLAGS.quick})
    hook = _StopAtBegin(time.perf_counter())
    try:
      estimator.train(input_fn, hooks=[hook], max_steps=1)
    except _Built:
      pass
  tf.keras.backend.clear_session()
  return hook.seconds, hook.ops


def _profile(spec: str):
  variant, n = spec.split(":")
  build_model_fn(variant, int(n))  # warm-up
  profiler = cProfile.Profile()
  profiler.enable()
  seconds, ops = build_model_fn(variant, int(n))
  profiler.disable()
  print(f"{variant} N={n}: {seconds:.1f} s, {ops} ops")
  stats = pstats.Stats(profiler).sort_stats("cumulative")
  stats.print_stats(
      r"replicate|gradients_util|ops\.py|base_layer|"
      r"batch_normalization|nn_impl", 45)
  stats.sort_stats("tottime").print_stats(25)


def _runs(towers: List[int]) -> List[Tuple[str, str, int]]:
  runs = []
  if "model_fn" in FLAGS.measures:
    runs.append(("model_fn", "plain", 1))
    for n in towers:
      runs += [
          ("model_fn", v, n) for v in ("sync", "unsync") if v in FLAGS.variants
      ]
  if "estimator" in FLAGS.measures:
    runs.append(("estimator", "plain", 1))
    for n in towers:
      runs += [("estimator", v, n)
               for v in ("sync", "mirrored")
               if v in FLAGS.variants]
  return runs


def measure(towers: List[int]) -> Dict[str, Any]:
  """Every run's median seconds, ops, and ratios to plain's."""
  build = {"model_fn": build_model_fn, "estimator": build_estimator}
  runs = _runs(towers)
  build_model_fn("plain", 1)  # untimed: first-use costs
  seconds = {r: [] for r in runs}
  ops = {}
  for _ in range(FLAGS.repeats):
    for run in runs:
      s, ops[run] = build[run[0]](run[1], run[2])
      seconds[run].append(s)
  rows = []
  for run in runs:
    plain = (run[0], "plain", 1)
    ratios = [a / b for a, b in zip(seconds[run], seconds[plain])]
    rows.append({
        "measure": run[0],
        "variant": run[1],
        "towers": run[2],
        "build_s": statistics.median(seconds[run]),
        "build_s_all": seconds[run],
        "x_plain_s": statistics.median(ratios),
        "x_plain_s_range": [min(ratios), max(ratios)],
        "ops": ops[run],
        "x_plain_ops": ops[run] / ops[plain]
    })
  return {
      "model": "small_cnn" if FLAGS.quick else "resnet50",
      "batch_size": FLAGS.batch_size,
      "repeats": FLAGS.repeats,
      "library": os.path.dirname(os.path.abspath(replicate.__file__)),
      "load_average": os.getloadavg(),
      "rows": rows
  }


def table(result: Dict[str, Any]) -> str:
  lines = [
      "| measure | variant | N | build s | x plain (range) | ops | "
      "x plain ops | x unsync s | x unsync ops |",
      "|---|---|---:|---:|---|---:|---:|---:|---:|"
  ]
  by_key = {
      (r["measure"], r["variant"], r["towers"]): r for r in result["rows"]
  }
  for r in result["rows"]:
    un = by_key.get((r["measure"], "unsync", r["towers"]))
    vs = (f"{r['build_s'] / un['build_s']:.2f} | {r['ops'] / un['ops']:.2f}"
          if un and r["variant"] == "sync" else "– | –")
    lo, hi = r["x_plain_s_range"]
    lines.append(
        f"| {r['measure']} | {r['variant']} | {r['towers']} | "
        f"{r['build_s']:.2f} | {r['x_plain_s']:.2f} ({lo:.2f}–{hi:.2f}) | "
        f"{r['ops']:,} | {r['x_plain_ops']:.2f} | {vs} |")
  return "\n".join(lines)


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)
  towers = sorted({int(n) for n in FLAGS.towers})
  if FLAGS.profile:
    towers = [int(FLAGS.profile.split(":")[1])]
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * max(towers + [2]))
  if FLAGS.profile:
    _profile(FLAGS.profile)
    return
  result = measure(towers)
  print(table(result))
  common.write_json(result, FLAGS.result_file or os.devnull)


if __name__ == "__main__":
  app.run(main)
