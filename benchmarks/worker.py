"""One benchmark run in its own process: one variant, workload and tower count.

Started by `benchmarks/run.py`; writes one JSON record to --result_file.
TensorFlow is configured (virtual CPU devices) before it initialises, which
is why every tower count needs a fresh process.

With --together, several variants train in this one process, each in its
own thread, taking turns window by window (one runs at a time): their
windows are then seconds apart, so ratios between them hold on a machine
whose speed drifts; --result_file gets a list of records.

Variants:
  plain                  the unwrapped model_fn on one device
  mirrored               Estimator + RunConfig(train_distribute=
                         tf.distribute.MirroredStrategy(devices))
  replicate_shared       replicate.replicate_model_fn(..., SHARED)
  replicate_round_robin  replicate.replicate_model_fn(..., ROUND_ROBIN)
  replicate_mirrored     replicate.replicate_model_fn(..., MIRRORED)
  replicate_shared_unsynced
                         replicate.replicate_model_fn(..., SHARED,
                         sync_batch_norm=False): per-tower batch-norm
                         statistics (the default, True, uses the batch's)
"""

import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import common
import numpy as np
import tensorflow as tf
from tensorflow.python.client import timeline
import workloads

import replicate

VARIANTS = common.VARIANTS
LOSS_COLLECTION = "benchmark_losses"
_NEVER = 10**9  # steps: no checkpoints, summaries or step logs while timing

FLAGS = flags.FLAGS
flags.DEFINE_enum("variant", "plain", VARIANTS, "What to run.")
flags.DEFINE_list(
    "together", [], "Variants to run in this process, taking turns window by "
    "window (overrides --variant; no tracing).")
flags.DEFINE_enum("workload", "mlp", workloads.WORKLOADS, "Model.")
flags.DEFINE_integer("towers", 1, "Number of devices N.", lower_bound=1)
flags.DEFINE_enum("device_type", "CPU", ["CPU", "GPU"],
                  "CPU: N virtual CPU devices; GPU: the first N GPUs.")
common.define_timing_flags()
flags.DEFINE_integer(
    "trace_steps",
    0,
    "Extra FULL_TRACE steps after the windows (profiling).",
    lower_bound=0)
flags.DEFINE_string("trace_dir", None, "Where traced steps' StepStats go.")
flags.DEFINE_integer("seed", 0, "Seed of the data and the initial weights.")
flags.DEFINE_float("learning_rate", 0.01, "Momentum optimizer rate.")
flags.DEFINE_float("momentum", 0.9, "Momentum.")
flags.DEFINE_integer("inter_op_threads", 0, "0: TensorFlow's default.")
flags.DEFINE_integer("intra_op_threads", 0, "0: TensorFlow's default.")
flags.DEFINE_string("result_file", None, "Where the JSON record goes.")
flags.DEFINE_bool(
    "fast_exit", False, "Write the record and exit right after the last step, "
    "skipping the end-of-training checkpoint and teardown.")


def device_names(device_type: str, towers: int) -> List[str]:
  """'/device:CPU:0'.. (or GPU) for N towers."""
  return [f"/device:{device_type}:{i}" for i in range(towers)]


def configure_devices(device_type: str, towers: int) -> None:
  """N logical CPU devices (or the GPUs' set-up); before TF initialises."""
  if device_type == "GPU":
    common.configure_gpus(FLAGS.logical_gpus, FLAGS.gpu_memory_mb)
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
    return config
  if not FLAGS.logical_gpus:
    config.gpu_options.allow_growth = True
  # A v1 session makes its own devices: this one repeats the logical GPU
  # split that common.configure_gpus made with tf.config.
  return replicate.testing.session_config(1, config)


def recording(model_fn):
  """Puts each call's loss in LOSS_COLLECTION (per replica for mirrored)."""

  def fn(features, labels, mode, params):
    spec = model_fn(features, labels, mode, params)
    tf.compat.v1.add_to_collection(LOSS_COLLECTION, spec.loss)
    return spec

  return fn


def replicate_options(variant: str) -> Dict[str, Any]:
  """replicate_model_fn's keywords for 'replicate_<placement>[_unsynced]'.

  sync_batch_norm is passed only when False, so that the variants without
  '_unsynced' also run against libraries older than the keyword (the
  before/after comparison of benchmarks/compare_versions.py).
  """
  name = variant[len("replicate_"):]
  options: Dict[str, Any] = {}
  if name.endswith("_unsynced"):
    name = name[:-len("_unsynced")]
    options["sync_batch_norm"] = False
  options["variable_placement"] = replicate.VariablePlacement(name)
  return options


def build_model_fn(variant: str, devices: List[str]):
  """The workload's model_fn, replicated for the replicate variants."""
  base = workloads.model_fn
  if variant.startswith("replicate_"):
    base = replicate.replicate_model_fn(
        base, devices=devices, **replicate_options(variant))
  return recording(base)


