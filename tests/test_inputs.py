"""Sparse, ragged, dict and missing inputs; scalar predictions; several
optimizers; unused variables.

Each case runs N towers and one device on the same data and weights and
compares losses, trained variables, metrics and predictions.
"""

from absl.testing import parameterized
import numpy as np
import pytest
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
  labels = {
      "class": rng.randint(2, size=num_examples).astype(np.int64),
      "target": rng.randn(num_examples, 1).astype(np.float32)
  }
  return {"words": words, "dense": dense}, labels


def _sparse_batches(batch_size):
  """A fixed batch built from constants (SparseTensor does not batch simply)."""
  features, labels = _sparse_data(batch_size)
  words = tf.SparseTensor.from_value(features["words"])
  return ({
      "words": words,
      "dense": tf.constant(features["dense"])
  }, tf.nest.map_structure(tf.constant, labels))


def sparse_model_fn(features, labels, mode, params):
  """Embedding bag (IndexedSlices gradients) + two heads and two optimizers."""
  embeddings = tf.compat.v1.get_variable(
      "embeddings", [VOCABULARY, 4],
      initializer=tf.compat.v1.random_normal_initializer(seed=3))
  bag = tf.nn.embedding_lookup_sparse(
      embeddings, features["words"], None, combiner="mean")
  hidden = tf.concat([bag, features["dense"]], axis=1)
  logits = tf.compat.v1.layers.dense(hidden, 2, name="classifier")
  regression = tf.compat.v1.layers.dense(hidden, 1, name="regressor")
  unused = tf.compat.v1.get_variable("unused", [3])  # gets no gradient
  del unused
  class_loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels["class"], logits)
  target_loss = tf.compat.v1.losses.mean_squared_error(labels["target"],
                                                       regression)
  loss = class_loss + target_loss
  step = tf.compat.v1.train.get_global_step()
  first = replicate.TowerOptimizer(tf.compat.v1.train.AdagradOptimizer(0.5))
  second = replicate.TowerOptimizer(
      lambda: tf.compat.v1.train.GradientDescentOptimizer(0.2))
  classifier_vars = [
      v for v in tf.compat.v1.trainable_variables()
      if not v.op.name.startswith("regressor")
  ]
  regressor_vars = [
      v for v in tf.compat.v1.trainable_variables()
      if v.op.name.startswith("regressor")
  ]
  train_op = tf.group(
      first.minimize(class_loss, step, var_list=classifier_vars),
      second.minimize(target_loss, var_list=regressor_vars))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _train_sparse(tower_devices, steps=3, batch_size=8):
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features, labels = _sparse_batches(batch_size)
    spec = harness.wrap(sparse_model_fn,
                        tower_devices)(features, labels,
                                       tf.estimator.ModeKeys.TRAIN, {})
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      losses, values = harness.run_training(session, spec, steps)
  return graph, losses, values


class SparseDictAndOptimizersTest(parameterized.TestCase):

  @parameterized.parameters((3,))
  def test_match_one_device(self, num_towers):
    self._assert_match_one_device(num_towers)

  @parameterized.parameters(2, 4)
  @pytest.mark.wide
  def test_match_one_device_wide(self, num_towers):
    self._assert_match_one_device(num_towers)

  def _assert_match_one_device(self, num_towers):
    _, expected_losses, expected = _train_sparse(None)
    graph, losses, values = _train_sparse(
        harness.devices(harness.VIRTUAL_CPUS, num_towers))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    self.assertEqual(sorted(values), sorted(expected))
    harness.assert_close_nests(values, expected)
    self.assertEqual(values["global_step"], 3)  # incremented once per step
    # The unused variable got no gradient and kept its initial value.
    np.testing.assert_array_equal(
        values["unused"], harness.initial_value("unused", (3,), tf.float32))
    # The embedding gradients stayed sparse, never densified.
    applies = {
        op.type
        for op in graph.get_operations()
        if op.type.startswith("Resource") and "Apply" in op.type
    }
    self.assertIn("ResourceSparseApplyAdagrad", applies)


