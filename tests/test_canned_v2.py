"""The v2 canned estimators (Keras legacy optimizers) replicate as they are.

For each canned estimator: replicated over 2 and 4 towers, trained and
evaluated, it matches the plain estimator on the same data and seed; it
predicts the same; its exported model serves the same; and its checkpoint
restores into the plain canned estimator.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness
from tests import models

COLUMNS = [tf.feature_column.numeric_column("x", shape=(models.NUM_FEATURES,))]
Adagrad = tf.keras.optimizers.legacy.Adagrad


def _config(model_dir):
  return harness.estimator_config(model_dir, seed=7)


CANNED = {
    "dnn_classifier":
        lambda config: tf.estimator.DNNClassifier(
            hidden_units=[8],
            feature_columns=COLUMNS,
            n_classes=3,
            optimizer=replicate.TowerOptimizer(Adagrad(0.05)),
            config=config),
    "dnn_regressor":
        lambda config: tf.estimator.DNNRegressor(
            hidden_units=[8],
            feature_columns=COLUMNS,
            optimizer=replicate.TowerOptimizer(Adagrad(0.05)),
            config=config),
    "linear_classifier":
        lambda config: tf.estimator.LinearClassifier(
            feature_columns=COLUMNS,
            n_classes=3,
            optimizer=replicate.TowerOptimizer(
                tf.keras.optimizers.legacy.Ftrl(0.1)),
            config=config),
    "linear_regressor":
        lambda config: tf.estimator.LinearRegressor(
            feature_columns=COLUMNS,
            optimizer=replicate.TowerOptimizer(lambda: Adagrad(0.1)),
            config=config),
    "dnn_linear_combined":
        lambda config: (tf.estimator.DNNLinearCombinedClassifier(
            linear_feature_columns=COLUMNS,
            dnn_feature_columns=COLUMNS,
            dnn_hidden_units=[8],
            n_classes=3,
            linear_optimizer=replicate.TowerOptimizer(Adagrad(0.1)),
            dnn_optimizer=replicate.TowerOptimizer(lambda: Adagrad(0.05)),
            config=config)),
}
REGRESSORS = ("dnn_regressor", "linear_regressor")


def _input_fn(canned, num_examples=48, epochs=None, with_labels=True):
  features, labels = models.data(num_examples)
  if canned in REGRESSORS:
    labels = (features["x"][:, :1] * 2.0 - 1.0).astype(np.float32)

  def input_fn():
    data = (features, labels) if with_labels else features
    return tf.data.Dataset.from_tensor_slices(data).repeat(epochs).batch(16)

  return input_fn


def _estimator(canned, num_towers, model_dir):
  estimator = CANNED[canned](_config(model_dir))
  if num_towers is None:
    return estimator
  return tf.estimator.Estimator(
      replicate.replicate_model_fn(
          estimator.model_fn,
          devices=[f"/device:CPU:{i}" for i in range(num_towers)]),
      config=_config(model_dir))


@functools.lru_cache(maxsize=None)
def _run(canned, num_towers, model_dir):
  estimator = _estimator(canned, num_towers, model_dir)
  estimator.train(_input_fn(canned), steps=6)
  metrics = estimator.evaluate(_input_fn(canned, 40, epochs=1))
  predictions = list(
      estimator.predict(_input_fn(canned, 40, epochs=1, with_labels=False)))
  return estimator, metrics, predictions


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
  """One model_dir per (canned, towers), so that _run's cache is hit."""
  return functools.lru_cache(maxsize=None)(
      lambda canned, towers: str(tmp_path_factory.mktemp(f"{canned}_{towers}")))


def _prediction_key(canned):
  return "predictions" if canned in REGRESSORS else "probabilities"


# Every canned estimator on 4 towers; two of them on 2 as well. The
# default run leaves out the 2-tower runs, dnn_regressor (dnn_classifier's
# network and optimizer, linear_regressor's head) and linear_classifier
# (linear_regressor's network, dnn_classifier's head; Ftrl is in
# test_inputs.py).
@pytest.mark.parametrize("canned,num_towers", [
    ("dnn_classifier", 4),
    ("dnn_linear_combined", 4),
    harness.wide("dnn_regressor", 4, id="dnn_regressor-4"),
    harness.wide("linear_classifier", 4, id="linear_classifier-4"),
    ("linear_regressor", 4),
    harness.wide("dnn_classifier", 2, id="dnn_classifier-2"),
    harness.wide("linear_regressor", 2, id="linear_regressor-2"),
])
def test_replicated_canned_matches_plain(canned, num_towers, model_dirs):
  plain, expected_metrics, expected_predictions = _run(
      canned, None, model_dirs(canned, "plain"))
  estimator, metrics, predictions = _run(canned, num_towers,
                                         model_dirs(canned, num_towers))
  assert sorted(estimator.get_variable_names()) == sorted(
      plain.get_variable_names())
  for name in plain.get_variable_names():
    np.testing.assert_allclose(
        estimator.get_variable_value(name),
        plain.get_variable_value(name),
        rtol=1e-4,
        atol=1e-6,
        err_msg=name)
  assert metrics["global_step"] == 6  # one increment per step, not per tower
  assert sorted(metrics) == sorted(expected_metrics)
  for key, value in expected_metrics.items():
    np.testing.assert_allclose(metrics[key], value, rtol=1e-4, err_msg=key)
  key = _prediction_key(canned)
  np.testing.assert_allclose([p[key] for p in predictions],
                             [p[key] for p in expected_predictions],
                             rtol=1e-4,
                             atol=1e-6)