def build_estimator(variant: str, devices: List[str], model_dir: str,
                    config: tf.compat.v1.ConfigProto) -> tf.estimator.Estimator:
  """An Estimator that never checkpoints, summarises or logs while timing."""
  strategy = (
      tf.distribute.MirroredStrategy(
          devices=devices) if variant == "mirrored" else None)
  run_config = tf.estimator.RunConfig(
      model_dir=model_dir,
      tf_random_seed=FLAGS.seed,
      save_checkpoints_steps=_NEVER,
      save_checkpoints_secs=None,
      save_summary_steps=_NEVER,
      log_step_count_steps=_NEVER,
      keep_checkpoint_max=1,
      session_config=config,
      train_distribute=strategy)
  params = {
      "workload": FLAGS.workload,
      "learning_rate": FLAGS.learning_rate,
      "momentum": FLAGS.momentum
  }
  return tf.estimator.Estimator(
      build_model_fn(variant, devices), config=run_config, params=params)


class TimingHook(tf.estimator.SessionRunHook):
  """Times windows of steps after a warm-up; fetches the step's loss.

  Marks (wall and process CPU time) are taken in after_run at the end of
  the warm-up and of each window, so graph build, session creation, the
  first checkpoint and the end-of-training work stay outside the windows.
  """

  def __init__(self,
               warmup: int,
               window: int,
               windows: int,
               trace: int,
               on_last_step: Optional[Callable[[], None]] = None,
               on_mark: Optional[Callable[[], None]] = None):
    self._marks_at = {warmup + 1 + k * window for k in range(windows + 1)}
    self._trace_from = warmup + 1 + windows * window + 1
    self._trace_to = self._trace_from + trace
    self.last_step = self._trace_to - 1
    self._on_last_step = on_last_step
    self._on_mark = on_mark
    self.step = 0
    self.first_after_run: Optional[float] = None
    # (wall, process CPU) at the end of the warm-up and of each window, and
    # when timing resumed after each (later, if on_mark waited its turn).
    self.marks: List[tuple] = []
    self.resumes: List[tuple] = []
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
      if self._on_mark and self.step != self.last_step:
        self._on_mark()
      self.resumes.append((time.perf_counter(), time.process_time()))
    if tracing:
      self.step_stats.append(run_values.run_metadata.step_stats)
      self.partition_graphs = list(run_values.run_metadata.partition_graphs)
    if self.step == self.last_step and self._on_last_step:
      self._on_last_step()


