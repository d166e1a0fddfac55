"""A TF_CONFIG cluster of trainers only (no ps job), as real processes.

Each trainer (`tests/trainers_task.py`) reads its own part of every step's
global batch, replicates over its own virtual CPU towers and all-reduces
its batch reductions and gradients with the others; every trainer's
variables (Adam's slots, batch-norm statistics and the global step
included) and losses must equal one device's trained on the global batch
(the parts in task order), in float64.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from typing import Any, List, Optional, Sequence

import numpy as np
import pytest

from tests import cluster_harness

pytestmark = pytest.mark.slow

TASK = pathlib.Path(__file__).resolve().parent / "trainers_task.py"
TIMEOUT_SECS = 240


def _start(tf_config: Optional[dict],
           args: List[str],
           log: pathlib.Path,
           timeout_secs: Optional[float] = None) -> subprocess.Popen:
  env = cluster_harness.example_env(tf_config)
  if timeout_secs is not None:
    env["REPLICATE_TRAINERS_TIMEOUT_SECS"] = str(timeout_secs)
  with open(log, "w") as out:
    return subprocess.Popen(
        [sys.executable, str(TASK)] + args,
        env=env,
        cwd=cluster_harness.ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True)


def _run(tmp_path: pathlib.Path,
         towers: Sequence[int],
         parts: str,
         last: str = "",
         steps: int = 4,
         extra: Sequence[str] = ()) -> pathlib.Path:
  """Trains the cluster (one trainer per entry of `towers`) and one device;
  returns the folder of their results."""
  out = tmp_path / "out"
  out.mkdir()
  ports = cluster_harness.free_ports(len(towers))
  cluster = {
      "chief": [f"localhost:{ports[0]}"],
      "worker": [f"localhost:{p}" for p in ports[1:]]
  }
  common = [f"--out={out}", f"--parts={parts}", f"--steps={steps}"]
  common += ([f"--last={last}"] if last else []) + list(extra)
  processes = []
  for rank, count in enumerate(towers):
    task = ({
        "type": "chief",
        "index": 0
    } if rank == 0 else {
        "type": "worker",
        "index": rank - 1
    })
    processes.append(
        _start({
            "cluster": cluster,
            "task": task
        }, common + [f"--model_dir={tmp_path / 'model'}", f"--towers={count}"],
               tmp_path / f"trainer{rank}.log"))
  processes.append(
      _start(None, common + [f"--model_dir={tmp_path / 'one'}", "--towers=1"],
             tmp_path / "one.log"))
  try:
    for process in processes:
      process.wait(timeout=TIMEOUT_SECS)
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
  logs = "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}"
                   for p in sorted(tmp_path.glob("*.log")))
  assert all(p.returncode == 0 for p in processes), logs
  return out


def _assert_one_device(out: pathlib.Path,
                       trainers: int,
                       variables_to: float = 1e-12) -> None:
  """Every trainer's losses and variables are one device's: the variables
  (float64) to `variables_to`, the losses (float32 where the model's loss
  is tf.compat.v1.losses') to 1e-6."""
  one = np.load(out / "one_device.npz")
  labels = ["chief0"] + [f"worker{i}" for i in range(trainers - 1)]
  for label in labels:
    got = np.load(out / f"{label}.npz")
    assert sorted(got.files) == sorted(one.files), label
    for name in one.files:
      tolerance = 1e-6 if name == "losses" else variables_to
      np.testing.assert_allclose(
          got[name],
          one[name],
          rtol=tolerance,
          atol=tolerance,
          err_msg=f"{label}: {name}")


def test_two_trainers_of_two_towers_equal_one_device(tmp_path):
  out = _run(tmp_path, [2, 2], "5,5")
  _assert_one_device(out, 2)
  # The chief's checkpoint is one device's: the same keys (no tower or
  # collective state; the ps mode writes these too) and values, so either
  # restores the other.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  chief = tf.train.load_checkpoint(str(tmp_path / "model"))
  one = tf.train.load_checkpoint(str(tmp_path / "one"))
  keys = one.get_variable_to_shape_map()
  assert chief.get_variable_to_shape_map() == keys
  assert "hidden/kernel" in keys and "global_step" in keys
  for key in keys:
    np.testing.assert_allclose(
        chief.get_tensor(key), one.get_tensor(key), rtol=1e-12, err_msg=key)


# Every way of computing and applying gradients replicate routes, each
# all-reduced among the trainers (before, tf.gradients and Keras' get_updates
# trained each trainer on its own rows, silently; a loss with rows got half
# the gradient on 2 trainers; a sparse gradient, an embedding's, failed to
# build; then it was all-reduced as the whole table). A sparse gradient is
# gathered as the trainers' rows: Momentum's, Adagrad's and Adam's sparse
# updates touch only the rows looked up, as one device's. A batch mean
# whose length changes by step (an instance's shape is fixed at its first
# run) failed at the second step.
ROUTES = [
    "v1_compute_apply", "tape", "keras_get_updates", "keras_minimize",
    "keras_get_gradients", "tower_optimizer", "v1_rows_loss",
    "embedding_momentum", "embedding_adagrad", "embedding_adam", "width_by_step"
]


def test_tf_gradients_and_apply_gradients_equal_one_device(tmp_path):
  out = _run(tmp_path, [2, 2], "5,5", extra=["--route=tf_gradients"])
  _assert_one_device(out, 2)


@pytest.mark.wide
@pytest.mark.parametrize("route", ROUTES)
def test_every_gradient_route_equals_one_device(tmp_path, route):
  out = _run(tmp_path, [2, 1], "5,5", extra=[f"--route={route}"])
  _assert_one_device(out, 2)


def _build_trainer_graph(route: str,
                         monkeypatch,
                         placeholders: bool = False) -> Any:
  """The chief's TRAIN graph of a cluster of 2 trainers, in this process
  (no servers: collectives are only built), fed by a dataset or by
  `placeholders`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  # pylint: disable=g-direct-tensorflow-import
  from tensorflow.python.training import monitored_session

  import replicate  # pylint: disable=g-import-not-at-top
  from tests import trainers_task  # pylint: disable=g-import-not-at-top

  cluster = {"chief": ["localhost:1"], "worker": ["localhost:2"]}
  # What the wrap changes for trainers, for this test only.
  monkeypatch.setattr(monitored_session, "_PREEMPTION_ERRORS",
                      monitored_session._PREEMPTION_ERRORS)
  monkeypatch.setenv(
      "TF_CONFIG",
      json.dumps({
          "cluster": cluster,
          "task": {
              "type": "chief",
              "index": 0
          }
      }))
  config = tf.estimator.RunConfig()
  model_fn = replicate.replicate_model_fn(
      trainers_task.model_fn, devices=["/device:CPU:0", "/device:CPU:1"])
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    if placeholders:
      x = tf.compat.v1.placeholder(tf.float64, [None, trainers_task.FEATURES])
      y = tf.compat.v1.placeholder(tf.float64, [None])
    else:
      data = tf.data.Dataset.from_tensors((np.zeros(
          (5, trainers_task.FEATURES)), np.zeros(5))).repeat()
      x, y = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
    model_fn({"x": x}, y, "train", {
        "learning_rate": 0.05,
        "route": route,
        "loss": "float64"
    }, config)
  return graph


def test_gradients_no_collective_passes_are_refused(monkeypatch):
  """An optimizer that differentiates by itself (TensorFlow's internal
  gradients function) would train each trainer on its own rows."""
  with pytest.raises(
      ValueError, match="without an all-reduce among the "
      "trainers") as raised:
    _build_trainer_graph("own_differentiation", monkeypatch)
  # Which update is met first varies between runs: any of the model's.
  assert re.search(r"op 'Adam/update_[\w/]+/ResourceApplyAdam'",
                   str(raised.value))


def test_a_trainer_fed_by_placeholders_all_reduces(monkeypatch):
  """A TRAIN graph fed by placeholders (one device's tower, unpinned, as
  for an export) trained each trainer on its own rows without a word."""
  graph = _build_trainer_graph("v1_minimize", monkeypatch, placeholders=True)
  reduced = [
      op for op in graph.get_operations()
      if op.type == "CollectiveReduceV2" and "among_trainers" in op.name
  ]
  # The loss's batch sums and the gradients (every variable's, packed).
  parameters = sum(v.shape.num_elements()
                   for v in graph.get_collection("trainable_variables"))
  assert [op.inputs[0].shape.num_elements() for op in reduced
         ].count(parameters) == 1, [op.name for op in reduced]


@pytest.mark.wide
@pytest.mark.parametrize("loss,route,variables_to",
                         [("float64", "v1_minimize", 1e-12),
                          ("v1", "v1_minimize", 1e-7),
                          ("float64", "embedding_momentum", 1e-12)])
def test_three_trainers_uneven_parts_and_one_without_rows(
    tmp_path, loss, route, variables_to):
  # Tower counts differ (2, 1, 2): they do not change the result. The v1
  # losses compute in float32 even for float64 values: the gradient
  # flowing back into their float32 sum is W-fold on each trainer (see
  # `replicate._meet.trainers`), 3 times it rounds to float32 (relative
  # 2**-24), so the variables are one device's to float32 precision
  # (1.6e-8 measured); a float64 loss, or W = 2 or 4, is exact. An
  # embedding's sparse gradient is gathered as rows: 3, 2 and 0 of them in
  # the last step.
  out = _run(
      tmp_path, [2, 1, 2],
      "4,3,2",
      last="2,0,1",
      extra=[f"--loss={loss}", f"--route={route}"])
  _assert_one_device(out, 3, variables_to)


def test_trainers_only_config_is_recognised():
  """The model_fn's cluster test without processes: ps means ps mode."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  from replicate._meet import trainers  # pylint: disable=g-import-not-at-top

  def config(cluster, task_type, index):
    env = {"cluster": cluster, "task": {"type": task_type, "index": index}}
    with pytest.MonkeyPatch.context() as patch:
      patch.setenv("TF_CONFIG", json.dumps(env))
      return tf.estimator.RunConfig()

  two = {"chief": ["h0:1"], "worker": ["h1:1"]}
  found = trainers.from_config(config(two, "worker", 0), "train")
  assert (found.size, found.rank) == (2, 1)
  assert found.device == "/job:worker/replica:0/task:0/device:CPU:0"
  assert trainers.from_config(config(two, "worker", 0), "eval") is None
  with_ps = dict(two, ps=["h2:1"])
  assert trainers.from_config(config(with_ps, "chief", 0), "train") is None


def test_launcher_trains_a_cluster_of_trainers_only(tmp_path):
  """`examples/cluster.py --ps=0`: the chief and a worker train by
  all-reduce (the worker no longer waits for a checkpoint the chief writes
  only once the worker has joined its broadcast), the evaluator evaluates,
  and every task exits 0."""
  pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
  output = cluster_harness.run_launcher([
      "--ps=0", "--workers=1", "--steps=60", "--towers=2", "--log_every=20",
      f"--model_dir={tmp_path / 'model'}", "--timeout=170"
  ],
                                        timeout_secs=200)
  for label in ("chief", "worker0", "evaluator"):
    lines = cluster_harness.task_lines(output, label)
    assert lines and lines[-1][1] == "exited with status 0", output
  # Both trainers log the same losses: one model, trained on both parts.
  chief = [t for _, t in cluster_harness.task_lines(output, "chief")]
  worker = [t for _, t in cluster_harness.task_lines(output, "worker0")]
  steps = [t for t in chief if t.startswith("global step")]
  assert steps and steps == [t for t in worker if t.startswith("global step")]
  # The evaluator evaluated the final checkpoint as one device does.
  evaluated = [
      t for _, t in cluster_harness.task_lines(output, "evaluator")
      if t.startswith("evaluated global step 60:")
  ]
  assert evaluated, output
  figures = dict((name, float(value)) for name, value in re.findall(
      r"(\w+) ([0-9.]+)", evaluated[-1].split(":", 1)[1]))
  one = _evaluate_digits_on_one_device(tmp_path / "model")
  assert one["global_step"] == 60
  # Printed to 4 decimals.
  assert figures["accuracy"] == pytest.approx(one["accuracy"], abs=5.1e-5)


def _evaluate_digits_on_one_device(model_dir: pathlib.Path) -> dict:
  """examples/cluster.py's evaluation of `model_dir`'s latest checkpoint,
  in this process, on one device without replicate."""
  import digits_lib  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  _, (test_x, test_y) = digits_lib.load_digits()
  estimator = tf.estimator.Estimator(
      digits_lib.model_fn,
      model_dir=str(model_dir),
      params={
          "model": "mlp",
          "learning_rate": 0.01,
          "optimizer": "adam",
          "dropout": digits_lib.DROPOUT
      })
  return estimator.evaluate(
      lambda: digits_lib.eval_input_fn(test_x, test_y, 64), name="one_device")


# How long the trainers' collectives wait in the killed-trainer test.
KILLED_TIMEOUT_SECS = 15


@pytest.mark.wide
def test_killed_trainer_fails_the_others_then_all_resume(tmp_path):
  """A worker SIGKILLed mid-run: the chief's step fails within the
  collectives' timeout (DeadlineExceededError, or UnavailableError at once
  when a transfer from the worker was in flight) naming the all-reduce: it
  does not wait forever; every trainer restarted with the same command
  resumes from the last checkpoint, with the chief's values."""
  (tmp_path / "out").mkdir()
  ports = cluster_harness.free_ports(2)
  cluster = {
      "chief": [f"localhost:{ports[0]}"],
      "worker": [f"localhost:{ports[1]}"]
  }
  args = [
      f"--out={tmp_path / 'out'}", "--parts=5,5", "--steps=60",
      "--save_steps=20", "--step_delay=0.1", "--towers=1",
      f"--model_dir={tmp_path / 'model'}"
  ]
  tasks = [("chief", {
      "type": "chief",
      "index": 0
  }), ("worker", {
      "type": "worker",
      "index": 0
  })]

  def start(run: int) -> List[subprocess.Popen]:
    return [
        _start({
            "cluster": cluster,
            "task": task
        },
               args,
               tmp_path / f"{label}{run}.log",
               timeout_secs=KILLED_TIMEOUT_SECS) for label, task in tasks
    ]

  chief, worker = start(0)
  try:
    deadline = time.monotonic() + TIMEOUT_SECS
    while not cluster_harness.latest_step(tmp_path / "model"):
      assert time.monotonic() < deadline, (tmp_path / "chief0.log").read_text()
      assert chief.poll() is None, (tmp_path / "chief0.log").read_text()
      time.sleep(0.2)
    os.killpg(worker.pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
      chief.wait(timeout=KILLED_TIMEOUT_SECS + 60)
    except subprocess.TimeoutExpired:
      os.kill(chief.pid, signal.SIGUSR1)  # its stacks, into its log
      time.sleep(2)
      raise
    waited = time.monotonic() - killed
  finally:
    for process in (chief, worker):
      if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
  log = (tmp_path / "chief0.log").read_text()
  assert chief.returncode != 0, log
  # Timed out waiting for the worker, or (a transfer from it in flight)
  # aborted at once: either ends the chief, naming the all-reduce.
  assert ("Collective has timed out" in log or
          "Collective ops is aborted by" in log), log
  assert "among_trainers" in log, log
  assert waited < KILLED_TIMEOUT_SECS + 30, waited
  last = cluster_harness.latest_step(tmp_path / "model")
  assert 20 <= last < 60

  processes = start(1)
  try:
    for process in processes:
      process.wait(timeout=TIMEOUT_SECS)
  finally:
    for process in processes:
      if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
  logs = {label: (tmp_path / f"{label}1.log").read_text() for label, _ in tasks}
  assert all(p.returncode == 0 for p in processes), logs
  for label, _ in tasks:
    assert f"session created at global step {last}\n" in logs[label], logs
  chief_values = np.load(tmp_path / "out" / "chief0.npz")
  worker_values = np.load(tmp_path / "out" / "worker0.npz")
  for name in chief_values.files:
    np.testing.assert_array_equal(worker_values[name], chief_values[name])
  assert int(chief_values["v:global_step"]) == 60


@pytest.mark.wide
@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_traffic_per_trainer_is_the_ring_minimum(tmp_path, model):
  """benchmarks/trainers_traffic.py on 2 trainers: each sends and receives
  at most 1.1 x the minimum per step: 2(W-1)/W x P of dense gradients
  (the MLP: 1.003 measured for W = 2, 3, 4) plus, of a sparse one, the
  rows each trainer looked up, not the table (25.6 MB, which the
  embedding model's trainers moved each step before)."""
  result_file = tmp_path / "traffic.json"
  subprocess.run([
      sys.executable,
      str(cluster_harness.ROOT / "benchmarks" / "trainers_traffic.py"),
      "--trainers=2", "--steps=5", f"--model={model}",
      f"--result_file={result_file}"
  ],
                 env=cluster_harness.example_env(),
                 cwd=cluster_harness.ROOT,
                 check=True,
                 timeout=TIMEOUT_SECS,
                 capture_output=True)
  (result,) = json.loads(result_file.read_text())
  assert len(result["per_trainer"]) == 2
  if model == "embedding":
    # 32 rows x 8 ids of 64 float32 and an int64 index each.
    assert result["rows_bytes"] == 32 * 8 * (64 * 4 + 8), result
  for trainer in result["per_trainer"]:
    assert 0.9 <= trainer["sent_ratio"] <= 1.1, result
    assert 0.9 <= trainer["received_ratio"] <= 1.1, result
