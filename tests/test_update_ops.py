"""Batch normalization and other update ops, and summaries, across towers.

What the README documents: only tower 0's update ops change the model's
state (later towers' writes are discarded), so moving statistics get one
update per step, from tower 0's shard (never an empty one); summaries are
tower 0's, under the unwrapped model's names.
"""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import replicate
from tests import harness

MOMENTUM = 0.9
X = np.arange(8 * 2, dtype=np.float32).reshape(8, 2) / 4.0  # rows differ


def _model_fn(layers):
  def model_fn(features, labels, mode):
    x = features["x"]
    tf.compat.v1.summary.scalar("x_mean", tf.reduce_mean(x))
    if layers == "v1":
      normalized = tf.compat.v1.layers.batch_normalization(
          x, momentum=MOMENTUM, training=True, name="bn")
      update_ops = tf.compat.v1.get_collection(
          tf.compat.v1.GraphKeys.UPDATE_OPS)
    else:
      layer = tf.keras.layers.BatchNormalization(momentum=MOMENTUM, name="bn")
      normalized = layer(x, training=True)
      update_ops = layer.updates
    logits = tf.compat.v1.layers.dense(normalized, 2, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with tf.control_dependencies(update_ops):
      train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def _train_one_step(layers, tower_devices, batch=8):
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    spec = harness.wrap(_model_fn(layers), tower_devices)(
        {"x": tf.constant(X[:batch])}, tf.constant(np.arange(batch) % 2),
        tf.estimator.ModeKeys.TRAIN)
    summaries = [t.op.name for t in tf.compat.v1.get_collection(
        tf.compat.v1.GraphKeys.SUMMARIES)]
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run([tf.compat.v1.global_variables_initializer(),
                   tf.compat.v1.local_variables_initializer()])
      session.run(spec.train_op)
      stats = {v.op.name.split("/")[-1]: session.run(v)
               for v in tf.compat.v1.global_variables()
               if v.op.name.startswith("bn/moving")}
      names = sorted(v.op.name for v in tf.compat.v1.global_variables())
  return stats, summaries, names, graph


def _expected(shard):
  mean = shard.mean(axis=0)
  variance = shard.var(axis=0)
  return {"moving_mean": (1 - MOMENTUM) * mean,
          "moving_variance": MOMENTUM + (1 - MOMENTUM) * variance}


class UpdateOpsTest(parameterized.TestCase):

  @parameterized.product(layers=("v1", "keras"), num_towers=(1, 2, 4))
  def test_moving_statistics_come_from_tower_zeros_shard(
      self, layers, num_towers):
    stats, _, names, _ = _train_one_step(
        layers, harness.devices(harness.VIRTUAL_CPUS, num_towers))
    shard = X[:8 // num_towers]
    for key, value in _expected(shard).items():
      np.testing.assert_allclose(stats[key], value, rtol=1e-5, err_msg=key)
    plain_names = _train_one_step(layers, None)[2]
    self.assertEqual(names, plain_names)  # one set of statistics, same names

  def test_one_device_updates_from_the_whole_batch(self):
    stats = _train_one_step("v1", None)[0]
    for key, value in _expected(X).items():
      np.testing.assert_allclose(stats[key], value, rtol=1e-5)

  def test_uneven_batch_smaller_than_towers_never_updates_from_nothing(self):
    stats, _, _, _ = _train_one_step(
        "v1", harness.devices(harness.VIRTUAL_CPUS, 4), batch=3)
    # Shards of 1, 1, 1, 0 rows: tower 0 has row 0.
    np.testing.assert_allclose(stats["moving_mean"], (1 - MOMENTUM) * X[0],
                               rtol=1e-5)
    self.assertTrue(np.all(np.isfinite(stats["moving_variance"])))


class SummariesTest(parameterized.TestCase):

  def test_only_tower_zeros_summaries_are_kept_with_unwrapped_names(self):
    _, summaries, _, graph = _train_one_step(
        "v1", harness.devices(harness.VIRTUAL_CPUS, 4))
    self.assertEqual(summaries, ["x_mean"])
    # The other towers' summary ops exist but nothing collects them.
    self.assertIn("tower_1/x_mean", {op.name for op in graph.get_operations()})
    self.assertEqual(_train_one_step("v1", None)[1], ["x_mean"])


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()


class StateWritesTest(parameterized.TestCase):

  @staticmethod
  def _model_fn(features, labels, mode, params):
    del params
    frozen = tf.keras.layers.Dense(
        3, trainable=False, name="frozen",
        kernel_initializer=tf.keras.initializers.GlorotUniform(seed=4))
    hidden = frozen(features["x"])
    logits = tf.compat.v1.layers.dense(hidden, 2, name="logits")
    counter = tf.compat.v1.get_variable(
        "examples_seen", [], tf.int64, trainable=False,
        initializer=tf.compat.v1.zeros_initializer())
    count = counter.assign_add(tf.shape(features["x"], out_type=tf.int64)[0])
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with tf.control_dependencies([count]):
      train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  @parameterized.parameters(("shared", 2), ("round_robin", 4))
  def test_frozen_weights_are_read_and_counters_advance_once(
      self, placement, num_towers):
    data = ({"x": X}, (np.arange(8) % 2).astype(np.int64))
    expected_losses, expected = harness.train(self._model_fn, data, 8, 3)
    losses, values = harness.train(
        self._model_fn, data, 8, 3,
        tower_devices=harness.devices(harness.VIRTUAL_CPUS, num_towers),
        placement=placement)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    counted = "examples_seen"
    harness.assert_close_nests(
        {k: v for k, v in values.items() if k != counted},
        {k: v for k, v in expected.items() if k != counted})
    # Tower 0 counts its own shard; the other towers' counts are discarded.
    self.assertEqual(expected["examples_seen"], 3 * 8)
    self.assertEqual(values["examples_seen"], 3 * (8 // num_towers))
