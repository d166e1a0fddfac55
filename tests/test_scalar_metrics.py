"""A metric fed a per-batch scalar gets one device's value, or an error.

One device adds the whole batch's scalar once per batch to a metric of it
(`tf.compat.v1.metrics.mean(loss)`, a Keras `Mean` of the loss, MultiHead's
per-head `loss/<head>`); replicated, tower 0 adds the whole batch's value
and the other towers nothing. Evaluated over 7 examples in batches of 5
(5, then 2: uneven, dynamic, phantom rows on 4 towers) against one device.
A scalar with no whole-batch value (a batch's maximum) is a ValueError
naming the metric.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

NUM_EXAMPLES, BATCH = 7, 5
EVAL = tf.estimator.ModeKeys.EVAL


def _data():
  rng = np.random.RandomState(5)
  x = rng.randn(NUM_EXAMPLES, 2).astype(np.float32)
  y = np.array([0., 4., -1., 9., 2., 6., -3.], np.float32)[:, None]
  return {"x": x}, y


def _batches():
  dataset = tf.data.Dataset.from_tensor_slices(_data()).batch(BATCH)
  return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def _predictions(features):
  return tf.compat.v1.layers.dense(
      features["x"], 1, kernel_initializer=tf.constant_initializer([0.5, -1.]))


def _scalar_metrics_model_fn(features, labels, mode):
  predictions = _predictions(features)
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  keras_mean = tf.keras.metrics.Mean(name="keras_mean_loss")
  keras_mean.update_state(loss)
  # A weighted mean that is not the loss, and a sum over the batch.
  weighted = tf.compat.v1.losses.absolute_difference(
      labels, predictions, weights=tf.abs(labels), loss_collection=None)
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      eval_metric_ops={
          "mean_loss": tf.compat.v1.metrics.mean(loss),
          "keras_mean_loss": keras_mean,
          "mean_weighted": tf.compat.v1.metrics.mean(weighted),
          "mean_sum": tf.compat.v1.metrics.mean(tf.reduce_sum(labels)),
          "per_example": tf.compat.v1.metrics.mean(predictions),
      })


def _multi_head_model_fn(features, labels, mode, params):
  reduction = params["reduction"]
  heads = [
      tf.estimator.RegressionHead(name="a", loss_reduction=reduction),
      tf.estimator.RegressionHead(
          name="b", weight_column="w", loss_reduction=reduction)
  ]
  head = tf.estimator.MultiHead(heads)
  logits = {"a": _predictions(features), "b": 2.0 * _predictions(features)}
  features = dict(features, w=tf.abs(labels))
  spec = head.create_estimator_spec(
      features, mode, logits, labels={
          "a": labels,
          "b": labels - 1.0
      })
  # Only what EVAL needs (MultiHead's tuple prediction keys are merged
  # elsewhere).
  return tf.estimator.EstimatorSpec(
      mode, loss=spec.loss, eval_metric_ops=spec.eval_metric_ops)


@functools.lru_cache(maxsize=None)
def _evaluate(model_fn, num_towers, reduction=None):
  """The eval set once: the metrics' values (one device's computed once).

  `reduction`: a Keras reduction the model_fn's heads use (its `params`).
  """
  with tf.Graph().as_default():
    features, labels = _batches()
    kwargs = {}
    if reduction:
      kwargs = {"params": {"reduction": reduction}}
    if num_towers:
      model_fn = replicate.replicate_model_fn(
          model_fn,
          devices=[f"/device:CPU:{i}" for i in range(num_towers)],
          loss_reduction=reduction or MEAN)
    spec = model_fn(features, labels, EVAL, **kwargs)
    updates = [op for _, op in spec.eval_metric_ops.values()]
    with tf.compat.v1.Session(
        config=replicate.testing.session_config(4)) as session:
      session.run([
          tf.compat.v1.global_variables_initializer(),
          tf.compat.v1.local_variables_initializer()
      ])
      for _ in range(2):
        session.run(updates)
      return session.run({k: v for k, (v, _) in spec.eval_metric_ops.items()})


SUM = tf.keras.losses.Reduction.SUM
MEAN = tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE


# The default run: the averaging heads on 4 towers (phantom rows), the
# summing ones on 2.
@pytest.mark.parametrize("model_fn, reduction, num_towers", [
    (_scalar_metrics_model_fn, None, 4),
    (_multi_head_model_fn, MEAN, 4),
    (_multi_head_model_fn, SUM, 2),
    harness.wide(_scalar_metrics_model_fn, None, 2),
    harness.wide(_multi_head_model_fn, MEAN, 2),
    harness.wide(_multi_head_model_fn, SUM, 4),
])
def test_metrics_of_per_batch_scalars_are_one_devices(model_fn, reduction,
                                                      num_towers):
  expected = _evaluate(model_fn, None, reduction)
  actual = _evaluate(model_fn, num_towers, reduction)
  assert set(actual) == set(expected)
  for key in expected:
    np.testing.assert_allclose(
        actual[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)


def _max_model_fn(features, labels, mode):
  predictions = _predictions(features)
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  train_op = None
  if mode == tf.estimator.ModeKeys.TRAIN:
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1))
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=train_op,
      eval_metric_ops={
          "largest_label": tf.compat.v1.metrics.mean(tf.reduce_max(labels))
      })


@pytest.mark.parametrize("num_towers", [harness.wide(2), 4])
def test_metric_of_per_batch_maximum_is_one_devices(num_towers):
  # The batch's maximum is the whole batch's in every tower.
  expected = _evaluate(_max_model_fn, None)
  assert _evaluate(_max_model_fn, num_towers) == expected


def test_metric_of_per_batch_maximum_trains():
  """TRAIN never runs eval_metric_ops: no error for a metric it never runs."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = _batches()
    replicate.replicate_model_fn(
        _max_model_fn, devices=["/device:CPU:0",
                                "/device:CPU:1"])(features, labels,
                                                  tf.estimator.ModeKeys.TRAIN)


def _loss_through_a_reduction_model_fn(features, labels, mode):
  """The loss itself reduces a rank-0 value; a hand-made metric writes it."""
  predictions = _predictions(features)
  loss = tf.reduce_sum(
      tf.compat.v1.losses.mean_squared_error(labels, predictions))
  total = tf.compat.v1.get_local_variable(
      "total", [],
      initializer=tf.zeros_initializer(),
      aggregation=tf.VariableAggregation.SUM)
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      eval_metric_ops={
          "mean_loss": tf.compat.v1.metrics.mean(loss),
          "total": (tf.identity(total), total.assign_add(loss))
      })


@pytest.mark.parametrize("num_towers", [harness.wide(2), 4])
def test_loss_computed_through_a_reduction_stays_the_models(num_towers):
  expected = _evaluate(_loss_through_a_reduction_model_fn, None)
  actual = _evaluate(_loss_through_a_reduction_model_fn, num_towers)
  # The metric of the loss is one device's; the loss's own reduction is not
  # rewired to the whole batch's (the hand-made `total` adds the towers'
  # losses by its aggregation, as before).
  np.testing.assert_allclose(
      actual["mean_loss"], expected["mean_loss"], rtol=1e-5, atol=1e-6)
