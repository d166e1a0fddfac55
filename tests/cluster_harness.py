"""Real localhost clusters for the tests: one process per task, killable.

Each task runs `examples/cluster.py --task` (the example's per-machine
command) with its own TF_CONFIG, in its own process group, its output in a
log file per start. `Cluster` is a context manager that ends every process
group it started, whatever the test did; every task also ends itself after
`--timeout`.
"""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# The example's modules without flags (digits_lib, cluster_task) import as
# top-level modules, as in the example itself.
if str(EXAMPLES) not in sys.path:
  sys.path.insert(0, str(EXAMPLES))
CLUSTER = EXAMPLES / "cluster.py"
TASK_TIMEOUT_SECS = 150
_POLL_SECS = 0.1


def example_env(tf_config: Optional[dict] = None) -> Dict[str, str]:
  """The test's environment, importing this checkout's replicate."""
  env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  env.pop("TF_CONFIG", None)
  if tf_config is not None:
    env["TF_CONFIG"] = json.dumps(tf_config)
  return env


def free_ports(count: int) -> List[int]:
  sockets = [socket.socket() for _ in range(count)]
  try:
    for s in sockets:
      s.bind(("localhost", 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


class Task:
  """One task's process: started, killed (SIGKILL) and restarted at will."""

  def __init__(self, label: str, args: List[str], env: Dict[str, str],
               log_dir: pathlib.Path):
    self.label = label
    self._args, self._env, self._log_dir = args, env, log_dir
    self.starts = 0
    self.process: Optional[subprocess.Popen] = None

  def _log(self, start: int) -> pathlib.Path:
    return self._log_dir / f"{self.label}.{start}.log"

  def start(self) -> "Task":
    self.starts += 1
    with open(self._log(self.starts), "w") as log:
      self.process = subprocess.Popen(
          self._args,
          env=self._env,
          cwd=ROOT,
          stdout=log,
          stderr=subprocess.STDOUT,
          start_new_session=True)
    return self

  def kill(self) -> None:
    """SIGKILL to the task's process group; waits until it is gone."""
    if self.process is not None and self.process.poll() is None:
      try:
        os.killpg(self.process.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if self.process is not None:
      self.process.wait()

  def pause(self) -> None:
    """SIGSTOP: the task stops where it is (its server too) until resumed."""
    os.killpg(self.process.pid, signal.SIGSTOP)

  def resume(self) -> None:
    os.killpg(self.process.pid, signal.SIGCONT)

  def output(self, start: Optional[int] = None) -> str:
    """The output of one start (default: the latest)."""
    path = self._log(start or self.starts)
    return path.read_text(errors="replace") if path.exists() else ""

  def outputs(self) -> str:
    return "\n".join(f"--- {self.label}, start {i}:\n{self.output(i)}"
                     for i in range(1, self.starts + 1))

  def wait_for(self,
               pattern: str,
               timeout_secs: float,
               count: int = 1) -> List[re.Match]:
    """Waits until the latest start's output has `count` matches."""
    deadline = time.monotonic() + timeout_secs
    while True:
      matches = list(re.finditer(pattern, self.output()))
      if len(matches) >= count:
        return matches
      if self.process.poll() is not None or time.monotonic() > deadline:
        state = ("exited with status "
                 f"{self.process.returncode}"
                 if self.process.poll() is not None else "timed out")
        raise AssertionError(
            f"{self.label} {state} before printing {pattern!r} {count} "
            f"time(s):\n{self.outputs()}")
      time.sleep(_POLL_SECS)

  def wait_exit(self, timeout_secs: float) -> int:
    try:
      return self.process.wait(timeout_secs)
    except subprocess.TimeoutExpired:
      raise AssertionError(f"{self.label} still running after "
                           f"{timeout_secs} s:\n{self.outputs()}") from None


class Cluster:
  """ps, chief and workers on localhost ports, each a `cluster.py --task`.

  Args:
    log_dir: where the task logs go; the model_dir is `log_dir/model`.
    ps: parameter-server tasks.
    workers: worker tasks besides the chief.
    evaluator: add an evaluator task.
    flags: more `cluster.py` flags, e.g. steps=40.
  """

  def __init__(self,
               log_dir: pathlib.Path,
               ps: int = 1,
               workers: int = 1,
               evaluator: bool = False,
               **flags):
    self.model_dir = log_dir / "model"
    ports = iter(free_ports(ps + 1 + workers))
    self.spec = {
        "chief": [f"localhost:{next(ports)}"],
        "ps": [f"localhost:{next(ports)}" for _ in range(ps)]
    }
    if workers:
      self.spec["worker"] = [f"localhost:{next(ports)}" for _ in range(workers)]
    flags = dict(
        dict(timeout=TASK_TIMEOUT_SECS, towers=2),
        **flags,
        model_dir=self.model_dir)
    args = [sys.executable, str(CLUSTER), "--task"
           ] + [f"--{k}={v}" for k, v in flags.items()]
    jobs = [(job, i)
            for job in ("ps", "chief", "worker")
            for i in range(len(self.spec.get(job, [])))]
    jobs += [("evaluator", 0)] if evaluator else []
    self.tasks = {}
    for job, index in jobs:
      label = job if job in ("chief", "evaluator") else f"{job}{index}"
      env = example_env({
          "cluster": self.spec,
          "task": {
              "type": job,
              "index": index
          }
      })
      self.tasks[label] = Task(label, args, env, log_dir)

  def __getitem__(self, label: str) -> Task:
    return self.tasks[label]

  def start(self) -> "Cluster":
    for task in self.tasks.values():
      task.start()
    return self

  def stop(self) -> None:
    for task in self.tasks.values():
      task.kill()

  def __enter__(self) -> "Cluster":
    return self.start()

  def __exit__(self, *exc_info) -> None:
    self.stop()

  def wait_trainers(self, timeout_secs: float) -> None:
    """Waits for the chief, workers and evaluator to exit; all with 0."""
    deadline = time.monotonic() + timeout_secs
    for label, task in self.tasks.items():
      if not label.startswith("ps"):
        status = task.wait_exit(max(1.0, deadline - time.monotonic()))
        assert status == 0, f"{label} exited with {status}:\n{task.outputs()}"

  def outputs(self) -> str:
    return "\n".join(task.outputs() for task in self.tasks.values())


def checkpoint_step(path: str) -> int:
  return int(path.rsplit("-", 1)[1])


def latest_step(model_dir) -> Optional[int]:
  path = tf.train.latest_checkpoint(str(model_dir))
  return None if path is None else checkpoint_step(path)


def wait_for_checkpoint(model_dir,
                        min_step: int,
                        timeout_secs: float,
                        cluster: Optional[Cluster] = None) -> int:
  """Waits for a checkpoint at step >= min_step; returns its step."""
  deadline = time.monotonic() + timeout_secs
  while True:
    step = latest_step(model_dir)
    if step is not None and step >= min_step:
      return step
    if time.monotonic() > deadline:
      raise AssertionError(
          f"no checkpoint at step >= {min_step} in {model_dir} after "
          f"{timeout_secs} s (latest: {step})\n"
          f"{cluster.outputs() if cluster else ''}")
    time.sleep(_POLL_SECS)


def checkpoint_values(path: str) -> Dict[str, np.ndarray]:
  """Every variable of the checkpoint at `path` (a prefix), read in full."""
  reader = tf.train.load_checkpoint(path)
  return {
      name: reader.get_tensor(name)
      for name in reader.get_variable_to_shape_map()
  }


STEP_LINE = r"global step\s+\d+\s+loss"
SESSION_LINE = (r"session created at global step (\d+), variables "
                r"fingerprint ([0-9.e+-]+)")


def sessions(output: str):
  """(global step, variables fingerprint) of each session a task created."""
  return [(int(m.group(1)), float(m.group(2)))
          for m in re.finditer(SESSION_LINE, output)]


def trained_steps(output: str) -> int:
  """Steps a trainer ran, summed over its sessions' final reports."""
  return sum(
      int(m.group(1)) for m in re.finditer(r"trained (\d+) steps here", output))


def run_launcher(args: List[str], timeout_secs: float) -> str:
  """Runs `examples/cluster.py` (the launcher); returns its output.

  On timeout the launcher gets SIGTERM, which makes it end its children,
  then SIGKILL; the test fails.
  """
  process = subprocess.Popen(
      [sys.executable, str(CLUSTER), *args],
      env=example_env(),
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True)
  try:
    output, _ = process.communicate(timeout=timeout_secs)
  except subprocess.TimeoutExpired:
    process.terminate()
    try:
      output, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)
      output, _ = process.communicate()
    raise AssertionError(
        f"the launcher ran over {timeout_secs} s:\n{output}") from None
  assert process.returncode == 0, (
      f"the launcher exited with {process.returncode}:\n{output}")
  return output


def task_lines(output: str, label: str) -> List[Tuple[float, str]]:
  """(seconds, text) of each line the launcher printed for task `label`."""
  pattern = rf"^\[\s*{label}\s+([0-9.]+)s\] (.*)$"
  return [(float(m.group(1)), m.group(2))
          for m in re.finditer(pattern, output, re.MULTILINE)]