def _unsupervised_model_fn(features, labels, mode):
  """labels=None: an autoencoder-ish loss on the features alone."""
  assert labels is None
  code = tf.compat.v1.layers.dense(features["x"], 2, name="encode")
  output = tf.compat.v1.layers.dense(code, 5, name="decode")
  loss = tf.compat.v1.losses.mean_squared_error(features["x"], output)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


class LabelsNoneTest(parameterized.TestCase):

  @parameterized.parameters((4,))
  def test_labels_none_matches_one_device(self, num_towers):
    self._assert_labels_none_matches_one_device(num_towers)

  @parameterized.parameters((2,))
  @pytest.mark.wide
  def test_labels_none_matches_one_device_wide(self, num_towers):
    self._assert_labels_none_matches_one_device(num_towers)

  def _assert_labels_none_matches_one_device(self, num_towers):
    x = np.random.RandomState(5).randn(16, 5).astype(np.float32)

    def run(tower_devices):
      with tf.Graph().as_default():
        tf.compat.v1.train.create_global_step()
        spec = harness.wrap(_unsupervised_model_fn, tower_devices)({
            "x": tf.constant(x)
        }, None, tf.estimator.ModeKeys.TRAIN)
        with tf.compat.v1.Session(config=harness.session_config()) as session:
          session.run(tf.compat.v1.global_variables_initializer())
          harness.set_trainable_weights(session)
          return [session.run([spec.loss, spec.train_op])[0] for _ in range(3)]

    expected = run(None)
    self.assertGreater(expected[0] - expected[-1], 1e-3)  # it trains
    np.testing.assert_allclose(
        run(harness.devices(harness.VIRTUAL_CPUS, num_towers)),
        expected,
        rtol=1e-5)


class UnusedBranchTest(parameterized.TestCase):

  def test_variable_only_in_branch_not_taken_is_skipped(self):

    def model_fn(features, labels, mode, params):
      del params
      logits = tf.compat.v1.layers.dense(features["x"], 3, name="logits")
      extra = tf.compat.v1.get_variable("extra", [3])
      logits = tf.cond(
          tf.constant(False), lambda: logits + extra, lambda: logits)
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      opt = replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1))
      return tf.estimator.EstimatorSpec(
          mode,
          loss=loss,
          train_op=opt.minimize(loss, tf.compat.v1.train.get_global_step()))

    rng = np.random.RandomState(0)
    data = ({
        "x": rng.randn(16, 5).astype(np.float32)
    }, rng.randint(3, size=16).astype(np.int64))
    expected = harness.train(model_fn, data, 8, 3)
    actual = harness.train(
        model_fn,
        data,
        8,
        3,
        tower_devices=harness.devices(harness.VIRTUAL_CPUS, 2))
    harness.assert_close_nests(actual, expected)


def _ragged_examples(num_examples, seed=2):
  """Word ids per example (ragged rank 1), character ids per word (rank 2)."""
  rng = np.random.RandomState(seed)
  tokens = [
      list(rng.randint(VOCABULARY, size=rng.randint(1, 5)))
      for _ in range(num_examples)
  ]
  chars = [[
      list(rng.randint(VOCABULARY, size=rng.randint(1, 4)))
      for _ in range(rng.randint(0, 3))
  ]
           for _ in range(num_examples)]
  labels = rng.randint(2, size=num_examples).astype(np.int64)
  return tokens, chars, labels


def _ragged_batch(batch_size, static):
  """One batch: tf.ragged.constant (static), or Dataset.ragged_batch."""
  tokens, chars, labels = _ragged_examples(batch_size)
  features = {
      "tokens": tf.ragged.constant(tokens, tf.int64),
      "chars": tf.ragged.constant(chars, tf.int64, ragged_rank=2),
      "row": tf.range(batch_size, dtype=tf.int64)
  }
  if static:
    return features, tf.constant(labels)
  dataset = tf.data.Dataset.from_tensor_slices((features, labels))
  dataset = dataset.repeat().ragged_batch(batch_size)
  return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def _lookup(table, ids):
  return tf.ragged.map_flat_values(tf.nn.embedding_lookup, table, ids)


