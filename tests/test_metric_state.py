"""Hand-made streaming metrics give one device's values on N towers.

Metric state a model_fn makes itself (a streaming maximum, a local
variable, `get_local_variable`) is combined over the towers by each
variable's declared aggregation, like model state, over a whole uneven eval
set: 37 examples in batches of 10 (10, 10, 10, 7; dynamic batch) and 4
batches of a static 10 rows (the 37 examples, then 3 again). Metric state
that has no one-device answer is a ValueError naming the variable.
"""

import functools

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tests import harness

NUM_EXAMPLES, BATCH, STEPS = 37, 10, 4
LOCAL = tf.compat.v1.GraphKeys.LOCAL_VARIABLES
METRIC = tf.compat.v1.GraphKeys.METRIC_VARIABLES
SUM = tf.VariableAggregation.SUM


def _data():
  rng = np.random.RandomState(0)
  x = rng.randn(NUM_EXAMPLES, 3).astype(np.float32)
  return x, (x[:, 0] > 0).astype(np.int64)


def _batches(static):
  """The eval set once in batches of 10 (dynamic), or 4 static batches."""
  dataset = tf.data.Dataset.from_tensor_slices(_data())
  if static:
    dataset = dataset.repeat().batch(BATCH, drop_remainder=True)
  else:
    dataset = dataset.batch(BATCH)
  return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def _local(name, initial, collections=(LOCAL,), **kwargs):
  return tf.compat.v1.Variable(
      initial,
      trainable=False,
      name=name,
      collections=list(collections),
      **kwargs)


def _streaming_max(score, labels):
  """A metric variable, aggregation NONE, written as max(old, shard's max)."""
  del labels
  largest = _local("largest", -1e9, (LOCAL, METRIC))
  return largest.read_value(), tf.compat.v1.assign(
      largest, tf.maximum(largest, tf.reduce_max(score)))


def _ref_max(score, labels):
  """The same on a ref variable, operands the other way round."""
  del labels
  largest = _local("ref_largest", -1e9, (LOCAL, METRIC), use_resource=False)
  return tf.identity(largest), tf.compat.v1.assign(
      largest, tf.maximum(tf.reduce_max(score), largest))


def _get_local_min(score, labels):
  """tf.compat.v1.get_local_variable (variable-scope reuse), a minimum."""
  del labels
  smallest = tf.compat.v1.get_local_variable(
      "smallest", initializer=tf.constant(1e9))
  return tf.identity(smallest), tf.compat.v1.assign(
      smallest, tf.minimum(tf.reduce_min(score), smallest))


def _global_max(score, labels):
  """A running maximum in model state (a global variable), NONE."""
  del labels
  largest = tf.compat.v1.get_variable(
      "global_largest", initializer=tf.constant(-1e9), trainable=False)
  return tf.identity(largest), tf.compat.v1.assign(
      largest, tf.maximum(largest, tf.reduce_max(score)))


def _local_mean(score, labels):
  """A mean from variables only in LOCAL_VARIABLES, declared SUM."""
  del labels
  total = _local("score_total", 0.0, aggregation=SUM)
  count = _local("score_count", 0.0, aggregation=SUM)
  update = tf.group(
      total.assign_add(tf.reduce_sum(score)),
      count.assign_add(tf.cast(tf.size(score), tf.float32)))
  return tf.math.divide_no_nan(total, count), update


def _class_max(score, labels):
  """Per-class maximum by scatter_max, aggregation NONE."""
  largest = _local("class_largest", tf.fill([2], -1e9), (LOCAL, METRIC))
  return tf.identity(largest), tf.compat.v1.scatter_max(largest, labels, score)


def _accuracy(score, labels):
  return tf.compat.v1.metrics.accuracy(labels, tf.cast(score > 0, tf.int64))


def _keras_mean(score, labels):
  del labels
  mean = tf.keras.metrics.Mean(name="keras_mean")
  mean.update_state(score)
  return mean


def _undeclared_sum(score, labels):
  """A sum in a NONE variable: no one-device answer without SUM."""
  del labels
  total = _local("undeclared_total", 0.0, (LOCAL, METRIC))
  return tf.identity(total), total.assign_add(tf.reduce_sum(score))


