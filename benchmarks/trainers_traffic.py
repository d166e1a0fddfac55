r"""Bytes and time per trainer per step on a localhost cluster.

Starts W trainer processes (a `chief` and W-1 `worker` tasks), each with
its own `TF_CONFIG`, that train `--model` replicated over `--towers`
virtual CPU devices with `tf.estimator.train_and_evaluate`. Each trainer
counts the bytes its TCP connections to other processes sent and received
(the kernel's `bytes_sent` / `bytes_received` of each socket, from `ss`),
between step `--warmup` and step `--warmup + --steps`: what crosses the
network, gRPC framing included; its connections to itself (the session's
master) are left out. Reported per trainer per step, as a multiple of the
minimum, with the seconds per step.

Models: `mlp`, 784-512-512-10 (float32, P = 2.68 MB of parameters);
`embedding`, a 100000 x 64 table (25.6 MB) of which each row looks up 8
ids, summed into a 64-10 softmax layer: its gradient is the rows looked
up (sparse), not the table.

Modes (`--modes`):
  allreduce  trainers only (no ps): replicate all-reduces the dense
             gradients and gathers the sparse ones' rows among them
             (TensorFlow's ring collectives). Minimum per trainer, each
             way: 2(W-1)/W x P_dense + (W-1) x R, R the bytes of one
             trainer's rows (values and int64 indices).
  ps         one ps task, asynchronous (Estimator's default): P_dense + R.
  sync_ps    one ps task, SyncReplicasOptimizer averaging W gradients per
             step (the synchronous ps mode): P_dense + R.
  mwms       MultiWorkerMirroredStrategy through Estimator's distribute
             coordinator, without replicate (TensorFlow 2.15 and older
             only; one device per trainer, whatever `--towers`).

  PYTHONPATH=. .venv/bin/python benchmarks/trainers_traffic.py --trainers=2,3
  PYTHONPATH=. .venv/bin/python benchmarks/trainers_traffic.py \
      --trainers=2 --towers=1 --modes=allreduce,sync_ps,ps,mwms
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
    "modes", ["allreduce"], "allreduce (trainers only), ps (asynchronous), "
    "sync_ps (SyncReplicasOptimizer), mwms (MultiWorkerMirroredStrategy): "
    "see the module's docstring.")
flags.DEFINE_enum("model", "mlp", ["mlp", "embedding"], "What is trained.")
flags.DEFINE_integer("towers", 2, "Virtual CPU towers per trainer.")
flags.DEFINE_integer("batch_size", 32, "Rows per trainer per step.")
flags.DEFINE_integer("warmup", 3, "Steps before the counted ones.")
flags.DEFINE_integer("steps", 10, "Steps counted.")
flags.DEFINE_integer("timeout", 300, "Seconds a cluster may take.")
flags.DEFINE_string("result_file", None, "Where the JSON goes (else stdout).")
flags.DEFINE_string("task_out", None, "Internal: run one task, report here.")
flags.DEFINE_string("task_mode", None, "Internal: the task's mode.")

_SIZES = [784, 512, 512, 10]
# The embedding model: table rows, width, ids per row, classes.
_TABLE, _WIDTH, _IDS, _CLASSES = 100000, 64, 8, 10


def dense_bytes(model: str) -> int:
  """The bytes of `model`'s dense (float32) parameters, each step's whole
  gradient."""
  if model == "mlp":
    return 4 * sum(a * b + b for a, b in zip(_SIZES, _SIZES[1:]))
  return 4 * (_WIDTH * _CLASSES + _CLASSES)


def rows_bytes(model: str, batch_size: int) -> int:
  """The bytes of one trainer's sparse gradient per step: the rows its
  batch looks up, float32 values and int64 indices."""
  if model == "mlp":
    return 0
  return batch_size * _IDS * (4 * _WIDTH + 8)


def minimum_bytes(mode: str, model: str, trainers: int,
                  batch_size: int) -> float:
  """The least a trainer sends (and receives) per step in `mode`."""
  dense, rows = dense_bytes(model), rows_bytes(model, batch_size)
  if mode in ("allreduce", "mwms"):
    return 2 * (trainers - 1) / trainers * dense + (trainers - 1) * rows
  return dense + rows


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


def _run_trainer(out: str, kind: str) -> None:
  """One trainer: train, count its bytes between the warm-up and the end."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import tensorflow as tf

  import replicate
  from replicate import testing

  tf_config = json.loads(os.environ["TF_CONFIG"])
  task = tf_config["task"]
  if task["type"] == "ps":
    tf.distribute.Server(
        tf.train.ClusterSpec(tf_config["cluster"]), job_name="ps",
        task_index=0).join()
    return
  towers = 1 if kind == "mwms" else FLAGS.towers
  testing.virtual_cpus(towers)
  trainers = len(tf_config["cluster"]["chief"]) + len(tf_config["cluster"].get(
      "worker", []))

  def model_fn(features, labels, mode, config):
    if FLAGS.model == "mlp":
      x = features["x"]
      for i, units in enumerate(_SIZES[1:]):
        x = tf.compat.v1.layers.dense(
            x,
            units,
            activation=tf.nn.relu if i < len(_SIZES) - 2 else None,
            kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=i),
            name=f"dense{i}")
    else:
      table = tf.compat.v1.get_variable(
          "table", [_TABLE, _WIDTH],
          initializer=tf.compat.v1.random_uniform_initializer(seed=0))
      bags = tf.reduce_sum(tf.nn.embedding_lookup(table, features["ids"]), 1)
      x = tf.compat.v1.layers.dense(
          bags,
          _CLASSES,
          kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1),
          name="out")
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=x))
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.01)
    hooks = []
    if kind == "sync_ps":
      optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
          optimizer,
          replicas_to_aggregate=trainers,
          total_num_replicas=trainers)
      hooks.append(optimizer.make_session_run_hook(config.is_chief))
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=train_op, training_hooks=hooks)

  rng = np.random.RandomState(0)
  features = {
      "x": rng.uniform(size=(FLAGS.batch_size, _SIZES[0])).astype(np.float32),
      "ids": rng.randint(0, _TABLE, size=(FLAGS.batch_size, _IDS))
  }
  labels = rng.randint(0, _CLASSES, size=FLAGS.batch_size)

  def input_fn():
    return tf.data.Dataset.from_tensors((features, labels)).repeat()

  folder = os.path.dirname(out)
  name = f"{task['type']}:{task['index']}"

  def everyone(suffix: str) -> bool:
    return len([f for f in os.listdir(folder) if f.endswith(suffix)
               ]) == trainers

  class Count(tf.estimator.SessionRunHook):
    """Waits for every trainer's session before the first step, then counts
    bytes and time from step --warmup for --steps steps: this trainer's
    steps (ps: each trainer's step is a global step of its own), else global
    steps (a synchronous ps cluster's trainers take steps at different
    rates; their global step is one global batch). A synchronous ps
    trainer steps on until it is ended (its steps keep the others going)."""

    def __init__(self):
      self._step = 0
      self._start = None

    def after_create_session(self, session, coord):
      del session, coord  # Unused.
      with open(os.path.join(folder, f"{name}.ready"), "w"):
        pass
      deadline = time.monotonic() + FLAGS.timeout
      while not everyone(".ready") and time.monotonic() < deadline:
        time.sleep(0.05)

    def before_run(self, run_context):
      return tf.estimator.SessionRunArgs(tf.compat.v1.train.get_global_step())

    def after_run(self, run_context, run_values):
      self._step = (
          self._step + 1 if kind == "ps" else int(run_values.results) + 1)
      if self._start is None and self._step >= FLAGS.warmup:
        self._start = (self._step, peer_bytes(os.getpid()), time.perf_counter())
      elif (self._start is not None and not os.path.exists(out) and
            self._step >= self._start[0] + FLAGS.steps):
        first, (sent0, received0), start = self._start
        steps = self._step - first
        sent, received = peer_bytes(os.getpid())
        with open(out + ".part", "w") as f:
          json.dump(
              {
                  "task": name,
                  "sent": (sent - sent0) / steps,
                  "received": (received - received0) / steps,
                  "secs_per_step": (time.perf_counter() - start) / steps
              }, f)
        os.rename(out + ".part", out)
        if kind != "sync_ps":
          run_context.request_stop()

  session_config = testing.session_config(towers)
  if kind != "mwms":
    session_config.device_filters.extend(
        ["/job:ps", f"/job:{task['type']}/task:{task['index']}"])
  config = tf.estimator.RunConfig(
      model_dir=os.path.join(os.path.dirname(out), "model"),
      save_checkpoints_steps=100000,
      save_summary_steps=100000,
      log_step_count_steps=None,
      session_config=session_config,
      train_distribute=(
          tf.distribute.experimental.MultiWorkerMirroredStrategy()
          if kind == "mwms" else None))
  if kind != "mwms":
    model_fn = replicate.replicate_model_fn(
        model_fn, devices=[f"/device:CPU:{i}" for i in range(towers)])
  estimator = tf.estimator.Estimator(model_fn, config=config)
  tf.estimator.train_and_evaluate(
      estimator,
      tf.estimator.TrainSpec(input_fn, max_steps=10**9, hooks=[Count()]),
      tf.estimator.EvalSpec(input_fn, steps=1))


