"""Regularization losses added to every tower's loss.

Variables are shared, so every tower's regularization term is the same
value (the v1 REGULARIZATION_LOSSES collection holds tower 0's terms only;
a Keras layer's `losses` read the shared weights). A loss term that reads
none of the towers' inputs counts once, tower 0's, whatever the reduction,
so the model_fn of one device is right under SUM too; adding the term in
tower 0 only (the former rule) still works.
"""

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness
from tests import models

Reduction = tf.compat.v1.losses.Reduction
L2 = 0.05


def _model_fn(features, labels, mode, params):
  regularizer = tf.keras.regularizers.l2(L2)
  x = features["x"]
  if params["layers"] == "v1":
    h = tf.compat.v1.layers.dense(
        x, 8, tf.nn.relu, name="hidden", kernel_regularizer=regularizer)
    logits = tf.compat.v1.layers.dense(
        h, models.NUM_CLASSES, name="logits", kernel_regularizer=regularizer)
    penalty = tf.compat.v1.losses.get_regularization_loss()
  elif params["layers"] == "total_loss":
    h = tf.compat.v1.layers.dense(
        x, 8, tf.nn.relu, name="hidden", kernel_regularizer=regularizer)
    logits = tf.compat.v1.layers.dense(
        h, models.NUM_CLASSES, name="logits", kernel_regularizer=regularizer)
    tf.compat.v1.losses.sparse_softmax_cross_entropy(
        labels, logits, reduction=params["reduction"])
    return _spec(mode, tf.compat.v1.losses.get_total_loss())
  else:
    hidden = tf.keras.layers.Dense(8, "relu", kernel_regularizer=regularizer)
    out = tf.keras.layers.Dense(
        models.NUM_CLASSES, kernel_regularizer=regularizer)
    logits = out(hidden(x))
    penalty = tf.add_n(hidden.losses + out.losses)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, logits, reduction=params["reduction"])
  tower = replicate.current_tower()
  if params["every_tower"] or tower is None or tower.index == 0:
    loss += penalty
  return _spec(mode, loss)


def _spec(mode, loss):
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1))
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _turns(cases):
  """(default, wide): each case (a dict of parameters) on 4 and 2 towers;
  the default run takes a case on one count, in staggered turns from 4."""
  return harness.in_turns(cases, [{
      "num_towers": 4
  }, {
      "num_towers": 2
  }], lambda i, j: j == (i + i // 2) % 2)


_AVERAGING = _turns([
    dict(layers=layers, reduction=reduction)
    for layers in ("v1", "keras")
    for reduction in (Reduction.MEAN, Reduction.SUM_BY_NONZERO_WEIGHTS)
])
_SUM = _turns([dict(layers=layers) for layers in ("v1", "keras", "total_loss")])
_HEAD = _turns([dict(reduction=r) for r in ("sum", "sum_over_batch_size")])


def _train(num_towers, layers, reduction, every_tower):
  tower_devices = (None if num_towers == 1 else harness.devices(
      harness.VIRTUAL_CPUS, num_towers))
  return harness.train(
      _model_fn,
      models.data(24),
      batch_size=10,
      steps=3,
      tower_devices=tower_devices,
      reduction=reduction,
      params=dict(layers=layers, reduction=reduction, every_tower=every_tower))


class RegularizationTest(parameterized.TestCase):

  @parameterized.parameters(*_AVERAGING[0])
  def test_averaging_reduction_counts_the_penalty_once(self, **case):
    self._check_averaging(**case)

  @parameterized.parameters(*_AVERAGING[1])
  @pytest.mark.wide
  def test_averaging_reduction_counts_the_penalty_once_wide(self, **case):
    self._check_averaging(**case)

  def _check_averaging(self, num_towers, layers, reduction):
    expected = _train(1, layers, reduction, every_tower=True)
    actual = _train(num_towers, layers, reduction, every_tower=True)
    harness.assert_close_nests(actual, expected)

  @parameterized.parameters(*_SUM[0])
  def test_sum_counts_the_penalty_once(self, **case):
    self._check_sum(**case)

  @parameterized.parameters(*_SUM[1])
  @pytest.mark.wide
  def test_sum_counts_the_penalty_once_wide(self, **case):
    self._check_sum(**case)

  def _check_sum(self, num_towers, layers):
    expected = _train(1, layers, Reduction.SUM, every_tower=True)
    actual = _train(num_towers, layers, Reduction.SUM, every_tower=True)
    harness.assert_close_nests(actual, expected)

  @parameterized.parameters("v1", "keras")
  def test_sum_with_the_penalty_in_tower_0_matches_one_device(self, layers):
    expected = _train(1, layers, Reduction.SUM, every_tower=True)
    actual = _train(4, layers, Reduction.SUM, every_tower=False)
    harness.assert_close_nests(actual, expected)


def _head_model_fn(features, labels, mode, params):
  """A v2 head given the Keras layers' penalties as regularization_losses."""
  dense = tf.keras.layers.Dense(
      1, name="dense", kernel_regularizer=tf.keras.regularizers.l2(0.5))
  logits = dense(features["x"])
  head = tf.estimator.RegressionHead(loss_reduction=params["reduction"])
  return head.create_estimator_spec(
      features,
      mode,
      logits,
      labels=labels,
      optimizer=replicate.TowerOptimizer(tf.keras.optimizers.legacy.SGD(0.1)),
      trainable_variables=dense.trainable_weights,
      regularization_losses=dense.losses)


class HeadRegularizationTest(parameterized.TestCase):
  """Eval loss, the head's metrics ('regularization_loss' too) and training
  of a v2 head with regularization_losses, 7 rows (uneven) per batch."""

  @parameterized.parameters(*_HEAD[0])
  def test_train_and_eval_match_one_device(self, **case):
    self._check_head(**case)

  @parameterized.parameters(*_HEAD[1])
  @pytest.mark.wide
  def test_train_and_eval_match_one_device_wide(self, **case):
    self._check_head(**case)

  def _check_head(self, num_towers, reduction):
    rng = np.random.RandomState(2)
    data = ({
        "x": rng.randn(14, 3).astype(np.float32)
    }, rng.randn(14, 1).astype(np.float32))
    tower_devices = harness.devices(harness.VIRTUAL_CPUS, num_towers)
    params = {"reduction": reduction}
    run = lambda mode, devices=None: mode(
        _head_model_fn, data, 7, 2, devices, reduction=reduction, params=params)
    expected = run(harness.evaluate)
    actual = run(harness.evaluate, tower_devices)
    self.assertIn("regularization_loss", actual[1])
    harness.assert_close_nests(actual, expected)
    harness.assert_close_nests(
        run(harness.train, tower_devices), run(harness.train))


if __name__ == "__main__":
  tf.test.main()
