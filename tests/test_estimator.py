"""End to end through tf.estimator.Estimator: train, evaluate, predict.

Keras 2.15 draws the seeds of unseeded initializers from Python's `random`,
so even two plain runs start apart: the model seeds its initializers, and
replicated and plain estimators must then end at the same values.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness
from tests import models

TOWERS = {
    "plain": None,
    "cpu2": [f"/device:CPU:{i}" for i in range(2)],
    "cpu4": [f"/device:CPU:{i}" for i in range(4)],
    "gpu4": [f"/device:GPU:{i}" for i in range(4)]
}
STEPS = 12
BATCH = 16


def _config(model_dir):
  return harness.estimator_config(model_dir, seed=42)


def model_fn(features, labels, mode, params):
  """A Keras layer and an unnamed v1 layer (whose names collide)."""
  hidden = tf.keras.layers.Dense(
      16,
      activation="relu",
      kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))(
          features["x"])
  logits = tf.compat.v1.layers.dense(
      hidden,
      models.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  classes = tf.argmax(logits, 1)
  predictions = {"classes": classes, "logits": logits}
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        eval_metric_ops={
            "accuracy":
                tf.compat.v1.metrics.accuracy(labels, classes),
            "auc":
                tf.compat.v1.metrics.auc(
                    tf.one_hot(labels, models.NUM_CLASSES),
                    tf.nn.softmax(logits))
        })
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.AdamOptimizer(params["learning_rate"]))
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _input_fn(num_examples=96, batch_size=BATCH, epochs=None):
  features, labels = models.data(num_examples)

  def input_fn():
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    return dataset.repeat(epochs).batch(batch_size)

  return input_fn


def _estimator(name, model_dir):
  fn = model_fn if TOWERS[name] is None else replicate.replicate_model_fn(
      model_fn, devices=TOWERS[name])
  return tf.estimator.Estimator(
      fn, config=_config(model_dir), params={"learning_rate": 0.05})


class _Trained(dict):
  """Each variant trained STEPS steps, evaluated and used to predict, when
  a test first asks for it (the default run leaves cpu2 out)."""

  def __init__(self, tmp_path_factory):
    super().__init__()
    self._tmp_path_factory = tmp_path_factory

  def __missing__(self, name):
    estimator = _estimator(name, self._tmp_path_factory.mktemp(name))
    estimator.train(_input_fn(), steps=STEPS)
    # 50 examples in batches of 16: the last batch has 2 (fewer than towers).
    metrics = estimator.evaluate(_input_fn(50, epochs=1))
    predictions = list(estimator.predict(_input_fn(50, epochs=1)))
    variables = {
        v: estimator.get_variable_value(v)
        for v in estimator.get_variable_names()
    }
    self[name] = (estimator, metrics, predictions, variables)
    return self[name]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  return _Trained(tmp_path_factory)


# 2 towers: test_long_run trains and evaluates this model_fn on 2 CPUs
# against the plain estimator in the default run.
TOWER_CASES = [harness.wide("cpu2"), "cpu4", "gpu4"]


@pytest.mark.parametrize("name", TOWER_CASES)
def test_trained_variables_match_plain(trained, name):
  _, _, _, expected = trained["plain"]
  _, _, _, actual = trained[name]
  assert sorted(actual) == sorted(expected)
  assert actual["global_step"] == STEPS
  for variable, value in expected.items():
    np.testing.assert_allclose(
        actual[variable], value, rtol=1e-4, atol=1e-6, err_msg=variable)


@pytest.mark.parametrize("name", TOWER_CASES)
def test_metrics_and_predictions_match_plain(trained, name):
  _, expected_metrics, expected_predictions, _ = trained["plain"]
  _, metrics, predictions, _ = trained[name]
  assert sorted(metrics) == ["accuracy", "auc", "global_step", "loss"]
  for key, value in expected_metrics.items():
    np.testing.assert_allclose(metrics[key], value, rtol=1e-4, err_msg=key)
  assert 0.3 < metrics["accuracy"] < 1.0
  assert len(predictions) == len(expected_predictions) == 50
  for got, want in zip(predictions, expected_predictions):
    assert got["classes"] == want["classes"]
    np.testing.assert_allclose(
        got["logits"], want["logits"], rtol=1e-4, atol=1e-5)


def test_checkpoint_from_four_towers_restores_into_plain(trained, tmp_path):
  four, _, four_predictions, _ = trained["cpu4"]
  plain = tf.estimator.Estimator(
      model_fn,
      model_dir=four.model_dir,
      config=_config(four.model_dir),
      params={"learning_rate": 0.05})
  predictions = list(plain.predict(_input_fn(50, epochs=1)))
  # Same weights, other batch sizes: a logit's rounding error is bounded by
  # the terms of its 16- and 5-term dot products (~20 * 2**-24 * 5), not by
  # the logit itself, which can be near 0.
  for got, want in zip(predictions, four_predictions):
    np.testing.assert_allclose(
        got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
  # And training resumes from it, slots included.
  plain.train(_input_fn(), steps=2)
  assert plain.get_variable_value("global_step") == STEPS + 2


def test_checkpoint_from_plain_restores_into_four_towers(trained):
  plain, _, plain_predictions, _ = trained["plain"]
  four = _estimator("cpu4", plain.model_dir)
  predictions = list(four.predict(_input_fn(50, epochs=1)))
  for got, want in zip(predictions, plain_predictions):
    np.testing.assert_allclose(
        got["logits"], want["logits"], rtol=1e-5, atol=1e-5)  # as above