def _task(cluster: Dict[str, List[str]], task: Dict[str, object], out: str,
          mode: str) -> subprocess.Popen:
  """This script as one task of `cluster`, reporting to `out`."""
  return subprocess.Popen(
      [sys.executable, __file__, f"--task_out={out}", f"--task_mode={mode}"] +
      [a for a in sys.argv[1:] if not a.startswith("--task_")],
      env=dict(
          os.environ, TF_CONFIG=json.dumps({
              "cluster": cluster,
              "task": task
          })),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True)


def measure(trainers: int, mode: str = "allreduce") -> Dict[str, object]:
  """One cluster of `trainers` trainers (and a ps in the ps modes): each
  trainer's bytes and seconds per step."""
  ports = common.free_ports(trainers + 1)
  cluster = {
      "chief": [f"localhost:{ports[0]}"],
      "worker": [f"localhost:{p}" for p in ports[1:trainers]]
  }
  if mode.endswith("ps"):
    cluster["ps"] = [f"localhost:{ports[trainers]}"]
  with tempfile.TemporaryDirectory() as folder:
    processes, outs = [], []
    if mode.endswith("ps"):
      processes.append(_task(cluster, {"type": "ps", "index": 0}, "ps", mode))
    for rank in range(trainers):
      task = ({
          "type": "chief",
          "index": 0
      } if rank == 0 else {
          "type": "worker",
          "index": rank - 1
      })
      outs.append(os.path.join(folder, f"trainer{rank}.json"))
      processes.append(_task(cluster, task, outs[-1], mode))
    # Done once every trainer has reported: a synchronous ps cluster's
    # trainers may wait for one another's tokens after that.
    deadline = time.monotonic() + FLAGS.timeout
    try:
      while not all(os.path.exists(out) for out in outs):
        failed = [p for p in processes if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
          break
        time.sleep(0.5)
    finally:
      for p in processes:
        if p.poll() is None:
          p.kill()
    errors = [p.communicate()[1] for p in processes]
    if not all(os.path.exists(out) for out in outs):
      raise RuntimeError(f"{mode} W={trainers}: a task failed or timed out:\n" +
                         "\n".join(e[-2000:] for e in errors))
    results = []
    for out in outs:
      with open(out) as f:
        results.append(json.load(f))
  minimum = minimum_bytes(mode, FLAGS.model, trainers, FLAGS.batch_size)
  return {
      "mode":
          mode,
      "model":
          FLAGS.model,
      "trainers":
          trainers,
      "towers":
          1 if mode == "mwms" else FLAGS.towers,
      "dense_bytes":
          dense_bytes(FLAGS.model),
      "rows_bytes":
          rows_bytes(FLAGS.model, FLAGS.batch_size),
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
    _run_trainer(FLAGS.task_out, FLAGS.task_mode)
    return
  results = [
      measure(int(w), mode) for w in FLAGS.trainers for mode in FLAGS.modes
  ]
  print(f"model {FLAGS.model}, {FLAGS.batch_size} rows per trainer per step; "
        "x: of the mode's minimum (see --helpfull)")
  for result in results:
    for r in result["per_trainer"]:
      print(f"{result['mode']:9s} W={result['trainers']} "
            f"towers={result['towers']} {r['task']:9s} "
            f"sent {r['sent'] / 1e6:.3f} MB/step ({r['sent_ratio']:.3f}x), "
            f"received {r['received'] / 1e6:.3f} MB/step "
            f"({r['received_ratio']:.3f}x), {r['secs_per_step'] * 1e3:.1f} "
            "ms/step")
  text = json.dumps(results, indent=1)
  if FLAGS.result_file:
    with open(FLAGS.result_file, "w") as f:
      f.write(text)
  else:
    print(text)


if __name__ == "__main__":
  app.run(main)