def _last_max(score, labels):
  """The shard's maximum, not of the old value: no one-device answer."""
  del labels
  last = _local("last_largest", 0.0, (LOCAL, METRIC))
  return tf.identity(last), tf.compat.v1.assign(
      last, tf.maximum(0.0, tf.reduce_max(score)))


def _max_of_means(score, labels):
  """The largest batch mean: the shards' means are not the batch's."""
  del labels
  largest = _local("largest_mean", -1e9, (LOCAL, METRIC))
  return tf.identity(largest), tf.compat.v1.assign(
      largest, tf.maximum(largest, tf.reduce_mean(score)))


METRICS = {
    f.__name__.lstrip("_"): f
    for f in (_streaming_max, _ref_max, _get_local_min, _global_max,
              _local_mean, _class_max, _accuracy, _keras_mean, _undeclared_sum,
              _last_max, _max_of_means)
}
HAND_MADE = ("streaming_max", "ref_max", "get_local_min", "global_max",
             "local_mean", "class_max")
# Only LOCAL_VARIABLES, no METRIC_VARIABLES at all.
LOCAL_ONLY = ("get_local_min", "local_mean")
MIXED = ("streaming_max", "accuracy", "keras_mean")


def metric_model_fn(features, labels, mode, params):
  score = tf.squeeze(tf.compat.v1.layers.dense(features, 1, name="score"), 1)
  loss = tf.compat.v1.losses.mean_squared_error(
      tf.cast(labels, tf.float32), score)
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      eval_metric_ops={
          name: METRICS[name](score, labels) for name in params["metrics"]
      })


def evaluate(metrics, static, num_towers=None):
  """The metrics' values after the whole eval set (4 batches).

  Also what the update ops return in the last step (None for an op).
  """
  devices = num_towers and harness.devices(harness.VIRTUAL_CPUS, num_towers)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = _batches(static)
    spec = harness.wrap(metric_model_fn, devices)(features, labels,
                                                  harness.EVAL, {
                                                      "metrics": metrics
                                                  })
    updates = [op for _, op in spec.eval_metric_ops.values()]
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run([
          tf.compat.v1.global_variables_initializer(),
          tf.compat.v1.local_variables_initializer()
      ])
      harness.set_trainable_weights(session)
      for _ in range(STEPS):
        updated = session.run(updates)
      values = session.run({k: v for k, (v, _) in spec.eval_metric_ops.items()})
  return values, updated


one_device = functools.lru_cache(maxsize=None)(evaluate)


class HandMadeMetricsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f"{name}_{num_towers}_towers_{'static' if static else 'dynamic'}",
       metrics, num_towers, static)
      for name, metrics in (("hand_made", HAND_MADE),
                            ("local_only", LOCAL_ONLY), ("mixed", MIXED))
      for num_towers in (2, 4)
      for static in (True, False))
  def test_one_devices_values(self, metrics, num_towers, static):
    expected = one_device(metrics, static)
    actual = evaluate(metrics, static, num_towers)
    # Maxima and minima are exact. The means add 40 float32 scores in
    # another order: |error| <= 39 * 2**-24 * sum|s| / |sum s| (1.15 here)
    # = 2.7e-6 of the total, one more rounding for the division; seen: 1.4e-7.
    harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)
    values = expected[0]
    # The state moved from its initial value (±1e9, 0) on one device.
    self.assertLess(values.get("get_local_min", -1.0), 0.0)
    self.assertGreater(values.get("streaming_max", 1.0), 0.5)

  @parameterized.parameters("undeclared_sum", "last_max", "max_of_means")
  def test_state_of_batch_reductions_needs_no_aggregation(self, metric):
    # A sum, a maximum or a mean over the batch has the whole batch's value
    # in every tower: written once, whatever the variable declares.
    expected = one_device(("streaming_max", metric), False)
    for num_towers in (2, 4):
      actual = evaluate(("streaming_max", metric), False, num_towers)
      harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)
