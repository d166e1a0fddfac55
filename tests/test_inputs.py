"""Sparse, dict and missing inputs; several optimizers; unused variables.

Each case trains N towers and one device on the same data and weights and
compares losses and trained variables.
"""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import replicate
from tests import harness

VOCABULARY = 20


def _sparse_data(num_examples=32, seed=1):
  """Bags of word ids as a SparseTensorValue, a dense feature and labels."""
  rng = np.random.RandomState(seed)
  indices, ids = [], []
  for row in range(num_examples):
    for column in range(rng.randint(1, 4)):
      indices.append([row, column])
      ids.append(rng.randint(VOCABULARY))
  words = tf.compat.v1.SparseTensorValue(
      np.array(indices, np.int64), np.array(ids, np.int64), [num_examples, 3])
  dense = rng.randn(num_examples, 2).astype(np.float32)
  labels = {"class": rng.randint(2, size=num_examples).astype(np.int64),
            "target": rng.randn(num_examples, 1).astype(np.float32)}
  return {"words": words, "dense": dense}, labels


def _sparse_batches(batch_size):
  """A fixed batch built from constants (SparseTensor does not batch simply)."""
  features, labels = _sparse_data(batch_size)
  words = tf.SparseTensor.from_value(features["words"])
  return ({"words": words, "dense": tf.constant(features["dense"])},
          tf.nest.map_structure(tf.constant, labels))


def sparse_model_fn(features, labels, mode, params):
  """Embedding bag (IndexedSlices gradients) + two heads and two optimizers."""
  embeddings = tf.compat.v1.get_variable(
      "embeddings", [VOCABULARY, 4],
      initializer=tf.compat.v1.random_normal_initializer(seed=3))
  bag = tf.nn.embedding_lookup_sparse(embeddings, features["words"], None,
                                      combiner="mean")
  hidden = tf.concat([bag, features["dense"]], axis=1)
  logits = tf.compat.v1.layers.dense(hidden, 2, name="classifier")
  regression = tf.compat.v1.layers.dense(hidden, 1, name="regressor")
  unused = tf.compat.v1.get_variable("unused", [3])  # gets no gradient
  del unused
  class_loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels["class"], logits)
  target_loss = tf.compat.v1.losses.mean_squared_error(
      labels["target"], regression)
  loss = class_loss + target_loss
  step = tf.compat.v1.train.get_global_step()
  first = replicate.TowerOptimizer(tf.compat.v1.train.AdagradOptimizer(0.5))
  second = replicate.TowerOptimizer(
      lambda: tf.compat.v1.train.GradientDescentOptimizer(0.2))
  classifier_vars = [v for v in tf.compat.v1.trainable_variables()
                     if not v.op.name.startswith("regressor")]
  regressor_vars = [v for v in tf.compat.v1.trainable_variables()
                    if v.op.name.startswith("regressor")]
  train_op = tf.group(
      first.minimize(class_loss, step, var_list=classifier_vars),
      second.minimize(target_loss, var_list=regressor_vars))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _train_sparse(tower_devices, steps=3, batch_size=8):
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features, labels = _sparse_batches(batch_size)
    spec = harness.wrap(sparse_model_fn, tower_devices)(
        features, labels, tf.estimator.ModeKeys.TRAIN, {})
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      losses, values = harness.run_training(session, spec, steps)
  return graph, losses, values


class SparseDictAndOptimizersTest(parameterized.TestCase):

  @parameterized.parameters(2, 3, 4)
  def test_match_one_device(self, num_towers):
    _, expected_losses, expected = _train_sparse(None)
    graph, losses, values = _train_sparse(
        harness.devices(harness.VIRTUAL_CPUS, num_towers))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    self.assertEqual(sorted(values), sorted(expected))
    harness.assert_close_nests(values, expected)
    self.assertEqual(values["global_step"], 3)  # incremented once per step
    # The unused variable got no gradient and kept its initial value.
    np.testing.assert_array_equal(values["unused"],
                                  harness.initial_value("unused", (3,), tf.float32))
    # The embedding gradients were concatenated, never densified.
    applies = {op.type for op in graph.get_operations()
               if op.type.startswith("Resource") and "Apply" in op.type}
    self.assertIn("ResourceSparseApplyAdagrad", applies)
    concat = graph.get_operation_by_name("gradient_sum/concat_1")
    self.assertEqual(concat.outputs[0].dtype, tf.int64)  # the indices


def _unsupervised_model_fn(features, labels, mode):
  """labels=None: an autoencoder-ish loss on the features alone."""
  assert labels is None
  code = tf.compat.v1.layers.dense(features["x"], 2, name="encode")
  output = tf.compat.v1.layers.dense(code, 5, name="decode")
  loss = tf.compat.v1.losses.mean_squared_error(features["x"], output)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(
          loss, tf.compat.v1.train.get_global_step()))


class LabelsNoneTest(parameterized.TestCase):

  @parameterized.parameters(2, 4)
  def test_labels_none_matches_one_device(self, num_towers):
    x = np.random.RandomState(5).randn(16, 5).astype(np.float32)

    def run(tower_devices):
      with tf.Graph().as_default():
        tf.compat.v1.train.create_global_step()
        spec = harness.wrap(_unsupervised_model_fn, tower_devices)(
            {"x": tf.constant(x)}, None, tf.estimator.ModeKeys.TRAIN)
        with tf.compat.v1.Session(config=harness.session_config()) as session:
          session.run(tf.compat.v1.global_variables_initializer())
          harness.set_trainable_weights(session)
          return [session.run([spec.loss, spec.train_op])[0] for _ in range(3)]
    expected = run(None)
    self.assertGreater(expected[0] - expected[-1], 1e-3)  # it trains
    np.testing.assert_allclose(
        run(harness.devices(harness.VIRTUAL_CPUS, num_towers)), expected,
        rtol=1e-5)


class UnusedBranchTest(parameterized.TestCase):

  def test_variable_only_in_branch_not_taken_is_skipped(self):
    def model_fn(features, labels, mode, params):
      del params
      logits = tf.compat.v1.layers.dense(features["x"], 3, name="logits")
      extra = tf.compat.v1.get_variable("extra", [3])
      logits = tf.cond(tf.constant(False), lambda: logits + extra,
                       lambda: logits)
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      opt = replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1))
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=opt.minimize(
          loss, tf.compat.v1.train.get_global_step()))
    rng = np.random.RandomState(0)
    data = ({"x": rng.randn(16, 5).astype(np.float32)},
            rng.randint(3, size=16).astype(np.int64))
    expected = harness.train(model_fn, data, 8, 3)
    actual = harness.train(model_fn, data, 8, 3, tower_devices=harness.devices(
        harness.VIRTUAL_CPUS, 2))
    harness.assert_close_nests(actual, expected)


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()
