"""Trains the digits model on a TF_CONFIG cluster of separate processes.

The parameter-server runtime of TensorFlow, driven by Estimator's own
`TF_CONFIG` handling and `tf.estimator.train_and_evaluate`: `ps` tasks hold
the variables, the `chief` and the `worker`s train (each replicating the
model_fn over its own devices: its GPUs, or virtual CPU devices), and an
`evaluator` evaluates every new checkpoint.

Without `--task`, this program is the launcher: it starts the whole cluster
on this machine (localhost ports, chosen free), one process per task, prints
each task's output prefixed by its role, ends the parameter servers once
training and evaluation are done and exits non-zero if any task failed or
`--timeout` passed. Every child is ended on exit or Ctrl-C.

    python examples/cluster.py                          # ps, chief, worker,
    evaluator python examples/cluster.py --workers=2 --ps=2 --sync --steps=200
    python examples/cluster.py --ps=0 --workers=2   # trainers only: all-reduce

With `--task`, it runs the one task that the `TF_CONFIG` environment
variable names: that is the command for each machine of a real cluster
(give every machine the same `--model_dir`, on storage they share):

    TF_CONFIG='{"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"],
                "ps": ["host2:2222"]},
                "task": {"type": "worker", "index": 0}}' \\
        python examples/cluster.py --task --model_dir=/shared/digits

Without `TF_CONFIG`, `--task` trains and evaluates on this machine alone.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # pylint: disable=g-import-not-at-top,g-bad-import-order
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from absl import app
from absl import flags
from absl import logging

FLAGS = flags.FLAGS
flags.DEFINE_bool(
    "task", False, "Run the one task that TF_CONFIG names (the command for "
    "each machine); without it, launch a whole cluster here.")
flags.DEFINE_integer(
    "ps", 1, "Launcher: parameter-server tasks; 0: trainers only, "
    "synchronous by all-reduce among them.")
flags.DEFINE_integer("workers", 1,
                     "Launcher: worker tasks (besides the chief).")
flags.DEFINE_bool("evaluator", True, "Launcher: start an evaluator task.")
flags.DEFINE_float(
    "timeout", 600, "Seconds after which every task is ended and the run "
    "fails (each task also ends itself after this long).")
flags.DEFINE_integer(
    "towers", None,
    "Towers per trainer. Default: every local GPU, or 2 virtual CPU devices "
    "when there is no GPU.")
flags.DEFINE_integer("steps", 1000, "Global steps to train (all trainers).")
flags.DEFINE_integer("batch_size", 64,
                     "Batch size of each trainer, split across its towers.")
flags.DEFINE_enum("model", "mlp", ["mlp", "cnn"], "Model to train.")
flags.DEFINE_enum("optimizer", "adam", ["adam", "sgd"],
                  "Adam, or plain gradient descent.")
flags.DEFINE_float("learning_rate", 0.01, "The optimizer's learning rate.")
flags.DEFINE_float("dropout", 0.2, "Dropout rate.")
flags.DEFINE_bool(
    "sync", False, "Synchronous training: SyncReplicasOptimizer (inside "
    "TowerOptimizer) averages one gradient of every trainer "
    "per step.")
flags.DEFINE_string(
    "model_dir", None, "Checkpoint directory, shared by every task. Default: a "
    "fresh temporary one.")
flags.DEFINE_integer("save_checkpoints_steps", 100,
                     "The chief saves a checkpoint every this many steps.")
flags.DEFINE_integer("throttle_secs", 1,
                     "The evaluator evaluates at most this often (seconds).")
flags.DEFINE_integer("log_every", 100,
                     "Print the loss every this many steps of a trainer.")
flags.DEFINE_integer(
    "step_delay_ms", 0, "Each trainer sleeps this long after every step: slows "
    "training down, to watch it or to kill tasks mid-way.")

# Forwarded from the launcher to every task.
_TASK_FLAGS = ("towers", "steps", "batch_size", "model", "optimizer",
               "learning_rate", "dropout", "sync", "model_dir",
               "save_checkpoints_steps", "throttle_secs", "log_every",
               "step_delay_ms", "timeout")
_POLL_SECS = 0.2
_STOP_GRACE_SECS = 5


def _free_ports(count: int) -> List[int]:
  """`count` distinct free localhost ports."""
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket()
      s.bind(("localhost", 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def make_cluster(num_ps: int, num_workers: int) -> Dict[str, List[str]]:
  """A cluster spec of localhost addresses on free ports."""
  ports = iter(_free_ports(num_ps + 1 + num_workers))
  cluster = {"chief": [f"localhost:{next(ports)}"]}
  if num_ps:
    cluster["ps"] = [f"localhost:{next(ports)}" for _ in range(num_ps)]
  if num_workers:
    cluster["worker"] = [f"localhost:{next(ports)}" for _ in range(num_workers)]
  return cluster


def task_names(cluster: Dict[str, List[str]],
               evaluator: bool) -> List[Tuple[str, int]]:
  """(type, index) of every task: ps first, then trainers, then evaluator."""
  order = ["ps", "chief", "worker"]
  tasks = [(job, i) for job in order for i in range(len(cluster.get(job, [])))]
  return tasks + ([("evaluator", 0)] if evaluator else [])


def _label(job: str, index: int) -> str:
  return job if job in ("chief", "evaluator") else f"{job}{index}"


class _Child:
  """One task's process; prints its output line by line, then its status.

  Each line is prefixed by the task's label and the seconds since `start`.
  """

  def __init__(self, label: str, args: Sequence[str], env: Dict[str, str],
               lock: threading.Lock, start: float):
    self.label = label
    self.lines: List[str] = []
    # Its own session: Ctrl-C reaches the launcher only, which ends it.
    self.process = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True)
    self._lock, self._start = lock, start
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _print(self, text: str) -> None:
    with self._lock:
      print(
          f"[{self.label:>9} {time.monotonic() - self._start:6.1f}s] {text}",
          flush=True)

  def _read(self):
    for line in self.process.stdout:
      self.lines.append(line.rstrip("\n"))
      self._print(self.lines[-1])
    self._print(f"exited with status {self.process.wait()}")

  def stop(self):
    """Ends the process group: SIGTERM, then SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
      if self.process.poll() is not None:
        break
      try:
        os.killpg(self.process.pid, sig)
      except ProcessLookupError:
        break
      try:
        self.process.wait(_STOP_GRACE_SECS)
      except subprocess.TimeoutExpired:
        continue
    self.process.wait()
    self._reader.join(_STOP_GRACE_SECS)


