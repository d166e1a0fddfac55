"""One benchmark run in its own process: one variant, workload and tower count.

Started by `benchmarks/run.py`; writes one JSON record to --result_file.
TensorFlow is configured (virtual CPU devices) before it initialises, which
is why every run needs a fresh process.

Variants:
  plain                  the unwrapped model_fn on one device
  mirrored               Estimator + RunConfig(train_distribute=
                         tf.distribute.MirroredStrategy(devices))
  replicate_shared       replicate.replicate_model_fn(..., SHARED)
  replicate_round_robin  replicate.replicate_model_fn(..., ROUND_ROBIN)
"""

import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np
import tensorflow as tf
from tensorflow.python.client import timeline

import common
import replicate
import workloads

VARIANTS = common.VARIANTS
LOSS_COLLECTION = "benchmark_losses"
_NEVER = 10**9  # steps: no checkpoints, summaries or step logs while timing

FLAGS = flags.FLAGS
flags.DEFINE_enum("variant", "plain", VARIANTS, "What to run.")
flags.DEFINE_enum("workload", "mlp", workloads.WORKLOADS, "Model.")
flags.DEFINE_integer("towers", 1, "Number of devices N.", lower_bound=1)
flags.DEFINE_enum("device_type", "CPU", ["CPU", "GPU"],
                  "CPU: N virtual CPU devices; GPU: the first N GPUs.")
common.define_timing_flags()
flags.DEFINE_integer("trace_steps", 0,
                     "Extra FULL_TRACE steps after the windows (profiling).",
                     lower_bound=0)
flags.DEFINE_string("trace_dir", None, "Where traced steps' StepStats go.")
flags.DEFINE_integer("seed", 0, "Seed of the data and the initial weights.")
flags.DEFINE_float("learning_rate", 0.01, "Momentum optimizer rate.")
flags.DEFINE_float("momentum", 0.9, "Momentum.")
flags.DEFINE_integer("inter_op_threads", 0, "0: TensorFlow's default.")
flags.DEFINE_integer("intra_op_threads", 0, "0: TensorFlow's default.")
flags.DEFINE_string("result_file", None, "Where the JSON record goes.")
flags.DEFINE_bool("fast_exit", False,
                  "Write the record and exit right after the last step, "
                  "skipping the end-of-training checkpoint and teardown.")


def device_names(device_type: str, towers: int) -> List[str]:
  """'/device:CPU:0'.. (or GPU) for N towers."""
  return [f"/device:{device_type}:{i}" for i in range(towers)]


def configure_devices(device_type: str, towers: int) -> None:
  """N logical CPU devices; must run before TensorFlow initialises."""
  if device_type == "GPU":
    for gpu in tf.config.list_physical_devices("GPU"):
      tf.config.experimental.set_memory_growth(gpu, True)
    return
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * towers)


def session_config(device_type: str, towers: int) -> tf.compat.v1.ConfigProto:
  """The same for every variant: N CPU devices (CPU runs), same threads."""
  config = tf.compat.v1.ConfigProto(
      inter_op_parallelism_threads=FLAGS.inter_op_threads,
      intra_op_parallelism_threads=FLAGS.intra_op_threads)
  if device_type == "CPU":
    config.device_count["CPU"] = towers
  else:
    config.gpu_options.allow_growth = True
  return config


def recording(model_fn):
  """Puts each call's loss in LOSS_COLLECTION (per replica for mirrored)."""

  def fn(features, labels, mode, params):
    spec = model_fn(features, labels, mode, params)
    tf.compat.v1.add_to_collection(LOSS_COLLECTION, spec.loss)
    return spec

  return fn


def build_model_fn(variant: str, devices: List[str]):
  """The workload's model_fn, replicated for the replicate variants."""
  base = workloads.model_fn
  if variant.startswith("replicate_"):
    placement = replicate.VariablePlacement(variant[len("replicate_"):])
    base = replicate.replicate_model_fn(
        base, devices=devices, variable_placement=placement)
  return recording(base)


def build_estimator(variant: str, devices: List[str], model_dir: str,
                    config: tf.compat.v1.ConfigProto) -> tf.estimator.Estimator:
  """An Estimator that never checkpoints, summarises or logs while timing."""
  strategy = (tf.distribute.MirroredStrategy(devices=devices)
              if variant == "mirrored" else None)
  run_config = tf.estimator.RunConfig(
      model_dir=model_dir, tf_random_seed=FLAGS.seed,
      save_checkpoints_steps=_NEVER, save_checkpoints_secs=None,
      save_summary_steps=_NEVER, log_step_count_steps=_NEVER,
      keep_checkpoint_max=1, session_config=config,
      train_distribute=strategy)
  params = {"workload": FLAGS.workload, "learning_rate": FLAGS.learning_rate,
            "momentum": FLAGS.momentum}
  return tf.estimator.Estimator(build_model_fn(variant, devices),
                                config=run_config, params=params)