def test_dnn_linear_combined_advances_both_iteration_counters(model_dirs):
  estimator, _, _ = _run("dnn_linear_combined", 4,
                         model_dirs("dnn_linear_combined", 4))
  assert estimator.get_variable_value("global_step") == 6
  assert estimator.get_variable_value("training/Adagrad_1/iter") == 6


@pytest.mark.parametrize("canned", ["dnn_classifier", "linear_regressor"])
def test_export_serves_the_same_and_checkpoint_restores_into_plain(
    canned, model_dirs, tmp_path):
  estimator, _, predictions = _run(canned, 4, model_dirs(canned, 4))
  receiver = tf.estimator.export.build_parsing_serving_input_receiver_fn(
      tf.feature_column.make_parse_example_spec(COLUMNS))
  export_dir = estimator.export_saved_model(str(tmp_path), receiver)
  x = models.data(40)[0]["x"][:5]
  loaded = tf.saved_model.load(export_dir)
  examples = [
      tf.train.Example(
          features=tf.train.Features(feature={
              "x": tf.train.Feature(float_list=tf.train.FloatList(value=row))
          })).SerializeToString() for row in x
  ]
  outputs = loaded.signatures["predict"](examples=tf.constant(examples))
  key = _prediction_key(canned)
  # Other batch sizes: a regressor's prediction (a 5-term dot product) can
  # be near 0, its rounding error (~5 * 2**-24 * sum|x w|) cannot.
  np.testing.assert_allclose(
      outputs[key].numpy(), [p[key] for p in predictions[:5]],
      rtol=1e-5,
      atol=1e-6)
  plain = CANNED[canned](_config(estimator.model_dir))
  restored = list(plain.predict(_input_fn(canned, 40, 1, with_labels=False)))
  np.testing.assert_allclose([p[key] for p in restored],
                             [p[key] for p in predictions],
                             rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("num_towers", [harness.wide(2, id="2"), 4])
def test_batch_norm_dnn_trains_as_one_device_with_plain_checkpoint_names(
    tmp_path, num_towers):
  """batch_norm=True: the towers normalise with the whole batch's statistics."""

  def canned(model_dir):
    return tf.estimator.DNNClassifier(
        hidden_units=[8],
        feature_columns=COLUMNS,
        n_classes=3,
        batch_norm=True,
        optimizer=replicate.TowerOptimizer(Adagrad(0.05)),
        config=_config(model_dir))

  plain = canned(tmp_path / "plain")
  plain.train(_input_fn("dnn_classifier"), steps=3)
  replicated = tf.estimator.Estimator(
      replicate.replicate_model_fn(
          canned(tmp_path / "unused").model_fn,
          devices=[f"/device:CPU:{i}" for i in range(num_towers)]),
      config=_config(tmp_path / "replicated"))
  replicated.train(_input_fn("dnn_classifier"), steps=3)
  assert sorted(replicated.get_variable_names()) == sorted(
      plain.get_variable_names())
  for name in plain.get_variable_names():
    np.testing.assert_allclose(
        replicated.get_variable_value(name),
        plain.get_variable_value(name),
        rtol=1e-5,
        atol=1e-6,
        err_msg=name)
  moved = plain.get_variable_value("dnn/hiddenlayer_0/batchnorm_0/moving_mean")
  assert np.abs(moved).max() > 0


def test_any_loss_reduction_for_an_averaging_canned_head_is_one_devices(
    tmp_path):
  # The whole batch's loss comes from the head's own ops: a loss_reduction
  # that says otherwise (SUM for an averaging head) changes nothing.
  plain = CANNED["dnn_classifier"](_config(tmp_path / "plain"))
  plain.train(_input_fn("dnn_classifier"), steps=3)
  replicated = tf.estimator.Estimator(
      replicate.replicate_model_fn(
          CANNED["dnn_classifier"](_config(tmp_path / "unused")).model_fn,
          loss_reduction=tf.compat.v1.losses.Reduction.SUM,
          devices=["/device:CPU:0", "/device:CPU:1"]),
      config=_config(tmp_path / "replicated"))
  replicated.train(_input_fn("dnn_classifier"), steps=3)
  for name in plain.get_variable_names():
    np.testing.assert_allclose(
        replicated.get_variable_value(name),
        plain.get_variable_value(name),
        rtol=1e-5,
        atol=1e-6,
        err_msg=name)
