"""A trainer whose step a restarting peer cancelled trains on in its process.

`cluster_task.train_and_evaluate` catches the CancelledError ("... just
restarted") a ps restart can raise mid-step and trains again. The retry runs
in the process whose gRPC server the first attempt started, which TensorFlow
cannot stop: starting a second server on its port fails. Here a chief and
its ps share one process (a subprocess of the test: their servers outlive
the test), and a hook raises the error a restarted ps would, once.
"""

import subprocess
import sys

import pytest

from tests import cluster_harness

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")

pytestmark = pytest.mark.slow

STEPS = 12
CANCEL_AT_STEP = 5

_TASK = """
import sys

import numpy as np
import tensorflow as tf

import cluster_task
import digits_lib
import replicate

model_dir, steps, cancel_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
devices, _ = digits_lib.configure_devices(2)
config = tf.estimator.RunConfig(model_dir=model_dir, save_checkpoints_steps=2)
tf.distribute.Server(config.cluster_spec, job_name="ps", task_index=0)


class CancelOnce(tf.compat.v1.train.SessionRunHook):
  cancelled = False

  def begin(self):
    self._step = tf.compat.v1.train.get_global_step()

  def after_run(self, run_context, run_values):
    step = run_context.session.run(self._step)
    if step >= cancel_at and not CancelOnce.cancelled:
      CancelOnce.cancelled = True
      raise tf.errors.CancelledError(
          None, None, "Session handle is not found: the ps just restarted")


def model_fn(features, labels, mode):
  logits = tf.compat.v1.layers.dense(features, 1)
  loss = tf.compat.v1.losses.mean_squared_error(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def input_fn():
  x = np.arange(32, dtype=np.float32).reshape(8, 4) / 32
  return tf.data.Dataset.from_tensors(
      (x, x.sum(axis=1, keepdims=True))).repeat()


estimator = tf.estimator.Estimator(
    replicate.replicate_model_fn(
        model_fn, devices=devices), config=config)
cluster_task.train_and_evaluate(
    estimator,
    tf.estimator.TrainSpec(input_fn, max_steps=steps, hooks=[CancelOnce()]),
    tf.estimator.EvalSpec(input_fn, steps=1))
print("cancelled", CancelOnce.cancelled, "final step",
      estimator.get_variable_value("global_step"), flush=True)
"""


def test_trainer_trains_on_after_a_cancelled_step(tmp_path):
  chief, ps = cluster_harness.free_ports(2)
  env = cluster_harness.example_env({
      "cluster": {
          "chief": [f"localhost:{chief}"],
          "ps": [f"localhost:{ps}"]
      },
      "task": {
          "type": "chief",
          "index": 0
      }
  })
  env["PYTHONPATH"] += f":{cluster_harness.EXAMPLES}"
  result = subprocess.run([
      sys.executable, "-c", _TASK,
      str(tmp_path / "model"),
      str(STEPS),
      str(CANCEL_AT_STEP)
  ],
                          env=env,
                          capture_output=True,
                          text=True,
                          timeout=cluster_harness.TASK_TIMEOUT_SECS,
                          check=False)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  assert result.stdout.count("a peer task restarted during a step") == 1, output
  assert f"cancelled True final step {STEPS}" in result.stdout, output
