"""Asynchronous training on a localhost cluster whose tasks are killed (-9).

One cluster of real processes (ps, chief, worker, evaluator; each trainer
replicating the digits model over 2 virtual CPU towers) goes through three
faults in turn, each a SIGKILL followed by a restart of the same command:
the worker, then the chief (after a checkpoint), then the ps. Each test
checks one fault's outcome, and the run as a whole: the global step reaches
its target, the evaluator's accuracy passes a threshold, the final
checkpoint restores into the plain model_fn on one device.

So that faults land mid-training however slow the machine, the other
trainers are paused (SIGSTOP) while a task is down: training cannot end
before the restarted task is back. While the ps restarts, the worker is
paused until the chief has restored the checkpoint, which spares it
TensorFlow's 30 s wait between checks that the model is ready.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from tests import cluster_harness

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
import cluster_task  # pylint: disable=g-import-not-at-top,wrong-import-position
import digits_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

# One cluster, killed task by task (tens of seconds): in the wide run; the
# default run's clusters are test_cluster_sync's and test_cluster_traffic's.
pytestmark = [pytest.mark.slow, pytest.mark.wide]

STEPS = 200
ACCURACY = 0.9  # the digits MLP gets about 0.97 after 200 steps
WAIT_SECS = 120  # for any one event
FLAGS = dict(
    steps=STEPS,
    batch_size=64,
    step_delay_ms=50,
    save_checkpoints_steps=10,
    log_every=10,
    throttle_secs=5)

STEP, SESSION = cluster_harness.STEP_LINE, cluster_harness.SESSION_LINE


def _checkpoint_fingerprint(model_dir, step):
  values = cluster_harness.checkpoint_values(
      str(model_dir / f"model.ckpt-{step}"))
  return cluster_task.variables_fingerprint(values)


def _kill_worker(cluster, events):
  """Kills and restarts the worker; the chief waits, paused, meanwhile."""
  chief, worker = cluster["chief"], cluster["worker0"]
  chief.pause()
  worker.kill()
  worker.start().wait_for(STEP, WAIT_SECS)
  chief.resume()
  chief.wait_for(STEP, WAIT_SECS, count=len(chief.wait_for(STEP, 0)) + 1)
  events["worker"] = dict(
      starts={
          label: t.starts for label, t in cluster.tasks.items()
      },
      chief_sessions=cluster_harness.sessions(chief.output()))


def _kill_chief(cluster, events):
  """Kills the chief after a checkpoint; restarts it (the worker paused)."""
  chief, worker = cluster["chief"], cluster["worker0"]
  cluster_harness.wait_for_checkpoint(cluster.model_dir, 1, WAIT_SECS, cluster)
  worker.pause()
  chief.kill()
  killed_at = cluster_harness.latest_step(cluster.model_dir)
  chief.start().wait_for(SESSION, WAIT_SECS)
  chief.pause()  # While its checkpoint is read: it would soon be deleted.
  (step, fingerprint), = cluster_harness.sessions(chief.output())
  events["chief"] = dict(
      killed_at=killed_at,
      resumed=(step, fingerprint),
      checkpoint=_checkpoint_fingerprint(cluster.model_dir, step))
  chief.resume()
  worker.resume()


def _kill_ps(cluster, events):
  """Kills and restarts the ps while both trainers train."""
  chief, worker, ps = cluster["chief"], cluster["worker0"], cluster["ps0"]
  chief.wait_for(STEP, WAIT_SECS)
  worker.pause()
  ps.kill()
  killed_at = cluster_harness.latest_step(cluster.model_dir)
  ps.start()
  chief.wait_for(SESSION, WAIT_SECS, count=2)
  chief.pause()
  step, fingerprint = cluster_harness.sessions(chief.output())[1]
  events["ps"] = dict(
      killed_at=killed_at,
      recovered=(step, fingerprint),
      checkpoint=_checkpoint_fingerprint(cluster.model_dir, step),
      initial=cluster_harness.sessions(chief.output(1))[0])
  chief.resume()
  worker.resume()
  worker.wait_for(SESSION, WAIT_SECS, count=2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """Runs the cluster through the three faults; returns it and the events."""
  cluster = cluster_harness.Cluster(
      tmp_path_factory.mktemp("faults"), evaluator=True, **FLAGS)
  events = {}
  with cluster:
    chief, worker = cluster["chief"], cluster["worker0"]
    chief.wait_for(STEP, WAIT_SECS)
    chief.pause()  # Until the worker trains too.
    worker.wait_for(STEP, WAIT_SECS)
    chief.resume()
    _kill_worker(cluster, events)
    _kill_chief(cluster, events)
    _kill_ps(cluster, events)
    cluster.wait_trainers(WAIT_SECS)
  return cluster, events


def test_worker_killed_and_restarted(run):
  cluster, events = run
  worker = cluster["worker0"]
  assert worker.starts >= 2
  # The restarted worker trained; nothing else restarted meanwhile, and the
  # chief kept its one session.
  assert cluster_harness.trained_steps(worker.output(2)) > 0, cluster.outputs()
  assert events["worker"]["starts"] == {
      "ps0": 1,
      "chief": 1,
      "worker0": 2,
      "evaluator": 1
  }
  assert len(events["worker"]["chief_sessions"]) == 1, cluster.outputs()
  assert cluster_harness.latest_step(cluster.model_dir) >= STEPS


def test_chief_killed_resumes_from_its_last_checkpoint(run):
  cluster, events = run
  chief = events["chief"]
  step, fingerprint = chief["resumed"]
  assert chief["killed_at"] > 0
  assert step >= chief["killed_at"], cluster.outputs()
  # Every variable is the checkpoint's (not initial values).
  assert fingerprint == pytest.approx(chief["checkpoint"], rel=1e-12)
  assert cluster_harness.latest_step(cluster.model_dir) >= STEPS
  # No checkpoint file is corrupt: every one left restores in full.
  indexes = sorted(cluster.model_dir.glob("model.ckpt-*.index"))
  assert indexes
  state = tf.train.get_checkpoint_state(str(cluster.model_dir))
  for path in list(state.all_model_checkpoint_paths) + [
      str(index)[:-len(".index")] for index in indexes
  ]:
    assert cluster_harness.checkpoint_values(path)["global_step"] >= 0


def test_ps_killed_trainers_recover_from_the_last_checkpoint(run):
  """A ps restarts empty; the chief restores the checkpoint into it."""
  cluster, events = run
  ps = events["ps"]
  step, fingerprint = ps["recovered"]
  assert step >= ps["killed_at"] > 0, cluster.outputs()
  assert fingerprint == pytest.approx(ps["checkpoint"], rel=1e-12)
  # Not a silent reset to the initial values.
  initial_step, initial_fingerprint = ps["initial"]
  assert initial_step < ps["killed_at"]
  assert abs(fingerprint - initial_fingerprint) > 1.0
  # The worker's new session starts from the restored model, not step 0.
  worker_sessions = cluster_harness.sessions(cluster["worker0"].output())
  assert worker_sessions[-1][0] >= step, cluster.outputs()
  assert cluster["ps0"].starts == 2


def test_training_reaches_its_target_and_the_evaluator_its_accuracy(run):
  cluster, _ = run
  evaluations = cluster["evaluator"].wait_for(
      r"evaluated global step (\d+): accuracy ([0-9.]+)", 0)
  step, accuracy = int(evaluations[-1].group(1)), float(
      evaluations[-1].group(2))
  assert step >= STEPS, cluster.outputs()
  assert accuracy >= ACCURACY, cluster.outputs()
  assert cluster_harness.latest_step(cluster.model_dir) >= STEPS


def test_final_checkpoint_restores_into_the_plain_estimator(run):
  """The unwrapped model_fn on one device predicts what the chief did."""
  cluster, _ = run
  chief_probabilities = np.load(cluster.model_dir / "test_probabilities.npy")
  _, (test_x, _) = digits_lib.load_digits()
  estimator = tf.estimator.Estimator(
      digits_lib.model_fn,
      model_dir=str(cluster.model_dir),
      params={
          "model": "mlp",
          "learning_rate": 0.01
      })
  probabilities = np.array([
      p["probabilities"] for p in estimator.predict(
          lambda: digits_lib.eval_input_fn(test_x, None, 64))
  ])
  # Float32 logits of another graph (no towers): rtol 1e-5 on values of
  # order 1, atol for probabilities near 0.
  np.testing.assert_allclose(
      probabilities, chief_probabilities, rtol=1e-5, atol=1e-6)
  assert os.path.exists(
      tf.train.latest_checkpoint(str(cluster.model_dir)) + ".index")
