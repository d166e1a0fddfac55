"""Any batch size on any number of towers gives one device's results.

The grid: batch sizes from 1 to 3N+1 on N = 1..4 towers (`_batches`),
static and dynamic batch dimensions, inputs that mix a dense tensor, a
SparseTensor and dicts of features and labels, every loss reduction.
Towers may get no examples (B < N); shards differ by at most one example
and keep the input order.
"""

import functools
import itertools
import tempfile

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

R = tf.compat.v1.losses.Reduction
REDUCTIONS = (R.SUM_BY_NONZERO_WEIGHTS, R.SUM, R.MEAN, R.SUM_OVER_BATCH_SIZE)
VOCABULARY = 10


def _examples(num_examples, seed=0):
  """Dense x, bags of word ids (sparse) and dict labels, one row each."""
  rng = np.random.RandomState(seed)
  x = rng.randn(num_examples, 4).astype(np.float32)
  lengths = rng.randint(1, 4, size=num_examples)
  indices = np.array(
      [[r, c] for r in range(num_examples) for c in range(lengths[r])],
      np.int64).reshape(-1, 2)
  words = tf.compat.v1.SparseTensorValue(
      indices,
      rng.randint(VOCABULARY, size=len(indices)).astype(np.int64),
      np.array([num_examples, 3], np.int64))
  features = {
      "x": x,
      "words": words,
      "row": np.arange(num_examples, dtype=np.int64)
  }
  labels = {"class": (x[:, 0] > 0).astype(np.int64), "target": x[:, 1:2] * 2.0}
  return features, labels


def _batch(num_examples, static):
  """One batch of all examples, from tf.data (dynamic) or constants."""
  features, labels = _examples(num_examples)
  if static:
    dense = {k: tf.constant(v) for k, v in features.items() if k != "words"}
    return (dict(dense, words=tf.SparseTensor.from_value(features["words"])),
            tf.nest.map_structure(tf.constant, labels))
  dataset = tf.data.Dataset.from_tensor_slices(
      (dict(features, words=tf.SparseTensor.from_value(features["words"])),
       labels)).repeat().batch(num_examples)
  return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def mixed_model_fn(features, labels, mode, params):
  embeddings = tf.compat.v1.get_variable(
      "embeddings", [VOCABULARY, 3],
      initializer=tf.compat.v1.random_normal_initializer(seed=1))
  bag = tf.nn.safe_embedding_lookup_sparse(
      embeddings, features["words"], combiner="sum")
  hidden = tf.concat([features["x"], bag], axis=1)
  logits = tf.compat.v1.layers.dense(hidden, 2, name="logits")
  value = tf.compat.v1.layers.dense(hidden, 1, name="value")
  predictions = {"row": features["row"], "logits": logits, "value": value}
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=predictions)
  reduction = params["reduction"]
  loss = (
      tf.compat.v1.losses.sparse_softmax_cross_entropy(
          labels["class"], logits, reduction=reduction) +
      tf.compat.v1.losses.mean_squared_error(
          labels["target"], value, reduction=reduction))
  if mode == tf.estimator.ModeKeys.EVAL:
    classes = tf.argmax(logits, 1)
    mean = tf.keras.metrics.Mean(name="keras_mean")
    mean.update_state(value)
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        eval_metric_ops={
            "accuracy":
                tf.compat.v1.metrics.accuracy(labels["class"], classes),
            "auc":
                tf.compat.v1.metrics.auc(labels["class"],
                                         tf.nn.softmax(logits)[:, 1]),
            "mean_value":
                tf.compat.v1.metrics.mean(value),
            "keras_mean":
                mean
        })
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1))
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


@functools.lru_cache(maxsize=None)
def _single_device(mode, num_examples, reduction, static):
  return _run(mode, num_examples, None, reduction, static)


def _run(mode, num_examples, tower_devices, reduction, static, steps=2):
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = _batch(num_examples, static)
    if mode == tf.estimator.ModeKeys.PREDICT:
      labels = None
    spec = harness.wrap(mixed_model_fn, tower_devices,
                        reduction)(features, labels, mode, {
                            "reduction": reduction
                        })
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run([
          tf.compat.v1.global_variables_initializer(),
          tf.compat.v1.local_variables_initializer()
      ])
      harness.set_trainable_weights(session)
      if mode == tf.estimator.ModeKeys.TRAIN:
        losses = [
            session.run([spec.loss, spec.train_op])[0] for _ in range(steps)
        ]
        return losses, {
            v.op.name: session.run(v)
            for v in tf.compat.v1.trainable_variables()
        }
      if mode == tf.estimator.ModeKeys.EVAL:
        updates = [u for _, u in spec.eval_metric_ops.values()]
        loss, _ = session.run([spec.loss, updates])
        return loss, session.run({
            k: v for k, (v, _) in spec.eval_metric_ops.items()
        })
      return session.run(spec.predictions)


