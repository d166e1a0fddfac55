"""Regularization losses added to every tower's loss.

Variables are shared, so every tower's regularization term is the same
tensor (the v1 REGULARIZATION_LOSSES collection holds tower 0's terms only;
a Keras layer's `losses` read the shared weights). An averaging reduction
weights the towers' losses by their shares, which sum to one, so the term
counts once, as on one device. With `SUM` the towers' losses are added, so
a model_fn adds the term in tower 0 only (what the README says).
"""

from absl.testing import parameterized
import numpy as np
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
    h = tf.compat.v1.layers.dense(x, 8, tf.nn.relu, name="hidden",
                                  kernel_regularizer=regularizer)
    logits = tf.compat.v1.layers.dense(h, models.NUM_CLASSES, name="logits",
                                       kernel_regularizer=regularizer)
    penalty = tf.compat.v1.losses.get_regularization_loss()
  else:
    hidden = tf.keras.layers.Dense(8, "relu", kernel_regularizer=regularizer)
    out = tf.keras.layers.Dense(models.NUM_CLASSES,
                                kernel_regularizer=regularizer)
    logits = out(hidden(x))
    penalty = tf.add_n(hidden.losses + out.losses)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, logits, reduction=params["reduction"])
  tower = replicate.current_tower()
  if params["every_tower"] or tower is None or tower.index == 0:
    loss += penalty
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1))
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _train(num_towers, layers, reduction, every_tower):
  tower_devices = (None if num_towers == 1 else
                   harness.devices(harness.VIRTUAL_CPUS, num_towers))
  return harness.train(
      _model_fn, models.data(24), batch_size=10, steps=3,
      tower_devices=tower_devices, reduction=reduction,
      params=dict(layers=layers, reduction=reduction,
                  every_tower=every_tower))


class RegularizationTest(parameterized.TestCase):

  @parameterized.product(num_towers=[2, 4], layers=["v1", "keras"],
                         reduction=[Reduction.MEAN,
                                    Reduction.SUM_BY_NONZERO_WEIGHTS])
  def test_averaging_reduction_counts_the_penalty_once(
      self, num_towers, layers, reduction):
    expected = _train(1, layers, reduction, every_tower=True)
    actual = _train(num_towers, layers, reduction, every_tower=True)
    harness.assert_close_nests(actual, expected)

  @parameterized.parameters("v1", "keras")
  def test_sum_with_the_penalty_in_tower_0_matches_one_device(self, layers):
    expected = _train(1, layers, Reduction.SUM, every_tower=True)
    actual = _train(4, layers, Reduction.SUM, every_tower=False)
    harness.assert_close_nests(actual, expected)

  def test_sum_with_the_penalty_in_every_tower_counts_it_per_tower(self):
    """The documented pitfall: N towers add N penalties under SUM."""
    plain_losses, _ = _train(1, "v1", Reduction.SUM, every_tower=True)
    losses, _ = _train(4, "v1", Reduction.SUM, every_tower=True)
    first_penalty = L2 * sum(
        np.sum(np.square(harness.initial_value(name, shape, tf.float32)))
        for name, shape in (("hidden/kernel", (models.NUM_FEATURES, 8)),
                            ("logits/kernel", (8, models.NUM_CLASSES))))
    np.testing.assert_allclose(losses[0], plain_losses[0] + 3 * first_penalty,
                               rtol=1e-5)


if __name__ == "__main__":
  tf.test.main()