def ragged_model_fn(features, labels, mode):
  """Pools ragged word and character embeddings; a scalar temperature."""
  words = tf.compat.v1.get_variable("words", [VOCABULARY, 3])
  letters = tf.compat.v1.get_variable("letters", [VOCABULARY, 2])
  bag = tf.reduce_mean(_lookup(words, features["tokens"]), axis=1)
  spelled = tf.reduce_sum(
      _lookup(letters, features["chars"]).merge_dims(1, 2), axis=1)
  log_temperature = tf.compat.v1.get_variable("log_temperature", [])
  temperature = tf.exp(log_temperature)
  logits = tf.compat.v1.layers.dense(
      tf.concat([bag, spelled], axis=1), 2, name="logits") / temperature
  predictions = {
      "row": features["row"],
      "logits": logits,
      "temperature": temperature
  }
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(
        mode,
        predictions=predictions,
        export_outputs={
            "serving_default": tf.estimator.export.PredictOutput(predictions)
        })
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        predictions=predictions,
        eval_metric_ops={
            "accuracy":
                tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1)),
            "mean_logit":
                tf.compat.v1.metrics.mean(logits)
        })
  optimizer = replicate.TowerOptimizer(tf.compat.v1.train.AdagradOptimizer(0.5))
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      predictions=predictions,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _run_ragged(tower_devices, batch_size, static, steps=2):
  """Trains `steps` steps, then evaluates and predicts one batch each."""
  results = {}
  for mode in (tf.estimator.ModeKeys.TRAIN, tf.estimator.ModeKeys.EVAL,
               tf.estimator.ModeKeys.PREDICT):
    with tf.Graph().as_default():
      tf.compat.v1.train.create_global_step()
      features, labels = _ragged_batch(batch_size, static)
      if mode == tf.estimator.ModeKeys.PREDICT:
        labels = None
      spec = harness.wrap(ragged_model_fn, tower_devices)(features, labels,
                                                          mode)
      with tf.compat.v1.Session(config=harness.session_config()) as session:
        if mode == tf.estimator.ModeKeys.TRAIN:
          results[mode] = harness.run_training(session, spec, steps)
          results["train_predictions"] = session.run(spec.predictions)
          continue
        session.run([
            tf.compat.v1.global_variables_initializer(),
            tf.compat.v1.local_variables_initializer()
        ])
        harness.set_trainable_weights(session)
        if mode == tf.estimator.ModeKeys.EVAL:
          updates = [op for _, op in spec.eval_metric_ops.values()]
          results[mode] = session.run(
              (spec.loss, spec.predictions, updates))[:2]
          results["metrics"] = session.run({
              k: v for k, (v, _) in spec.eval_metric_ops.items()
          })
        else:
          results[mode] = session.run(
              (spec.predictions,
               spec.export_outputs["serving_default"].outputs))
  return results


class RaggedFeaturesTest(parameterized.TestCase):

  @parameterized.parameters((4, 7, False))
  def test_match_one_device(self, num_towers, batch_size, static):
    self._assert_match_one_device(num_towers, batch_size, static)

  @parameterized.parameters((2, 8, True))
  @pytest.mark.wide
  def test_match_one_device_wide(self, num_towers, batch_size, static):
    self._assert_match_one_device(num_towers, batch_size, static)

  def _assert_match_one_device(self, num_towers, batch_size, static):
    expected = _run_ragged(None, batch_size, static)
    actual = _run_ragged(
        harness.devices(harness.VIRTUAL_CPUS, num_towers), batch_size, static)
    self.assertEqual(sorted(actual), sorted(expected))
    harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)
    losses, values = actual[tf.estimator.ModeKeys.TRAIN]
    self.assertGreater(losses[0] - losses[-1], 1e-3)  # it trains
    self.assertEqual(values["global_step"], 2)
    predictions, outputs = actual[tf.estimator.ModeKeys.PREDICT]
    np.testing.assert_array_equal(predictions["row"], np.arange(batch_size))
    self.assertEqual(np.shape(outputs["temperature"]), ())
    self.assertEqual(actual["metrics"]["accuracy"],
                     expected["metrics"]["accuracy"])