def _task_args() -> List[str]:
  args = [sys.executable, os.path.abspath(__file__), "--task"]
  for name in _TASK_FLAGS:
    value = FLAGS[name].value
    if value is not None:
      args.append(f"--{name}={value}")
  return args


def _start_children(cluster, start: float) -> Dict[str, _Child]:
  lock = threading.Lock()
  children = {}
  for job, index in task_names(cluster, FLAGS.evaluator):
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        TF_CONFIG=json.dumps({
            "cluster": cluster,
            "task": {
                "type": job,
                "index": index
            }
        }))
    label = _label(job, index)
    children[label] = _Child(label, _task_args(), env, lock, start)
  return children


def _wait(children: Dict[str, _Child], timeout_secs: float) -> List[str]:
  """Waits for the trainers and the evaluator; returns what failed."""
  deadline = time.monotonic() + timeout_secs
  finishers = [c for c in children.values() if not c.label.startswith("ps")]
  while True:
    failed = [
        f"{c.label} exited with status {c.process.returncode}"
        for c in children.values()
        if c.process.poll() is not None and
        (c.process.returncode != 0 or c not in finishers)
    ]
    if failed:
      return failed
    if all(c.process.poll() is not None for c in finishers):
      return []
    if time.monotonic() > deadline:
      return [
          f"timeout: still running after {timeout_secs:.0f} s: " +
          ", ".join(c.label for c in finishers if c.process.poll() is None)
      ]
    time.sleep(_POLL_SECS)


def _last_match(lines: Sequence[str], pattern: str) -> Optional[str]:
  for line in reversed(lines):
    if re.search(pattern, line):
      return line
  return None


def launch_cluster() -> int:
  """Starts every task here, waits for them, ends them all; 0 if all ok."""
  FLAGS.model_dir = FLAGS.model_dir or tempfile.mkdtemp(prefix="cluster_")
  cluster = make_cluster(FLAGS.ps, FLAGS.workers)
  print(
      f"cluster {json.dumps(cluster)}; "
      f"{'synchronous' if FLAGS.sync or not FLAGS.ps else 'asynchronous'} "
      f"training{' (all-reduce)' if not FLAGS.ps else ''}, "
      f"{FLAGS.steps} steps; model_dir {FLAGS.model_dir}",
      flush=True)
  # SIGTERM (e.g. from a CI runner) ends the children as Ctrl-C does.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  children = {}
  start = time.monotonic()
  try:
    children = _start_children(cluster, start)
    failed = _wait(children, FLAGS.timeout)
  except KeyboardInterrupt:
    failed = ["interrupted"]
  finally:
    for child in children.values():
      child.stop()
  for label, pattern in (("evaluator", r"evaluated global step"),
                         ("chief", r"global steps/s"), ("chief",
                                                        r"test accuracy")):
    line = label in children and _last_match(children[label].lines, pattern)
    if line:
      print(f"{label}: {line}")
  if failed:
    print("cluster FAILED: " + "; ".join(failed), flush=True)
    return 1
  print(
      f"cluster finished in {time.monotonic() - start:.1f} s; "
      f"checkpoints in {FLAGS.model_dir}",
      flush=True)
  return 0


def run_task() -> int:
  """Runs the task TF_CONFIG names; 0 when it is done."""
  # Only tasks import TensorFlow: the launcher starts in a moment.
  import cluster_task  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  if not FLAGS.model_dir:
    if os.environ.get("TF_CONFIG"):
      raise app.UsageError("--model_dir is required with TF_CONFIG: every "
                           "task of the cluster needs the same directory.")
    FLAGS.model_dir = tempfile.mkdtemp(prefix="digits_")
  cluster_task.run_task(
      cluster_task.TaskOptions(
          **{name: FLAGS[name].value for name in _TASK_FLAGS}))
  return 0


def main(argv: List[str]) -> None:
  del argv  # Unused.
  if not FLAGS["verbosity"].present:  # replicate logs its towers at INFO.
    logging.set_verbosity(logging.WARNING)
  sys.exit(run_task() if FLAGS.task else launch_cluster())


if __name__ == "__main__":
  app.run(main)
