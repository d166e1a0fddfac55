r"""Bytes per trainer per step on a localhost cluster of trainers only.

Starts W trainer processes (a `chief` and W-1 `worker` tasks, no `ps`),
each with its own `TF_CONFIG`, that train the MLP 784-512-512-10 (float32,
P = 2.68 MB of parameters) replicated over `--towers` virtual CPU devices
with `tf.estimator.train_and_evaluate`: replicate all-reduces the
gradients among them (TensorFlow's ring collectives). Each trainer counts
the bytes its TCP connections to the other trainers sent and received
(the kernel's `bytes_sent` / `bytes_received` of each socket, from `ss`),
between step `--warmup` and step `--warmup + --steps`: what crosses the
network, gRPC framing included; its connections to itself (the session's
master) are left out. Reported per trainer per step and as a multiple of
the ring minimum 2(W-1)/W x P, with the seconds per step. `--modes=ps`
runs the same trainers with a ps task (asynchronous, Estimator's default)
against P each way.

  PYTHONPATH=. .venv/bin/python benchmarks/trainers_traffic.py --trainers=2,3
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import common

FLAGS = flags.FLAGS
flags.DEFINE_list("trainers", ["2", "3"], "Trainer counts W.")
flags.DEFINE_list(
    "modes", ["allreduce"], "allreduce: trainers only; ps: the same "
    "trainers and one ps task (asynchronous, Estimator's default), for "
    "the step time and bytes against it.")
flags.DEFINE_integer("towers", 2, "Virtual CPU towers per trainer.")
flags.DEFINE_integer("batch_size", 32, "Rows per trainer per step.")
flags.DEFINE_integer("warmup", 3, "Steps before the counted ones.")
flags.DEFINE_integer("steps", 10, "Steps counted.")
flags.DEFINE_integer("timeout", 300, "Seconds a cluster may take.")
flags.DEFINE_string("result_file", None, "Where the JSON goes (else stdout).")
flags.DEFINE_string("task_out", None, "Internal: run one trainer, report here.")

_SIZES = [784, 512, 512, 10]
# The MLP's parameters, float32: kernels and biases.
PARAMETER_BYTES = 4 * sum(a * b + b for a, b in zip(_SIZES, _SIZES[1:]))

_SOCKET = re.compile(r"^\S+\s+\d+\s+\d+\s+(\S+)\s+(\S+)\s+.*pid=(\d+),")
_COUNT = re.compile(r"\b(bytes_sent|bytes_received):(\d+)")


def _endpoint(text: str) -> str:
  """'[::ffff:127.0.0.1]:41387' or '127.0.0.1:41387' as '127.0.0.1:41387'."""
  return text.replace("[::ffff:", "").replace("]", "")


def peer_bytes(pid: int) -> Tuple[int, int]:
  """(sent, received) bytes of the TCP sockets of process `pid` whose peer
  is another process."""
  lines = subprocess.run(["ss", "-tinpH"],
                         capture_output=True,
                         text=True,
                         check=True).stdout.splitlines()
  sockets = []
  for head, info in zip(lines, lines[1:]):
    match = _SOCKET.match(head)
    if match is None or int(match.group(3)) != pid:
      continue
    counts = dict((k, int(v)) for k, v in _COUNT.findall(info))
    sockets.append((_endpoint(match.group(1)), _endpoint(match.group(2)),
                    counts.get("bytes_sent",
                               0), counts.get("bytes_received", 0)))
  own = {local for local, _, _, _ in sockets}
  sent = sum(s for _, peer, s, _ in sockets if peer not in own)
  received = sum(r for _, peer, _, r in sockets if peer not in own)
  return sent, received


def _run_trainer(out: str) -> None:
  """One trainer: train, count its bytes between the warm-up and the end."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import tensorflow as tf

  import replicate
  from replicate import testing

  testing.virtual_cpus(FLAGS.towers)
  tf_config = json.loads(os.environ["TF_CONFIG"])
  task = tf_config["task"]
  asynchronous = "ps" in tf_config["cluster"]
  if task["type"] == "ps":
    tf.distribute.Server(
        tf.train.ClusterSpec(tf_config["cluster"]), job_name="ps",
        task_index=0).join()
    return

  def model_fn(features, labels, mode):
    x = features["x"]
    for i, units in enumerate(_SIZES[1:]):
      x = tf.compat.v1.layers.dense(
          x,
          units,
          activation=tf.nn.relu if i < len(_SIZES) - 2 else None,
          kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=i),
          name=f"dense{i}")
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=x))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(
        loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  rng = np.random.RandomState(0)
  images = rng.uniform(size=(FLAGS.batch_size, _SIZES[0])).astype(np.float32)
  labels = rng.randint(0, _SIZES[-1], size=FLAGS.batch_size)

  def input_fn():
    return tf.data.Dataset.from_tensors(({"x": images}, labels)).repeat()

  class Count(tf.estimator.SessionRunHook):

    def __init__(self):
      self._step = 0
      self._start = None

    def after_run(self, run_context, run_values):
      self._step += 1
      if self._step == FLAGS.warmup:
        self._start = (peer_bytes(os.getpid()), time.perf_counter())
      elif self._step == FLAGS.warmup + FLAGS.steps:
        if asynchronous:
          # The global step counts every trainer's steps: this one's end.
          run_context.request_stop()
        (sent0, received0), start = self._start
        sent, received = peer_bytes(os.getpid())
        with open(out, "w") as f:
          json.dump(
              {
                  "task": f"{task['type']}:{task['index']}",
                  "sent": (sent - sent0) / FLAGS.steps,
                  "received": (received - received0) / FLAGS.steps,
                  "secs_per_step": (time.perf_counter() - start) / FLAGS.steps
              }, f)

  session_config = testing.session_config(FLAGS.towers)
  session_config.device_filters.extend(
      ["/job:ps", f"/job:{task['type']}/task:{task['index']}"])
  config = tf.estimator.RunConfig(
      model_dir=os.path.join(os.path.dirname(out), "model"),
      save_checkpoints_steps=100000,
      save_summary_steps=100000,
      log_step_count_steps=None,
      session_config=session_config)
  devices = [f"/device:CPU:{i}" for i in range(FLAGS.towers)]
  estimator = tf.estimator.Estimator(
      replicate.replicate_model_fn(model_fn, devices=devices), config=config)
  tf.estimator.train_and_evaluate(
      estimator,
      tf.estimator.TrainSpec(
          input_fn,
          max_steps=(10**9 if asynchronous else FLAGS.warmup + FLAGS.steps + 1),
          hooks=[Count()]), tf.estimator.EvalSpec(input_fn, steps=1))


def _start_ps(cluster: Dict[str, List[str]]) -> subprocess.Popen:
  """The ps task (it serves until it is ended)."""
  tf_config = {"cluster": cluster, "task": {"type": "ps", "index": 0}}
  return subprocess.Popen(
      [sys.executable, __file__, "--task_out=ps"] +
      [a for a in sys.argv[1:] if not a.startswith("--task_out")],
      env=dict(os.environ, TF_CONFIG=json.dumps(tf_config)),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)


def measure(trainers: int, mode: str = "allreduce") -> Dict[str, object]:
  """One cluster of `trainers` trainers (and a ps in mode `ps`): each
  trainer's bytes per step."""
  ports = common.free_ports(trainers + 1)
  cluster = {
      "chief": [f"localhost:{ports[0]}"],
      "worker": [f"localhost:{p}" for p in ports[1:trainers]]
  }
  if mode == "ps":
    cluster["ps"] = [f"localhost:{ports[trainers]}"]
  ps = _start_ps(cluster) if mode == "ps" else None
  with tempfile.TemporaryDirectory() as folder:
    processes, outs = [], []
    for rank in range(trainers):
      task = ({
          "type": "chief",
          "index": 0
      } if rank == 0 else {
          "type": "worker",
          "index": rank - 1
      })
      outs.append(os.path.join(folder, f"trainer{rank}.json"))
      env = dict(
          os.environ, TF_CONFIG=json.dumps({
              "cluster": cluster,
              "task": task
          }))
      processes.append(
          subprocess.Popen(
              [sys.executable, __file__, f"--task_out={outs[-1]}"] +
              [a for a in sys.argv[1:] if not a.startswith("--task_out")],
              env=env,
              stdout=subprocess.DEVNULL,
              stderr=subprocess.PIPE,
              text=True))
    try:
      errors = [p.communicate(timeout=FLAGS.timeout)[1] for p in processes]
    finally:
      for p in processes + ([ps] if ps else []):
        if p.poll() is None:
          p.kill()
          p.wait()
    if any(p.returncode for p in processes):
      raise RuntimeError("a trainer failed:\n" +
                         "\n".join(e[-3000:] for e in errors))
    results = []
    for out in outs:
      with open(out) as f:
        results.append(json.load(f))
  # A ps trainer reads every variable and sends every gradient: P each way.
  minimum = (
      PARAMETER_BYTES if mode == "ps" else 2 * (trainers - 1) / trainers *
      PARAMETER_BYTES)
  return {
      "mode":
          mode,
      "trainers":
          trainers,
      "parameter_bytes":
          PARAMETER_BYTES,
      "minimum_bytes":
          minimum,
      "per_trainer": [
          dict(
              r,
              sent_ratio=r["sent"] / minimum,
              received_ratio=r["received"] / minimum) for r in results
      ]
  }


def main(argv: List[str]) -> None:
  del argv  # Unused.
  if FLAGS.task_out:
    _run_trainer(FLAGS.task_out)
    return
  results = [
      measure(int(w), mode) for mode in FLAGS.modes for w in FLAGS.trainers
  ]
  for result in results:
    minimum = "P" if result["mode"] == "ps" else "2(W-1)/W*P"
    for r in result["per_trainer"]:
      print(f"{result['mode']:9s} W={result['trainers']} {r['task']:9s} "
            f"sent {r['sent'] / 1e6:.3f} MB/step ({r['sent_ratio']:.3f}x "
            f"{minimum}), received {r['received'] / 1e6:.3f} MB/step "
            f"({r['received_ratio']:.3f}x), {r['secs_per_step'] * 1e3:.0f} "
            "ms/step")
  text = json.dumps(results, indent=1)
  if FLAGS.result_file:
    with open(FLAGS.result_file, "w") as f:
      f.write(text)
  else:
    print(text)


if __name__ == "__main__":
  app.run(main)