class ScalarPredictionsTest(parameterized.TestCase):

  def _spec(self, mode, scalar_fn):

    def model_fn(features, labels, mode):
      logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
      predictions = {"logits": logits, "scalar": scalar_fn(logits)}
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      opt = replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1))
      train_op = opt.minimize(
          loss) if mode == tf.estimator.ModeKeys.TRAIN else None
      return tf.estimator.EstimatorSpec(
          mode,
          predictions=predictions,
          train_op=train_op,
          loss=None if mode == tf.estimator.ModeKeys.PREDICT else loss)

    x = np.random.RandomState(3).randn(6, 5).astype(np.float32)
    labels = tf.constant([0, 1, 1, 0, 1, 0], tf.int64)
    return harness.wrap(model_fn, harness.devices(harness.VIRTUAL_CPUS, 4))({
        "x": tf.constant(x)
    }, labels, mode)

  @parameterized.parameters(tf.estimator.ModeKeys.TRAIN,
                            tf.estimator.ModeKeys.EVAL,
                            tf.estimator.ModeKeys.PREDICT)
  def test_scalar_that_does_not_read_the_batch_is_tower_zeros(self, mode):
    with tf.Graph().as_default():
      spec = self._spec(mode, lambda logits: tf.constant(0.25) * 2.0)
      self.assertEqual(spec.predictions["scalar"].op.name, "mul")  # tower 0's
      self.assertEqual(spec.predictions["logits"].shape.as_list(), [6, 2])
      with tf.compat.v1.Session(config=harness.session_config()) as session:
        self.assertEqual(session.run(spec.predictions["scalar"]), 0.5)

  @parameterized.parameters(tf.estimator.ModeKeys.TRAIN,
                            tf.estimator.ModeKeys.PREDICT)
  def test_scalar_computed_from_the_batch_is_the_whole_batchs(self, mode):
    # A reduction over the rows has the whole batch's value in every tower.
    with tf.Graph().as_default():
      spec = self._spec(mode, tf.reduce_mean)
      with tf.compat.v1.Session(config=harness.session_config()) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        logits, scalar = session.run(
            [spec.predictions["logits"], spec.predictions["scalar"]])
    # The towers' partial sums add in another order than one sum over the
    # batch: each of the n additions may round by half an ulp of the running
    # sum, at most n * eps * mean(|logits|) on the mean.
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(
        scalar,
        logits.mean(),
        rtol=0,
        atol=logits.size * eps * np.abs(logits).mean())

  @parameterized.parameters(tf.estimator.ModeKeys.TRAIN,
                            tf.estimator.ModeKeys.PREDICT)
  def test_scalar_picked_from_a_row_is_one_devices(self, mode):
    # A row picked by its position in the batch is picked from the whole
    # batch's rows, once (tower 0's shard has the first row, not the last).
    with tf.Graph().as_default():
      spec = self._spec(mode, lambda t: t[0, 0] + 10.0 * t[-1, 1])
      with tf.compat.v1.Session(config=harness.session_config()) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        logits, scalar = session.run(
            [spec.predictions["logits"], spec.predictions["scalar"]])
    # The float32 product and sum each round by at most half an ulp of their
    # magnitudes; the float64 reference does not, and the two terms may
    # cancel, so the bound is absolute.
    first, last = np.float64(logits[0, 0]), np.float64(logits[-1, 1])
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(
        scalar,
        first + 10.0 * last,
        rtol=0,
        atol=eps * (abs(first) + 10.0 * abs(last)))


def mean_loss_model_fn(features, labels, mode):
  """A tf.reduce_mean loss (NaN over no examples) watched by a NanTensorHook."""
  logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
  loss = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()),
      training_hooks=[tf.compat.v1.train.NanTensorHook(loss)])