def _batches(num_towers):
  """The batch sizes tried on `num_towers` towers.

  All of 1..3N+1 on one and two towers; on more, 1..N+1 (empty towers, a
  row each, one tower with two), then 2N-1, 2N, 2N+1 and 3N+1 (every
  remainder of B mod N, shards of two and three rows).
  """
  if num_towers <= 2:
    return range(1, 3 * num_towers + 2)
  return sorted(
      set(range(1, num_towers + 2)) | {
          2 * num_towers - 1, 2 * num_towers, 2 * num_towers +
          1, 3 * num_towers + 1
      })


# The grid's cases the default run keeps: one tower; an empty tower (B < N)
# on 2 and 4 towers; 3N+1 rows (shards of three and four) on 3 and 4; on 4
# every remainder of B mod 4, a static batch among them; every reduction.
# The others are `wide`.
DEFAULT_GRID = frozenset([
    "B4_N1_dynamic", "B1_N2_dynamic", "B10_N3_dynamic", "B3_N4_dynamic",
    "B4_N4_static", "B13_N4_dynamic"
])


def _grid(wide):
  """The grid's cases outside DEFAULT_GRID if `wide`, else those in it."""
  reductions = itertools.cycle(REDUCTIONS)
  for num_towers in (1, 2, 3, 4):
    for batch in _batches(num_towers):
      static = (batch + num_towers) % 2 == 0
      name = f"B{batch}_N{num_towers}_{'static' if static else 'dynamic'}"
      reduction = next(reductions)
      if (name not in DEFAULT_GRID) == wide:
        yield dict(
            testcase_name=name,
            num_towers=num_towers,
            batch=batch,
            static=static,
            reduction=reduction)


class UnevenBatchTest(parameterized.TestCase):

  @parameterized.named_parameters(*_grid(wide=False))
  def test_train_eval_predict_match_one_device(self, num_towers, batch, static,
                                               reduction):
    self._assert_matches_one_device(num_towers, batch, static, reduction)

  @parameterized.named_parameters(*_grid(wide=True))
  @pytest.mark.wide
  def test_train_eval_predict_match_one_device_wide(self, num_towers, batch,
                                                    static, reduction):
    self._assert_matches_one_device(num_towers, batch, static, reduction)

  def _assert_matches_one_device(self, num_towers, batch, static, reduction):
    devices = harness.devices(harness.VIRTUAL_CPUS, num_towers)
    for mode in (tf.estimator.ModeKeys.TRAIN, tf.estimator.ModeKeys.EVAL):
      expected = _single_device(mode, batch, reduction, static)
      actual = _run(mode, batch, devices, reduction, static)
      harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)
      self.assertTrue(np.all(np.isfinite(tf.nest.flatten(actual)[0])))
    predictions = _run(tf.estimator.ModeKeys.PREDICT, batch, devices, reduction,
                       static)
    harness.assert_close_nests(
        predictions,
        _single_device(tf.estimator.ModeKeys.PREDICT, batch, reduction, static))
    np.testing.assert_array_equal(predictions["row"], np.arange(batch))

  @parameterized.parameters((7, 4, [2, 2, 2, 1]), (2, 4, [1, 1, 0, 0]),
                            (10, 3, [4, 3, 3]), (1, 1, [1]))
  def test_shard_sizes_differ_by_at_most_one_in_order(self, batch, num_towers,
                                                      sizes):
    from replicate._prepare import split  # pylint: disable=g-import-not-at-top
    self.assertEqual(split.shard_sizes(batch, num_towers), sizes)
    with tf.Graph().as_default():
      dynamic = split.shard_sizes(tf.constant(batch, tf.int64), num_towers)
      with tf.compat.v1.Session() as session:
        self.assertEqual(list(session.run(dynamic)), sizes)


