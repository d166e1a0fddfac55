"""TRAIN, EVAL and PREDICT exports of a replicated model_fn are the plain ones.

`experimental_export_all_saved_models` builds every mode's graph with
features fed by placeholders; each must be the unwrapped model_fn's, so the
SavedModel pins none of the training machine's devices and loads with the
TF1 loader on one CPU without soft placement (tests/export_loader.py, in a
fresh process without the test process's CPU split), with the plain
export's signatures and outputs.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness
from tests import models

ROOT = pathlib.Path(__file__).resolve().parent.parent
ModeKeys = tf.estimator.ModeKeys
ROWS = 7  # an eval batch that 4 towers would split unevenly


def _supervised_receiver():
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, models.NUM_FEATURES], "x")
    y = tf.compat.v1.placeholder(tf.int64, [None], "labels")
  return tf.estimator.experimental.build_raw_supervised_input_receiver_fn(
      {"x": x}, y)


def _serving_receiver():
  x = tf.compat.v1.placeholder(tf.float32, [None, models.NUM_FEATURES], "x")
  return tf.estimator.export.ServingInputReceiver({"x": x}, {"x": x})


def _export_all(estimator, directory):
  receiver = _supervised_receiver()
  return estimator.experimental_export_all_saved_models(
      str(directory), {
          ModeKeys.TRAIN: receiver,
          ModeKeys.EVAL: receiver,
          ModeKeys.PREDICT: _serving_receiver
      })


def _input_fn():
  features, labels = models.data(40)
  return tf.data.Dataset.from_tensor_slices((features, labels)).batch(8)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
  """Trained on 4 virtual CPUs; both exports loaded in a fresh process."""
  root = tmp_path_factory.mktemp("export_modes")
  config = harness.estimator_config(root / "model", seed=1)
  params = {"optimizer": "adam"}
  replicated = tf.estimator.Estimator(
      replicate.replicate_model_fn(
          models.classifier_model_fn,
          devices=harness.devices("virtual_cpus", 4)),
      config=config,
      params=params)
  replicated.train(_input_fn, steps=3)
  # The plain model_fn on the same checkpoint.
  plain = tf.estimator.Estimator(
      models.classifier_model_fn, config=config, params=params)
  directories = {
      "replicated": _export_all(replicated, root / "replicated"),
      "plain": _export_all(plain, root / "plain")
  }
  features, labels = models.data(ROWS, seed=5)
  np.savez(root / "rows.npz", x=features["x"], label=labels)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  done = subprocess.run([
      sys.executable, "-m", "tests.export_loader",
      json.dumps({
          k: v.decode() if isinstance(v, bytes) else str(v)
          for k, v in directories.items()
      }),
      str(root / "rows.npz")
  ],
                        cwd=ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=300,
                        check=False)
  lines = [
      line for line in done.stdout.splitlines() if line.startswith("RESULT ")
  ]
  assert done.returncode == 0 and lines, done.stderr[-3000:]
  return json.loads(lines[-1][len("RESULT "):])


def test_the_loader_process_has_one_cpu(loaded):
  assert loaded["logical_cpus"] == 1


@pytest.mark.parametrize("mode", ["train", "eval", "serve"])
def test_every_mode_loads_on_one_cpu_as_the_plain_graph(loaded, mode):
  replicated, plain = loaded[f"replicated/{mode}"], loaded[f"plain/{mode}"]
  assert "error" not in replicated, replicated
  assert "error" not in plain, plain
  assert replicated["devices"] == plain["devices"]
  # The Saver's ops ask for any CPU, the global step's for the host CPU, as
  # in the plain export; no op asks for a tower's device.
  assert set(replicated["devices"]) <= {"", "/device:CPU:*", "/device:CPU:0"}
  assert replicated["nodes"] == plain["nodes"]
  assert replicated["signatures"] == plain["signatures"]


@pytest.mark.parametrize("mode", ["eval", "serve"])
def test_signature_outputs_equal_the_plain_exports(loaded, mode):
  replicated, plain = loaded[f"replicated/{mode}"], loaded[f"plain/{mode}"]
  assert sorted(replicated["outputs"]) == sorted(plain["outputs"])
  for key, expected in plain["outputs"].items():
    if key.endswith("/value"):
      # A metric's value read in the run that updates it is unordered with
      # the update, in the plain export too: 0 or the updated value.
      continue
    actual = replicated["outputs"][key]
    assert actual["shape"] == expected["shape"], key
    np.testing.assert_allclose(
        actual["value"], expected["value"], rtol=1e-5, atol=1e-6, err_msg=key)


def test_eval_update_ops_output_the_metric_value(loaded):
  """Each update_op output is the updated metric: accuracy on the rows."""
  update = loaded["replicated/eval"]["outputs"]["metrics/accuracy/update_op"]
  classes = loaded["replicated/serve"]["outputs"]["classes"]["value"]
  labels = models.data(ROWS, seed=5)[1]
  assert update["shape"] == []
  np.testing.assert_allclose(
      update["value"], np.mean(classes == labels), rtol=1e-6)