def _run_mean_loss(tower_devices, batch_size, static):
  """One train step: the loss, the trained weights, what the hook says."""
  rng = np.random.RandomState(4)
  x = rng.randn(batch_size, 5).astype(np.float32)
  labels = rng.randint(2, size=batch_size).astype(np.int64)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    if static:
      features, labels = {"x": tf.constant(x)}, tf.constant(labels)
    else:
      features = {"x": tf.compat.v1.placeholder_with_default(x, [None, 5])}
      labels = tf.compat.v1.placeholder_with_default(labels, [None])
    spec = harness.wrap(
        mean_loss_model_fn,
        tower_devices,
        reduction=(tf.compat.v1.losses.Reduction.MEAN))(
            features, labels, tf.estimator.ModeKeys.TRAIN)
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      losses, values = harness.run_training(session, spec, 1)
    with tf.compat.v1.train.MonitoredSession(
        session_creator=tf.compat.v1.train.ChiefSessionCreator(
            config=harness.session_config()),
        hooks=spec.training_hooks) as session:
      try:
        session.run(spec.train_op)
        hook_says = "finite"
      except tf.compat.v1.train.NanLossDuringTrainingError:
        hook_says = "NaN"
  return losses[0], values, hook_says


class EmptyBatchTest(parameterized.TestCase):
  """B = 0 gives one device's NaN mean; empty towers of a batch add 0."""

  @parameterized.parameters((4, 0, False), (4, 0, True), (4, 3, False),
                            (2, 1, True))
  def test_match_one_device(self, num_towers, batch_size, static):
    self._assert_match_one_device(num_towers, batch_size, static)

  @parameterized.parameters((2, 0, False))
  @pytest.mark.wide
  def test_match_one_device_wide(self, num_towers, batch_size, static):
    self._assert_match_one_device(num_towers, batch_size, static)

  def _assert_match_one_device(self, num_towers, batch_size, static):
    expected = _run_mean_loss(None, batch_size, static)
    actual = _run_mean_loss(
        harness.devices(harness.VIRTUAL_CPUS, num_towers), batch_size, static)
    harness.assert_close_nests(actual[:2], expected[:2], rtol=1e-5, atol=1e-6)
    self.assertEqual(actual[2], expected[2])
    self.assertEqual(np.isnan(actual[0]), batch_size == 0)
    self.assertEqual(actual[2], "NaN" if batch_size == 0 else "finite")


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()

# Python lists as an input_fn returns them (tensorflow_estimator's canned
# tests do): feature columns and heads convert them, so they are values.
_LIST_FEATURES = {
    "age": [[10.], [20.], [-5.], [7.], [3.]],
    "language": [["en"], ["fr"], ["de"], ["en"], ["xx"]]
}
_LIST_LABELS = [[1], [0], [1], [1], [0]]


def _list_columns():
  language = tf.feature_column.categorical_column_with_vocabulary_list(
      "language", ["en", "fr", "de"])
  return [
      tf.feature_column.numeric_column("age"),
      tf.feature_column.indicator_column(language)
  ]


def _canned_model_fn(kind):
  if kind == "linear_regressor_v2":
    return tf.estimator.LinearRegressor(
        _list_columns(),
        optimizer=replicate.TowerOptimizer(
            lambda: tf.keras.optimizers.legacy.Ftrl(0.1))).model_fn
  if kind == "dnn_classifier_v2":
    return tf.estimator.DNNClassifier(
        [3],
        _list_columns(),
        optimizer=replicate.TowerOptimizer(
            lambda: tf.keras.optimizers.legacy.Adagrad(0.1))).model_fn
  return tf.compat.v1.estimator.DNNClassifier(
      [3],
      _list_columns(),
      optimizer=replicate.TowerOptimizer(
          lambda: tf.compat.v1.train.AdagradOptimizer(0.1))).model_fn


