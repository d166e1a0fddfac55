"""One machine (no cluster) killed (-9) during train() and restarted.

`examples/cluster.py --task` without TF_CONFIG trains and evaluates the
digits model on 2 virtual CPU towers alone. Killed after a checkpoint and
restarted with the same model_dir, it must resume from that checkpoint with
every variable (weights, Adam's slots and powers, the global step)
restored, and end with the weights of an uninterrupted run from that
checkpoint: a fresh model_dir holding only that checkpoint, the same
command.
"""

import shutil
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests import cluster_harness

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
import cluster_task  # pylint: disable=g-import-not-at-top,wrong-import-position

# A process killed mid-training (tens of seconds): in the wide run.
pytestmark = [pytest.mark.slow, pytest.mark.wide]

STEPS = 60
KILL_AFTER_STEP = 20
WAIT_SECS = 120


def _task(model_dir, log_dir, name):
  args = [
      sys.executable,
      str(cluster_harness.CLUSTER), "--task", f"--model_dir={model_dir}",
      f"--steps={STEPS}", "--towers=2", "--batch_size=64",
      "--save_checkpoints_steps=10", "--step_delay_ms=50", "--log_every=5",
      "--throttle_secs=600", f"--timeout={cluster_harness.TASK_TIMEOUT_SECS}"
  ]
  return cluster_harness.Task(name, args, cluster_harness.example_env(),
                              log_dir)


def _copy_checkpoint(model_dir, step, to_dir):
  """A model_dir holding only the checkpoint at `step`."""
  to_dir.mkdir()
  for path in model_dir.glob(f"model.ckpt-{step}.*"):
    shutil.copy(path, to_dir)
  tf.compat.v1.train.update_checkpoint_state(
      str(to_dir), str(to_dir / f"model.ckpt-{step}"))


def test_killed_during_train_resumes_with_every_variable(tmp_path):
  model_dir, reference_dir = tmp_path / "model", tmp_path / "reference"
  run = _task(model_dir, tmp_path, "run")
  reference = _task(reference_dir, tmp_path, "reference")
  try:
    run.start()
    cluster_harness.wait_for_checkpoint(model_dir, KILL_AFTER_STEP, WAIT_SECS)
    assert run.process.poll() is None, run.outputs()
    run.kill()
    step = cluster_harness.latest_step(model_dir)
    assert KILL_AFTER_STEP <= step < STEPS, run.outputs()
    saved = cluster_harness.checkpoint_values(
        str(model_dir / f"model.ckpt-{step}"))
    _copy_checkpoint(model_dir, step, reference_dir)
    run.start()
    reference.start()
    assert run.wait_exit(WAIT_SECS) == 0, run.outputs()
    assert reference.wait_exit(WAIT_SECS) == 0, reference.outputs()
  finally:
    run.kill()
    reference.kill()

  # Resumed at the checkpoint with every variable's saved value.
  assert any(name.endswith("/Adam_1") for name in saved)
  resumed = cluster_harness.sessions(run.output())
  assert resumed[0] == (step,
                        pytest.approx(
                            cluster_task.variables_fingerprint(saved),
                            rel=1e-12)), run.outputs()
  # The same weights as training on from that checkpoint without a kill.
  final = cluster_harness.checkpoint_values(
      tf.train.latest_checkpoint(str(model_dir)))
  expected = cluster_harness.checkpoint_values(
      tf.train.latest_checkpoint(str(reference_dir)))
  assert final["global_step"] == expected["global_step"] == STEPS
  assert final.keys() == expected.keys()
  for name, value in expected.items():
    # The same program on the same data from the same values: the same
    # float operations in the same order.
    np.testing.assert_array_equal(final[name], value, err_msg=name)
