"""A contrib-style raw-graph harness, run in a fresh process.

tf.contrib's own tests (and users' tests migrated from them) call the
model_fn directly in a `tf.Graph`, without an Estimator or a `config`, and
run it in their own `Session(config=ConfigProto(device_count={'CPU': 4}))`.
The test process splits its CPU into 4 logical devices (tests/conftest.py),
which hides how such a caller is treated: this script runs in a process
without any split and prints what it finds as JSON, for
tests/test_devices_no_config.py.

    python -m tests.raw_graph_harness
"""

import json
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

import replicate  # pylint: disable=g-import-not-at-top
from tests import harness  # pylint: disable=g-import-not-at-top
from tests import models  # pylint: disable=g-import-not-at-top

TRAIN = tf.estimator.ModeKeys.TRAIN
STEPS = 3
# (towers, batch, static): 10 rows on 4 towers is uneven and dynamic.
CASES = ((2, 8, True), (4, 10, False))


def _model_fn(features, labels, mode):
  # An embedding lookup of a shared variable: its gradient is colocated with
  # the lookup, which runs where the variable lives.
  table = tf.compat.v1.get_variable(
      "embedding", [models.NUM_FEATURES, models.NUM_CLASSES], use_resource=True)
  logits = tf.compat.v1.layers.dense(
      features["x"], models.NUM_CLASSES, name="logits") + tf.gather(
          table, tf.argmax(features["x"], 1))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _session_config():
  # Without soft placement: every op must be placed where it asks to be.
  return tf.compat.v1.ConfigProto(
      device_count={"CPU": 4}, allow_soft_placement=False)


def _train(num_towers, batch, static):
  """Losses and weights, the model_fn called directly (no config)."""
  model_fn = _model_fn
  if num_towers:
    model_fn = replicate.replicate_model_fn(
        _model_fn, devices=[f"/device:CPU:{i}" for i in range(num_towers)])
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(models.data(), batch, static)
    spec = model_fn(features, labels, TRAIN)
    placed = sorted({
        op.device
        for op in tf.compat.v1.get_default_graph().get_operations()
        if "CPU:" in op.device
    })
    with tf.compat.v1.Session(config=_session_config()) as session:
      losses, values = harness.run_training(session, spec, STEPS)
  weights = {
      k: v.tolist()
      for k, v in values.items()
      if k.startswith(("logits", "embedding"))
  }
  return {"losses": losses.tolist(), "weights": weights, "devices": placed}


def _error(devices, config):
  """The ValueError message for `devices` under `config`, or None."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(models.data(), 8)
    try:
      replicate.replicate_model_fn(
          _model_fn, devices=devices)(
              features, labels, TRAIN, config=config)
    except ValueError as e:
      return str(e)
  return None


class _Warnings(logging.Handler):

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def main():
  tf.config.set_visible_devices([], "GPU")
  warnings = _Warnings()
  logging.getLogger("absl").addHandler(warnings)
  result = {
      "logical_cpus": len(tf.config.list_logical_devices("CPU")),
      "cases": []
  }
  for num_towers, batch, static in CASES:
    del warnings.messages[:]
    replicated = _train(num_towers, batch, static)
    case = {
        "num_towers": num_towers,
        "batch": batch,
        "static": static,
        "warnings": list(warnings.messages),
        "replicated": replicated,
        "one_device": _train(0, batch, static)
    }
    result["cases"].append(case)
  two_cpus = tf.estimator.RunConfig(
      session_config=tf.compat.v1.ConfigProto(device_count={"CPU": 2}))
  result["errors"] = {
      "unknown_type":
          _error(["/device:CPUU:0", "/device:CPU:1"], None),
      "beyond_device_count":
          _error(["/device:CPU:0", "/device:CPU:3"], two_cpus),
      "run_config_without_device_count":
          _error(["/device:CPU:0", "/device:CPU:1"], tf.estimator.RunConfig()),
  }
  print("RESULT " + json.dumps(result))


if __name__ == "__main__":
  main()