def _run_lists(model_fn, mode, num_towers, rows):
  """Calls the model_fn on the lists themselves, as a plain Estimator does."""
  features = {key: value[:rows] for key, value in _LIST_FEATURES.items()}
  labels = None if mode == harness.PREDICT else _LIST_LABELS[:rows]
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    if num_towers > 1:
      model_fn = replicate.replicate_model_fn(
          model_fn, devices=harness.devices(harness.VIRTUAL_CPUS, num_towers))
    spec = model_fn(
        features=features,
        labels=labels,
        mode=mode,
        config=tf.estimator.RunConfig())
    # Soft placement, as the Estimator's default RunConfig has it (canned
    # DNN summaries need it with several towers: issue 19 item 6).
    with tf.compat.v1.Session(config=harness.session_config(
        soft=True)) as session:
      session.run(tf.compat.v1.tables_initializer())  # the vocabulary
      if mode == harness.TRAIN:
        return harness.run_training(session, spec, steps=2)
      session.run([
          tf.compat.v1.global_variables_initializer(),
          tf.compat.v1.local_variables_initializer()
      ])
      harness.set_trainable_weights(session)
      if mode == harness.PREDICT:
        return session.run(spec.predictions)
      updates = [op for _, op in spec.eval_metric_ops.values()]
      loss, _ = session.run([spec.loss, updates])
      return loss, session.run({
          k: v for k, (v, _) in spec.eval_metric_ops.items()
      })


class PythonListInputsTest(parameterized.TestCase):
  """Lists of numbers and strings, labels as lists, split unevenly.

  Every kind takes 3 rows on 4 towers (a tower computing on a phantom row)
  and one other split in turn: 5 rows on 2 towers (3 + 2) or on 4 (2 + 1
  + 1 + 1), or 3 rows on 2 (2 + 1). The default run takes one split of
  each kind's, a different one each.
  """

  @parameterized.parameters(("linear_regressor_v2", 4, 3),
                            ("dnn_classifier_v2", 4, 5),
                            ("dnn_classifier_v1", 2, 3))
  def test_match_one_device(self, kind, num_towers, rows):
    self._assert_match_one_device(kind, num_towers, rows)

  @parameterized.parameters(("linear_regressor_v2", 2, 5),
                            ("dnn_classifier_v2", 4, 3),
                            ("dnn_classifier_v1", 4, 3))
  @pytest.mark.wide
  def test_match_one_device_wide(self, kind, num_towers, rows):
    self._assert_match_one_device(kind, num_towers, rows)

  def _assert_match_one_device(self, kind, num_towers, rows):
    model_fn = _canned_model_fn(kind)
    for mode in (harness.TRAIN, harness.EVAL, harness.PREDICT):
      with self.subTest(mode=mode):
        harness.assert_close_nests(
            _run_lists(model_fn, mode, num_towers, rows),
            _run_lists(model_fn, mode, 1, rows))

  @parameterized.parameters(2, 4)
  def test_a_list_that_is_a_value_is_one_tensor(self, num_towers):
    with tf.Graph().as_default():
      shards = replicate._prepare.split.split_batch(  # pylint: disable=protected-access
          {
              "age": [[10.], [20.], [30.]],
              "pair": ([1, 2], [3, 4], [5, 6])
          }, (np.float32(1.), np.float32(2.), np.float32(3.)), num_towers)
      # A shard's size is known when it runs (shards.sizes), not in its
      # static shape: code reading it computes the run's value.
      self.assertEqual(shards.features[0]["age"].shape.as_list(), [None, 1])
      self.assertEqual(shards.sizes[0], 2 if num_towers == 2 else 1)
      # A tuple of lists is one value too: 3 rows of 2, not 3 leaves.
      self.assertEqual(shards.features[0]["pair"].shape[1], 2)
      self.assertEqual(shards.labels[0].dtype, tf.float32)

  def test_a_scalar_is_described_as_one(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(
          ValueError, r"`features\['scale'\]` is a scalar and has no batch "
          r"dimension to split across towers \(its value: 2.0\)"):
        replicate._prepare.split.split_batch(  # pylint: disable=protected-access
            {
                "x": [[1.], [2.]],
                "scale": 2.0
            }, [1, 2], 2)

  def test_ragged_list_is_refused_naming_it(self):
    with tf.Graph().as_default():
      with self.assertRaisesRegex(
          ValueError, r"`features\['x'\]` is a Python list that TensorFlow "
          "cannot convert"):
        replicate._prepare.split.split_batch(  # pylint: disable=protected-access
            {"x": [[1.], [2., 3.]]}, [1, 2], 2)
