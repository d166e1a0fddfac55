"""A checkpoint written on TensorFlow 2.15 restores on every line.

`tests/data/checkpoint_2_15/` was written by this file's `__main__` on
TensorFlow 2.15 (Python 3.11): a Keras-layer model with batch norm and a v1
Adam, 3 steps. On every line, 1 device and 2 towers restore it and
evaluate and predict 2.15's values (`expected.json`), and a step trained on
from it is the same on both: checkpoints cross the TensorFlow 2.16 line
(tf.estimator through replicate's compatibility layer, Keras 2 from
tf-keras) both ways in name and value.
"""

import json
import pathlib
import shutil
import sys

import numpy as np
import tensorflow as tf

import replicate

_DATA = pathlib.Path(__file__).resolve().parent / "data" / "checkpoint_2_15"
_DEVICES = ["/device:CPU:0", "/device:CPU:1"]


def _model_fn(features, labels, mode):
  training = mode == tf.estimator.ModeKeys.TRAIN
  x = tf.keras.layers.Dense(8, activation="relu")(features["x"])
  x = tf.keras.layers.BatchNormalization()(x, training=training)
  logits = tf.keras.layers.Dense(3)(x)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  step = tf.compat.v1.train.get_global_step()
  update = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(update):
    train_op = tf.compat.v1.train.AdamOptimizer(0.05).minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _input_fn():
  x = np.linspace(-1.0, 1.0, 12 * 5, dtype=np.float32).reshape(12, 5)
  y = (np.arange(12) % 3).astype(np.int32)
  return tf.data.Dataset.from_tensors(({"x": x}, y)).repeat()


def _estimator(model_dir, towers):
  model_fn = _model_fn if towers == 1 else replicate.replicate_model_fn(
      _model_fn, devices=_DEVICES[:towers])
  return tf.estimator.Estimator(
      model_fn,
      model_dir=str(model_dir),
      config=replicate.testing.run_config(2, model_dir=str(model_dir)))


def _values(estimator):
  loss = estimator.evaluate(_input_fn, steps=1)["loss"]
  logits = next(
      estimator.predict(
          lambda: _input_fn().map(lambda f, _: f).take(1),
          yield_single_examples=False))["logits"]
  return float(loss), logits.tolist()


def test_a_2_15_checkpoint_restores_evaluates_and_trains_on(tmp_path):
  expected = json.loads((_DATA / "expected.json").read_text())
  trained = []
  for towers in (1, 2):
    model_dir = tmp_path / str(towers)
    shutil.copytree(_DATA, model_dir)
    estimator = _estimator(model_dir, towers)
    loss, logits = _values(estimator)
    np.testing.assert_allclose(loss, expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(logits, expected["logits"], rtol=1e-5, atol=1e-6)
    estimator.train(_input_fn, steps=1)
    trained.append(_values(estimator)[0])
  np.testing.assert_allclose(trained[1], trained[0], rtol=1e-5)
  np.testing.assert_allclose(
      trained[0], expected["loss_after_a_step"], rtol=1e-5)


if __name__ == "__main__":
  # Writes the checkpoint and its values (run on TensorFlow 2.15 only).
  assert tf.__version__.startswith("2.15"), tf.__version__
  import tempfile  # pylint: disable=g-import-not-at-top
  replicate.testing.virtual_cpus(2)
  work = pathlib.Path(tempfile.mkdtemp())
  plain = _estimator(work / "plain", 1)
  plain.train(_input_fn, steps=3)
  shutil.rmtree(_DATA, ignore_errors=True)
  _DATA.mkdir(parents=True)
  for path in (work / "plain").glob("model.ckpt-3.*"):
    if path.suffix != ".meta":  # Estimators build their own graph.
      shutil.copy(path, _DATA)
  (_DATA / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-3"\n')
  loss, logits = _values(plain)
  plain.train(_input_fn, steps=1)
  after = _values(plain)[0]
  (_DATA / "expected.json").write_text(
      json.dumps(
          {
              "tensorflow": tf.__version__,
              "loss": loss,
              "logits": logits,
              "loss_after_a_step": after
          },
          indent=1) + "\n")
  print(sys.argv[0], "wrote", _DATA)