class WeightedLossTest(parameterized.TestCase):
  """Per-example weights: what the README documents.

  Each tower's loss is weighted by its share of the examples. That is exact
  for unit weights; with other weights an averaging reduction averages
  within each tower, so the result is the share-weighted mean of the towers'
  weighted means, and a tower whose weights are all zero contributes zero.
  """

  def _losses(self, weights, reduction, tower_devices):
    x = np.linspace(-1, 1, 8 * 3).reshape(8, 3).astype(np.float32)
    labels = np.array([0, 1, 1, 0, 1, 0, 0, 1], np.int64)

    def model_fn(features, labels, mode):
      logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
          labels, logits, weights=features["w"], reduction=reduction)
      opt = replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1))
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, train_op=opt.minimize(loss))

    with tf.Graph().as_default():
      tf.compat.v1.train.create_global_step()
      features = {"x": tf.constant(x), "w": tf.constant(weights, tf.float32)}
      spec = harness.wrap(model_fn, tower_devices,
                          reduction)(features, tf.constant(labels),
                                     tf.estimator.ModeKeys.TRAIN)
      per_example = tf.compat.v1.losses.sparse_softmax_cross_entropy(
          tf.constant(labels),
          tf.compat.v1.get_default_graph().get_tensor_by_name(
              "logits/BiasAdd:0") if tower_devices is None else tf.concat([
                  tf.compat.v1.get_default_graph().get_tensor_by_name(
                      f"{p}logits/BiasAdd:0") for p in ("", "tower_1/")
              ], 0),
          reduction=R.NONE)
      with tf.compat.v1.Session(config=harness.session_config()) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        harness.set_trainable_weights(session)
        return session.run([spec.loss, per_example])

  def test_unit_weights_are_exact(self):
    weights = np.ones(8)
    for reduction in (R.SUM_BY_NONZERO_WEIGHTS, R.MEAN):
      expected, _ = self._losses(weights, reduction, None)
      actual, _ = self._losses(weights, reduction,
                               harness.devices(harness.VIRTUAL_CPUS, 2))
      # A mean of 8 losses of order 1 against the mean of two means of 4:
      # the same terms summed in another order, a few roundings of 2**-24.
      np.testing.assert_allclose(actual, expected, rtol=1e-5)

  @parameterized.parameters(R.SUM_BY_NONZERO_WEIGHTS, R.MEAN)
  def test_zero_weights_give_one_devices_weighted_mean(self, reduction):
    weights = np.array([1, 1, 0, 2, 0, 0, 0, 0], np.float32)  # tower 1: zeros
    expected, _ = self._losses(weights, reduction, None)
    actual, losses = self._losses(weights, reduction,
                                  harness.devices(harness.VIRTUAL_CPUS, 2))
    denominator = (
        np.count_nonzero(weights)
        if reduction == R.SUM_BY_NONZERO_WEIGHTS else weights.sum())
    whole_batch = (weights * losses).sum() / denominator
    # Sums of a few terms of order 1, in another order: a few roundings.
    np.testing.assert_allclose(actual, whole_batch, rtol=1e-5)
    np.testing.assert_allclose(expected, whole_batch, rtol=1e-5)


class EstimatorUnevenTest(parameterized.TestCase):

  def test_numpy_input_evaluate_and_predict_match_one_device(self):
    # 4 towers: the last batch (3 of 23 rows at 5 a batch) leaves one empty.
    self._assert_numpy_input_matches_one_device(4)

  @pytest.mark.wide
  def test_numpy_input_evaluate_and_predict_match_one_device_on_3(self):
    self._assert_numpy_input_matches_one_device(3)

  def _assert_numpy_input_matches_one_device(self, num_towers):
    features, labels = _examples(23)
    features = {"x": features["x"], "row": features["row"]}
    labels = labels["class"]

    def model_fn(features, labels, mode):
      logits = tf.compat.v1.layers.dense(
          features["x"],
          2,
          name="logits",
          kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=3))
      predictions = {"row": features["row"], "logits": logits}
      if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions=predictions)
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      return tf.estimator.EstimatorSpec(
          mode,
          loss=loss,
          eval_metric_ops={
              "accuracy":
                  tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1))
          })

    def input_fn(with_labels):
      return tf.compat.v1.estimator.inputs.numpy_input_fn(
          features,
          labels if with_labels else None,
          batch_size=5,
          num_epochs=1,
          shuffle=False)

    # Both evaluate the same weights, from one checkpoint written first.
    config = tf.estimator.RunConfig(
        tf_random_seed=1, session_config=harness.session_config(soft=True))
    checkpoint_dir = self.enter_context(tempfile.TemporaryDirectory())
    _write_initial_checkpoint(model_fn, checkpoint_dir)
    plain = tf.estimator.Estimator(
        model_fn, model_dir=checkpoint_dir, config=config)
    replicated = tf.estimator.Estimator(
        replicate.replicate_model_fn(
            model_fn, devices=harness.devices(harness.VIRTUAL_CPUS,
                                              num_towers)),
        model_dir=checkpoint_dir,
        config=config)
    expected = plain.evaluate(input_fn(True))
    actual = replicated.evaluate(input_fn(True))
    self.assertEqual(actual["accuracy"], expected["accuracy"])  # counts
    # The loss is a mean over 23 rows summed in another order: a few float32
    # roundings (2**-24 each) of a value near 1.
    np.testing.assert_allclose(actual["loss"], expected["loss"], rtol=1e-5)
    predictions = list(replicated.predict(input_fn(False)))
    self.assertEqual([p["row"] for p in predictions], list(range(23)))
    # A logit is a 4-term dot product whose summation order depends on the
    # matmul's batch size: its error is bounded relative to the terms, not to
    # the logit, which can be near 0 (-0.0196 failed rtol=1e-6 once). Bound:
    # 4 * 2**-24 * sum|x_i w_i| <= 4 * 6e-8 * (4 * 3 * 1) ~ 3e-6.
    for got, want in zip(predictions, list(plain.predict(input_fn(False)))):
      np.testing.assert_allclose(
          got["logits"], want["logits"], rtol=1e-6, atol=5e-6)


