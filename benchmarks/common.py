"""What run.py and profile_towers.py share: starting a worker process."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "worker.py")
# What a run does by default; replicate_shared_unsynced (SHARED with
# sync_batch_norm=False: each tower normalises with its shard's batch-norm
# statistics) only differs on batch-norm workloads, so it is asked for.
DEFAULT_VARIANTS = ("plain", "mirrored", "replicate_shared",
                    "replicate_round_robin")
VARIANTS = DEFAULT_VARIANTS + ("replicate_shared_unsynced",
                               "replicate_mirrored")


@dataclasses.dataclass
class Settings:
  """The resolved configuration of one benchmark."""
  variants: List[str]
  workloads: List[str]
  towers: List[int]
  rounds: int
  device_type: str
  fast_exit: bool
  jobs: int
  worker_flags: Dict[str, Any]
  # "runs": a process per variant; "windows": one per (round, workload, N),
  # its variants taking turns window by window.
  pairing: str = "runs"


def free_ports(count: int) -> List[int]:
  """`count` localhost ports free now, for a cluster's tasks."""
  sockets = [socket.socket() for _ in range(count)]
  try:
    for s in sockets:
      s.bind(("127.0.0.1", 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def write_json(record: Any, path: Optional[str]) -> None:
  """`record` as JSON to `path`, or to stdout when it is None."""
  text = json.dumps(record, indent=1)
  if path:
    with open(path, "w") as f:
      f.write(text)
  else:
    print(text)


def define_timing_flags() -> None:
  """Flags the driver and the worker share: batch, data and timed windows."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_integer(
      "batch_size",
      256, "Global batch (examples per step), same for all "
      "variants.",
      lower_bound=1)
  flags.DEFINE_integer(
      "examples",
      2048,
      "Synthetic examples per workload (then repeated).",
      lower_bound=1)
  flags.DEFINE_integer(
      "warmup_steps", 20, "Untimed steps after the first.", lower_bound=0)
  flags.DEFINE_integer(
      "window_steps", 20, "Steps per timed window.", lower_bound=1)
  flags.DEFINE_integer(
      "windows",
      5,
      "Timed windows per run (the median is reported).",
      lower_bound=1)
  flags.DEFINE_integer(
      "logical_gpus",
      0, "GPU runs: split the first GPU into this many logical "
      "GPUs (one card standing in for several); 0: the "
      "GPUs as they are.",
      lower_bound=0)
  flags.DEFINE_integer(
      "gpu_memory_mb",
      8192,
      "Memory of each logical GPU (--logical_gpus).",
      lower_bound=256)


def worker_env(library_root: str = ROOT) -> Dict[str, str]:
  """This environment, with `replicate` imported from `library_root`.

  The working tree's by default; compare_versions.py passes an older
  checkout's to run the same benchmark scripts against its library.
  """
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([library_root] +
                                      [p for p in [env.get("PYTHONPATH")] if p])
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


def run_worker(worker_flags: Dict[str, Any],
               result_file: str,
               timeout: Optional[float],
               library_root: str = ROOT,
               script: str = WORKER) -> Dict[str, Any]:
  """Runs `script` (worker.py) with `worker_flags`; its record, or an 'error'.

  A worker that ran several variants (--together) gives {'records': [...]}.
  `replicate` is imported from `library_root` (see worker_env).
  """
  if os.path.exists(result_file):
    os.remove(result_file)
  args: List[str] = [sys.executable, script, f"--result_file={result_file}"]
  args += [f"--{k}={v}" for k, v in worker_flags.items()]
  started = time.perf_counter()
  try:
    proc = subprocess.run(
        args,
        capture_output=True,
        text=True,
        env=worker_env(library_root),
        timeout=timeout)
    error = None if proc.returncode == 0 and os.path.exists(result_file) else (
        f"exit {proc.returncode}: {proc.stderr[-2000:]}")
  except subprocess.TimeoutExpired:
    error = f"timed out after {timeout} s"
  record: Dict[str, Any] = {}
  if error is None:
    with open(result_file) as f:
      result = json.load(f)
    # A list: one record per variant of a --together process.
    record.update({"records": result} if isinstance(result, list) else result)
  else:
    record["error"] = error
  record["process_wall_s"] = time.perf_counter() - started
  return record


def count_gpus(logical_gpus: int = 0) -> int:
  """GPUs the runs will have, asked in a subprocess (no TF in the caller).

  With `logical_gpus`, the first GPU split that many ways (none without a
  GPU).
  """
  code = ("import tensorflow as tf; "
          "print(len(tf.config.list_physical_devices('GPU')))")
  out = subprocess.run([sys.executable, "-c", code],
                       capture_output=True,
                       text=True,
                       env=worker_env(),
                       check=True).stdout
  physical = int(out.strip().splitlines()[-1])
  return logical_gpus if logical_gpus and physical else physical


def configure_gpus(logical_gpus: int, memory_mb: int) -> None:
  """Before TensorFlow initialises: the first GPU split `logical_gpus` ways
  (`memory_mb` each), or every GPU growing its memory as needed (0)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = tf.config.list_physical_devices("GPU")
  if logical_gpus and gpus:
    tf.config.set_visible_devices(gpus[:1], "GPU")
    tf.config.set_logical_device_configuration(
        gpus[0],
        [tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb)] *
        logical_gpus)
    return
  for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