def summarise(hook: TimingHook, t_train: float, batch: int,
              window: int) -> Dict[str, Any]:
  """The run's figures from the hook's marks."""
  windows = list(zip(hook.resumes, hook.marks[1:]))
  walls = [end[0] - start[0] for start, end in windows]
  rates = [window * batch / w for w in walls]
  cpu = sum(end[1] - start[1] for start, end in windows)
  wall = sum(walls)
  examples = window * batch * len(walls)
  final_step = len(hook.losses) - len(hook.step_stats)
  return {
      "examples_per_sec":
          statistics.median(rates),
      "window_examples_per_sec":
          rates,
      "build_s":
          hook.first_after_run - t_train,
      "cpu_s_per_example":
          cpu / examples,
      "cores_used":
          cpu / wall,
      "first_loss":
          hook.losses[0],
      "final_loss":
          hook.losses[final_step - 1],
      "steps":
          final_step,
      "peak_rss_mib":
          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
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


def _exit_now() -> None:
  """Exits at once: no end-of-training checkpoint, teardown or thread joins."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


class Baton:
  """Lets one of several threads run at a time, taking turns in order."""

  def __init__(self, names: List[str]):
    self._turns = threading.Condition()
    self._queue = list(names)  # the first one's turn

  def wait(self, name: str) -> None:
    with self._turns:
      self._turns.wait_for(lambda: self._queue[0] == name)

  def pass_on(self, name: str) -> None:
    """To the next in line; `name` queues up again at the end."""
    with self._turns:
      self._queue.remove(name)
      self._queue.append(name)
      self._turns.notify_all()

  def leave(self, name: str) -> None:
    with self._turns:
      if name in self._queue:
        self._queue.remove(name)
      self._turns.notify_all()


def _resident_mib() -> Optional[float]:
  """Current resident memory (Linux), for growth while a variant builds."""
  try:
    with open("/proc/self/statm") as f:
      pages = int(f.read().split()[1])
  except (OSError, IndexError, ValueError):
    return None
  return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class Run:
  """One configured training run of `variant` and its record.

  With a `baton` it shares the process: it builds and warms up in its turn,
  then times each window in its turn, and at its last step records and
  parks its thread (the process exits once every run has recorded).
  """

  def __init__(self,
               variant: str,
               devices: List[str],
               baton: Optional[Baton] = None):
    self.variant = variant
    self.devices = devices
    self.baton = baton
    self.model_dir = tempfile.mkdtemp(prefix="replicate_bench_")
    if baton:
      on_last_step, on_mark = self._finish, self._take_turns
    else:
      on_last_step, on_mark = (self._exit if FLAGS.fast_exit else None), None
    self.hook = TimingHook(FLAGS.warmup_steps, FLAGS.window_steps,
                           FLAGS.windows, 0 if baton else FLAGS.trace_steps,
                           on_last_step, on_mark)
    self.t_train = None
    self.rss_before = None
    self.rss_warm = None
    self.result: Optional[Dict[str, Any]] = None
    self.done = threading.Event()

  def record(self) -> Dict[str, Any]:
    record = {
        "variant": self.variant,
        "workload": FLAGS.workload,
        "towers": FLAGS.towers,
        "device_type": FLAGS.device_type,
        "devices": self.devices,
        "batch_size": FLAGS.batch_size,
        # Which checkout's library ran (compare_versions.py checks).
        "library": os.path.dirname(os.path.abspath(replicate.__file__))
    }
    record.update(
        summarise(self.hook, self.t_train, FLAGS.batch_size,
                  FLAGS.window_steps))
    if self.baton:
      # One process for all variants: its peak says nothing of one of them.
      record["pairing"] = "windows"
      record["peak_rss_mib"] = None
      if self.rss_before is not None and self.rss_warm is not None:
        record["rss_growth_mib"] = self.rss_warm - self.rss_before
    if FLAGS.trace_steps and FLAGS.trace_dir and not self.baton:
      name = f"{FLAGS.workload}_{self.variant}_n{FLAGS.towers}"
      record["traces"] = write_traces(self.hook, FLAGS.trace_dir, name)
    return record

  def _exit(self):
    """--fast_exit: record now, skip the checkpoint and the teardown."""
    write_record(self.record())
    shutil.rmtree(self.model_dir, ignore_errors=True)
    _exit_now()

  def _take_turns(self):
    if self.rss_warm is None:
      self.rss_warm = _resident_mib()
    self.baton.pass_on(self.variant)
    self.baton.wait(self.variant)

  def _finish(self):
    """Together: record, make way for the others and never return."""
    self.result = self.record()
    self.baton.leave(self.variant)
    self.done.set()
    threading.Event().wait()

  def train(self) -> Dict[str, Any]:
    """Trains; returns the record (with the time train() took to return)."""
    data = workloads.synthetic_data(FLAGS.examples, FLAGS.seed)
    element = FLAGS.batch_size // (
        FLAGS.towers if self.variant == "mirrored" else 1)
    steps = self.hook.last_step
    try:
      if self.baton:
        self.baton.wait(self.variant)
        self.rss_before = _resident_mib()
      estimator = build_estimator(
          self.variant, self.devices, self.model_dir,
          session_config(FLAGS.device_type, FLAGS.towers))
      self.t_train = time.perf_counter()
      estimator.train(
          workloads.input_fn(data, element), hooks=[self.hook], steps=steps)
      t_return = time.perf_counter()
    finally:
      shutil.rmtree(self.model_dir, ignore_errors=True)
    record = self.record()
    record["return_after_last_step_s"] = t_return - self.hook.marks[-1][0]
    return record

  def train_in_thread(self):
    """Thread target with a baton: an error is this run's record."""
    try:
      self.train()
    except Exception as error:  # pylint: disable=broad-except
      self.result = {"variant": self.variant, "error": repr(error)[-2000:]}
    finally:
      self.baton.leave(self.variant)
      self.done.set()


def run_together(variants: List[str], devices: List[str]):
  """Every variant in its own thread, taking turns; exits with the records."""
  baton = Baton(variants)
  runs = [Run(v, devices, baton) for v in variants]
  for run in runs:
    threading.Thread(target=run.train_in_thread, daemon=True).start()
  for run in runs:
    run.done.wait()
  write_record([run.result for run in runs])
  # The parked threads never reach train()'s own clean-up.
  for run in runs:
    shutil.rmtree(run.model_dir, ignore_errors=True)
  _exit_now()


def write_record(record: Any) -> None:
  """To --result_file, or stdout."""
  common.write_json(record, FLAGS.result_file)


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  towers, kind = FLAGS.towers, FLAGS.device_type
  if FLAGS.batch_size % towers:
    raise ValueError(f"--batch_size={FLAGS.batch_size} must divide by "
                     f"--towers={towers}.")
  configure_devices(kind, towers)
  devices = device_names(kind, towers)
  if FLAGS.together:
    unknown = [v for v in FLAGS.together if v not in VARIANTS]
    if unknown:
      raise ValueError(f"--together={FLAGS.together}: unknown {unknown}; "
                       f"choose from {VARIANTS}.")
    run_together(FLAGS.together, devices)
  write_record(Run(FLAGS.variant, devices).train())


if __name__ == "__main__":
  app.run(main)