class TimingHook(tf.estimator.SessionRunHook):
  """Times windows of steps after a warm-up; fetches the step's loss.

  Marks (wall and process CPU time) are taken in after_run at the end of
  the warm-up and of each window, so graph build, session creation, the
  first checkpoint and the end-of-training work stay outside the windows.
  """

  def __init__(self, warmup: int, window: int, windows: int, trace: int,
               on_last_step: Optional[Callable[[], None]] = None):
    self._marks_at = {warmup + 1 + k * window for k in range(windows + 1)}
    self._trace_from = warmup + 1 + windows * window + 1
    self._trace_to = self._trace_from + trace
    self.last_step = self._trace_to - 1
    self._on_last_step = on_last_step
    self.step = 0
    self.first_after_run: Optional[float] = None
    self.marks: List[tuple] = []
    self.losses: List[float] = []
    self.step_stats: List[Any] = []
    self.partition_graphs: List[Any] = []

  def begin(self):
    self._loss_tensors = tf.compat.v1.get_collection(LOSS_COLLECTION)

  def _tracing(self) -> bool:
    return self._trace_from <= self.step + 1 < self._trace_to

  def before_run(self, run_context):
    options = None
    if self._tracing():
      options = tf.compat.v1.RunOptions(
          trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
          output_partition_graphs=True)
    return tf.estimator.SessionRunArgs(self._loss_tensors, options=options)

  def after_run(self, run_context, run_values):
    now, cpu = time.perf_counter(), time.process_time()
    tracing = self._tracing()
    self.step += 1
    if self.first_after_run is None:
      self.first_after_run = now
    # Mirrored: the replicas' means of equal shards; their mean is global.
    self.losses.append(float(np.mean(run_values.results)))
    if self.step in self._marks_at:
      self.marks.append((now, cpu))
    if tracing:
      self.step_stats.append(run_values.run_metadata.step_stats)
      self.partition_graphs = list(run_values.run_metadata.partition_graphs)
    if self.step == self.last_step and self._on_last_step:
      self._on_last_step()


def summarise(hook: TimingHook, t_train: float, batch: int,
              window: int) -> Dict[str, Any]:
  """The run's figures from the hook's marks."""
  walls = [b[0] - a[0] for a, b in zip(hook.marks, hook.marks[1:])]
  rates = [window * batch / w for w in walls]
  cpu = hook.marks[-1][1] - hook.marks[0][1]
  wall = hook.marks[-1][0] - hook.marks[0][0]
  examples = window * batch * len(walls)
  final_step = len(hook.losses) - len(hook.step_stats)
  return {
      "examples_per_sec": statistics.median(rates),
      "window_examples_per_sec": rates,
      "build_s": hook.first_after_run - t_train,
      "cpu_s_per_example": cpu / examples,
      "cores_used": cpu / wall,
      "first_loss": hook.losses[0],
      "final_loss": hook.losses[final_step - 1],
      "steps": final_step,
      "peak_rss_mib": resource.getrusage(
          resource.RUSAGE_SELF).ru_maxrss / 1024.0,
  }


def write_traces(hook: TimingHook, trace_dir: str, name: str) -> List[str]:
  """Each traced step's StepStats (binary proto) and Chrome trace JSON."""
  os.makedirs(trace_dir, exist_ok=True)
  paths = []
  for i, stats in enumerate(hook.step_stats):
    base = os.path.join(trace_dir, f"{name}_step{i}")
    with open(base + ".stepstats.pb", "wb") as f:
      f.write(stats.SerializeToString())
    with open(base + ".trace.json", "w") as f:
      f.write(timeline.Timeline(stats).generate_chrome_trace_format())
    paths.append(base)
  for i, graph in enumerate(hook.partition_graphs):
    with open(os.path.join(trace_dir, f"{name}_partition{i}.pb"), "wb") as f:
      f.write(graph.SerializeToString())
  return paths


class Run:
  """One configured training run and its record."""

  def __init__(self):
    towers, kind = FLAGS.towers, FLAGS.device_type
    if FLAGS.batch_size % towers:
      raise ValueError(f"--batch_size={FLAGS.batch_size} must divide by "
                       f"--towers={towers}.")
    configure_devices(kind, towers)
    self.devices = device_names(kind, towers)
    self.model_dir = tempfile.mkdtemp(prefix="replicate_bench_")
    self.hook = TimingHook(FLAGS.warmup_steps, FLAGS.window_steps,
                           FLAGS.windows, FLAGS.trace_steps,
                           self._exit if FLAGS.fast_exit else None)
    self.t_train = None

  def record(self) -> Dict[str, Any]:
    record = {"variant": FLAGS.variant, "workload": FLAGS.workload,
              "towers": FLAGS.towers, "device_type": FLAGS.device_type,
              "devices": self.devices, "batch_size": FLAGS.batch_size}
    record.update(summarise(self.hook, self.t_train, FLAGS.batch_size,
                            FLAGS.window_steps))
    if FLAGS.trace_steps and FLAGS.trace_dir:
      name = f"{FLAGS.workload}_{FLAGS.variant}_n{FLAGS.towers}"
      record["traces"] = write_traces(self.hook, FLAGS.trace_dir, name)
    return record

  def _exit(self):
    """--fast_exit: record now, skip the checkpoint and the teardown."""
    write_record(self.record())
    shutil.rmtree(self.model_dir, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pylint: disable=protected-access

  def train(self) -> Dict[str, Any]:
    """Trains; returns the record (with the time train() took to return)."""
    data = workloads.synthetic_data(FLAGS.examples, FLAGS.seed)
    element = FLAGS.batch_size // (
        FLAGS.towers if FLAGS.variant == "mirrored" else 1)
    steps = self.hook.last_step
    try:
      estimator = build_estimator(FLAGS.variant, self.devices, self.model_dir,
                                  session_config(FLAGS.device_type,
                                                 FLAGS.towers))
      self.t_train = time.perf_counter()
      estimator.train(workloads.input_fn(data, element), hooks=[self.hook],
                      steps=steps)
      t_return = time.perf_counter()
    finally:
      shutil.rmtree(self.model_dir, ignore_errors=True)
    record = self.record()
    record["return_after_last_step_s"] = t_return - self.hook.marks[-1][0]
    return record


def write_record(record: Dict[str, Any]) -> None:
  """To --result_file, or stdout."""
  text = json.dumps(record, indent=1)
  if FLAGS.result_file:
    with open(FLAGS.result_file, "w") as f:
      f.write(text)
  else:
    print(text)


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  write_record(Run().train())


if __name__ == "__main__":
  app.run(main)
