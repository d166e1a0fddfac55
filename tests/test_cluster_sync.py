"""Synchronous training on a localhost cluster that examples/cluster.py
launches.

The launcher starts a ps, the chief and a worker as separate processes
(each with its own TF_CONFIG, each replicating the model over 2 virtual CPU
towers) and ends them. SyncReplicasOptimizer inside TowerOptimizer
averages one gradient of each trainer per step; each trainer reads its own
fixed shard of the data in a seeded order, so the trained variables must
equal one device's trained on the union of the two trainers' batches.
"""

import json
import shutil
import socket

import numpy as np
import pytest
import tensorflow as tf

from tests import cluster_harness

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
import digits_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.slow

STEPS = 12
BATCH = 32  # per trainer, split over its 2 towers
TRAINERS = 2  # the chief and one worker
# Plain gradient descent: unlike Adam, its step is proportional to the
# gradient, so a wrongly scaled gradient (a sum for an average) shows.
LEARNING_RATE = 0.5
# The chief ends within this many seconds of its last step (its queue
# runner's stop grace period would be 120 s), prediction included.
CHIEF_END_SECS = 60


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """The launcher's output and the cluster's model_dir."""
  model_dir = tmp_path_factory.mktemp("sync") / "model"
  output = cluster_harness.run_launcher([
      "--sync", "--noevaluator", f"--steps={STEPS}", f"--batch_size={BATCH}",
      "--towers=2", "--dropout=0", "--optimizer=sgd",
      f"--learning_rate={LEARNING_RATE}", "--save_checkpoints_steps=1000",
      "--log_every=4", f"--model_dir={model_dir}", "--timeout=170"
  ],
                                        timeout_secs=200)
  return output, model_dir


def test_launcher_prefixes_every_task_and_reaps_it(run):
  output, _ = run
  for label in ("ps0", "chief", "worker0"):
    assert cluster_harness.task_lines(output, label), output
  statuses = {
      label: cluster_harness.task_lines(output, label)[-1][1]
      for label in ("ps0", "chief", "worker0")
  }
  assert statuses == {
      "chief": "exited with status 0",
      "worker0": "exited with status 0",
      # Training is over: the launcher ends the ps (SIGTERM).
      "ps0": "exited with status -15"
  }, output
  assert "cluster finished" in output
  # No server is left listening on the cluster's ports.
  for address in _cluster_addresses(output):
    with pytest.raises(ConnectionRefusedError):
      socket.create_connection(("localhost", int(address.rsplit(":", 1)[1])),
                               timeout=5).close()


def _cluster_addresses(output):
  spec = output.split("cluster ", 1)[1].split("; ", 1)[0]
  return [a for addresses in json.loads(spec).values() for a in addresses]


def test_chief_ends_soon_after_its_last_step(run):
  """The queue runner's 120 s stop grace period does not hold the chief."""
  output, _ = run
  lines = cluster_harness.task_lines(output, "chief")
  last_step = [t for t, text in lines if text.startswith("trained ")]
  exited = [t for t, text in lines if text == "exited with status 0"]
  assert last_step and exited, output
  assert exited[0] - last_step[0] < CHIEF_END_SECS, output


def _union_input_fn(images, labels):
  """Each step, trainer 0's batch and trainer 1's, as one batch."""
  shards = tuple(
      digits_lib.train_input_fn(images, labels, BATCH, TRAINERS, i)
      for i in range(TRAINERS))

  def concat(*batches):
    return ({
        "image": tf.concat([f["image"] for f, _ in batches], 0)
    }, tf.concat([label for _, label in batches], 0))

  return tf.data.Dataset.zip(shards).map(concat)


def _train_one_device(initial_checkpoint, model_dir):
  """The unwrapped model_fn on one device, from the cluster's initial
  weights."""
  model_dir.mkdir()
  for path in initial_checkpoint.parent.glob(initial_checkpoint.name + ".*"):
    shutil.copy(path, model_dir)
  tf.compat.v1.train.update_checkpoint_state(
      str(model_dir), str(model_dir / initial_checkpoint.name))
  (train_x, train_y), _ = digits_lib.load_digits()
  estimator = tf.estimator.Estimator(
      digits_lib.model_fn,
      model_dir=str(model_dir),
      config=tf.estimator.RunConfig(tf_random_seed=0),
      params={
          "model": "mlp",
          "optimizer": "sgd",
          "learning_rate": LEARNING_RATE,
          "dropout": 0.0
      })
  estimator.train(lambda: _union_input_fn(train_x, train_y), max_steps=STEPS)
  return cluster_harness.checkpoint_values(estimator.latest_checkpoint())


def test_sync_training_equals_one_device_on_the_union_of_batches(run, tmp_path):
  _, model_dir = run
  final = tf.train.latest_checkpoint(str(model_dir))
  assert cluster_harness.checkpoint_step(final) == STEPS
  trained = cluster_harness.checkpoint_values(final)
  # Saved by the chief right after initialising, before any step.
  expected = _train_one_device(model_dir / "model.ckpt-0", tmp_path / "plain")
  assert expected.keys() <= trained.keys()
  assert {"dense/kernel", "dense_1/kernel"} <= expected.keys()
  # Float32 sums in another order (towers, then the two trainers' average)
  # through 12 steps: rtol 1e-5 on weights of order 0.1-1, atol for those
  # near 0.
  for name, value in expected.items():
    np.testing.assert_allclose(
        trained[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