def _float64_model_fn(features, labels, mode, params):
  """A float64 model; a tf.reduce_mean loss (weighted by shares) or a Keras
  loss (the towers' sums over their counts). tf.compat.v1.losses compute in
  float32 whatever the dtype, on one device too."""
  hidden = tf.keras.layers.Dense(3, "tanh", dtype="float64", name="hidden")
  out = tf.keras.layers.Dense(1, dtype="float64", name="out")
  predictions = out(hidden(features["x"]))
  if params["loss"] == "reduce_mean":
    loss = tf.reduce_mean(tf.square(predictions - labels))
  else:
    loss = tf.keras.losses.MeanSquaredError()(labels, predictions)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1))
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


# (num_towers, static, loss): each loss on one of the product's (towers,
# static) pairs; the product's others are `wide`.
FLOAT64_DEFAULT = ((2, True, "reduce_mean"), (4, False, "keras"))


class Float64UnevenTest(parameterized.TestCase):
  """The towers' shares are float64-exact: 7 rows on 2 and 4 towers."""

  @parameterized.parameters(*FLOAT64_DEFAULT)
  def test_match_one_device_to_float64_rounding(self, num_towers, static, loss):
    self._assert_matches_to_float64_rounding(num_towers, static, loss)

  @parameterized.parameters(*[
      case for case in itertools.product([2, 4], [True, False],
                                         ["reduce_mean", "keras"])
      if case not in FLOAT64_DEFAULT
  ])
  @pytest.mark.wide
  def test_match_one_device_to_float64_rounding_wide(self, num_towers, static,
                                                     loss):
    self._assert_matches_to_float64_rounding(num_towers, static, loss)

  def _assert_matches_to_float64_rounding(self, num_towers, static, loss):
    rng = np.random.RandomState(4)
    data = ({"x": rng.randn(14, 2)}, rng.randn(14, 1))
    run = functools.partial(
        harness.train,
        _float64_model_fn,
        data,
        7,
        3,
        params={"loss": loss},
        static=static)
    expected_losses, expected = run()
    losses, values = run(harness.devices(harness.VIRTUAL_CPUS, num_towers))
    # Shards summed in another order and weighted by shares each rounded
    # once: a few roundings of 2**-53 (1.1e-16) per value, amplified by 3
    # steps of a small model; 1e-12 leaves room for that and none for a
    # share rounded through float32 (2**-24, 6e-8: the bug this catches).
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-12)
    for name in ("hidden/kernel", "hidden/bias", "out/kernel", "out/bias"):
      np.testing.assert_allclose(
          values[name], expected[name], rtol=1e-12, atol=1e-14)


def _write_initial_checkpoint(model_fn, model_dir):
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    model_fn({
        "x": tf.zeros([1, 4]),
        "row": tf.zeros([1], tf.int64)
    }, None, tf.estimator.ModeKeys.PREDICT)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      harness.set_trainable_weights(session)
      tf.compat.v1.train.Saver().save(
          session, f"{model_dir}/model.ckpt", global_step=0)


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()
