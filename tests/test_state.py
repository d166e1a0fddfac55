"""Model state written outside the optimizer, hooks and scaffolds.

Every write a model_fn makes outside TowerOptimizer becomes one write per
step, combined by the variable's declared aggregation (MEAN weighted by
shard size, SUM, ONLY_FIRST_REPLICA = tower 0's, NONE = tower 0's where the
towers agree, else an error); ops ordered after a tower's train_op run after
the summed update; initializers are left alone; hooks are tower 0's.
"""

import os
import tempfile

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

MOMENTUM = 0.9
SUM = tf.VariableAggregation.SUM
MEAN = tf.VariableAggregation.MEAN
ONLY_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA
NONE = tf.VariableAggregation.NONE
UPDATE_OPS = tf.compat.v1.GraphKeys.UPDATE_OPS

_RNG = np.random.RandomState(3)
X = (_RNG.randn(40, 5) * [1.0, 2.0, 0.5, 3.0, 1.0] + 0.5).astype(np.float32)
Y = (np.argmax(X[:, :3], axis=1)).astype(np.int64)
DATA = ({"x": X}, Y)


def _shard_sizes(batch, num_towers):
  base, extra = divmod(batch, num_towers)
  return [base + (1 if i < extra else 0) for i in range(num_towers)]


def _batches(batch, steps):
  rows = np.concatenate([X] * (1 + steps * batch // len(X)))
  return [rows[i * batch:(i + 1) * batch] for i in range(steps)]


def _linear(x, name="logits", use_resource=True):
  kernel = tf.compat.v1.get_variable(
      f"{name}/kernel", [5, 3],
      use_resource=use_resource,
      initializer=tf.compat.v1.glorot_uniform_initializer(seed=3))
  bias = tf.compat.v1.get_variable(
      f"{name}/bias", [3],
      use_resource=use_resource,
      initializer=tf.compat.v1.zeros_initializer())
  return tf.matmul(x, kernel) + bias


def _loss(labels, logits):
  return tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)


def _minimize(loss, global_step=True):
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  return optimizer.minimize(
      loss,
      tf.compat.v1.train.get_global_step() if global_step else None)


def _towers(num_towers):
  return harness.devices(harness.VIRTUAL_CPUS, num_towers)


def _assert_equal_to_one_device(model_fn,
                                num_towers,
                                batch,
                                steps,
                                static,
                                params=None,
                                rtol=1e-5,
                                atol=1e-6):
  expected_losses, expected = harness.train(
      model_fn, DATA, batch, steps, static=static, params=params)
  losses, values = harness.train(
      model_fn,
      DATA,
      batch,
      steps,
      tower_devices=_towers(num_towers),
      static=static,
      params=params)
  np.testing.assert_allclose(losses, expected_losses, rtol=rtol, atol=atol)
  harness.assert_close_nests(values, expected, rtol=rtol, atol=atol)
  return values, expected


def _train_graph_ops(model_fn, num_towers, params, **replicate_kwargs):
  """Names of the ops of a TRAIN graph built on `num_towers` towers."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(DATA, 8)
    replicate.replicate_model_fn(
        model_fn, devices=_towers(num_towers),
        **replicate_kwargs)(features, labels, tf.estimator.ModeKeys.TRAIN,
                            params)
    return [op.name for op in graph.get_operations()]


# Cases: (towers, batch, static); 10 on 4 towers and 7 on 2 are uneven.
_SHAPES = (dict(num_towers=2, batch=8,
                static=True), dict(num_towers=4, batch=10, static=False),
           dict(num_towers=2, batch=7,
                static=False), dict(num_towers=4, batch=8, static=True))


def _in_turns(forms, shapes=_SHAPES, start=0):
  """(default, wide) cases: each form on one shape, the shapes in turn; and
  every other combination."""
  return harness.in_turns(forms, shapes, lambda i, j: j ==
                          (i + start) % len(shapes))


_BATCH_NORM_CASES = _in_turns([
    dict(layers=layers, fused=fused)
    for layers in ("v1", "keras")
    for fused in (False, True)
])
_SYNCHRONISED_CASES = _in_turns(
    [dict(fused=False), dict(fused=True)],
    [dict(num_towers=4), dict(num_towers=2)])


def _four_d(x):
  """[B, 5] -> [B, 2, 2, 5]: four values per row and channel (fused kernels)."""
  return tf.reshape(tf.concat([x, x * x, 0.5 * x, 1.0 - x], 1), [-1, 2, 2, 5])


def _batch_norm_model_fn(features, labels, mode, params):
  x = features["x"]
  layers, fused = params["layers"], params.get("fused", False)
  if fused:
    x = _four_d(x)
  if layers == "v1":
    normalized = tf.compat.v1.layers.batch_normalization(
        x, momentum=MOMENTUM, training=True, fused=fused, name="bn")
    update_ops = tf.compat.v1.get_collection(UPDATE_OPS)
  else:
    layer = tf.keras.layers.BatchNormalization(
        momentum=MOMENTUM, fused=fused, name="bn")
    normalized = layer(x, training=True)
    update_ops = layer.updates
  if fused:
    normalized = tf.reduce_mean(normalized, [1, 2])
  loss = _loss(labels, _linear(normalized))
  with tf.control_dependencies(update_ops):
    train_op = _minimize(loss)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _expected_moving_statistics(num_towers, batch, steps, fused=False):
  """One device's moving statistics (num_towers=1), or the shards' mean."""
  mean, variance = np.zeros(5), np.ones(5)
  for rows in _batches(batch, steps):
    sizes = _shard_sizes(batch, num_towers)
    shards = np.split(rows, np.cumsum(sizes)[:-1])
    if fused:  # per channel: every row's four values; Bessel-corrected
      shards = [
          np.stack([s, s * s, 0.5 * s, 1.0 - s], 1).reshape(-1, 5)
          for s in shards
      ]
    values = np.concatenate(shards)
    shard_variance = sum(
        len(s) / len(values) * s.var(axis=0, ddof=int(fused))
        for s in shards
        if len(s))
    mean = MOMENTUM * mean + (1 - MOMENTUM) * values.mean(axis=0)
    variance = MOMENTUM * variance + (1 - MOMENTUM) * shard_variance
  return {"bn/moving_mean": mean, "bn/moving_variance": variance}


class BatchNormTest(parameterized.TestCase):

  @parameterized.parameters(*_BATCH_NORM_CASES[0])
  def test_moving_statistics_are_one_devices(self, num_towers, batch, static,
                                             layers, fused):
    self._assert_moving_statistics_are_one_devices(num_towers, batch, static,
                                                   layers, fused)

  @parameterized.parameters(*_BATCH_NORM_CASES[1])
  @pytest.mark.wide
  def test_moving_statistics_are_one_devices_wide(self, num_towers, batch,
                                                  static, layers, fused):
    self._assert_moving_statistics_are_one_devices(num_towers, batch, static,
                                                   layers, fused)

  def _assert_moving_statistics_are_one_devices(self, num_towers, batch, static,
                                                layers, fused):
    steps = 3
    params = {"layers": layers, "fused": fused}
    _, values = harness.train(
        _batch_norm_model_fn,
        DATA,
        batch,
        steps,
        tower_devices=_towers(num_towers),
        static=static,
        params=params)
    _, plain = harness.train(
        _batch_norm_model_fn, DATA, batch, steps, static=static, params=params)
    expected = _expected_moving_statistics(1, batch, steps, fused)
    for name, value in expected.items():
      # Float32 statistics of values of order 1..10, summed in another order.
      np.testing.assert_allclose(
          plain[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
      np.testing.assert_allclose(
          values[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # Without the variance between the shards' means the result would differ.
    shard_mean = _expected_moving_statistics(num_towers, batch, steps, fused)
    self.assertGreater(
        np.abs(shard_mean["bn/moving_variance"] -
               expected["bn/moving_variance"]).max(), 1e-2)
    self.assertEqual(sorted(values), sorted(plain))  # same variables, names

  @parameterized.parameters(*_SYNCHRONISED_CASES[0])
  def test_synchronised_moving_statistics_are_tower_zeros_writes(
      self, fused, num_towers):
    self._assert_synchronised_statistics_are_tower_zeros(fused, num_towers)

  @parameterized.parameters(*_SYNCHRONISED_CASES[1])
  @pytest.mark.wide
  def test_synchronised_moving_statistics_are_tower_zeros_writes_wide(
      self, fused, num_towers):
    self._assert_synchronised_statistics_are_tower_zeros(fused, num_towers)

  def _assert_synchronised_statistics_are_tower_zeros(self, fused, num_towers):
    # Every tower writes the hub's statistics: nothing to combine. Per-tower
    # statistics are combined (weighted means, between-shard variance).
    params = {"layers": "keras", "fused": fused}
    synced = _train_graph_ops(_batch_norm_model_fn, num_towers, params)
    unsynced = _train_graph_ops(
        _batch_norm_model_fn, num_towers, params, sync_batch_norm=False)
    self.assertEqual([n for n in synced if "combined_writes" in n], [])
    self.assertNotEqual([n for n in unsynced if "combined_writes" in n], [])

  def test_mean_writes_of_random_values_are_combined(self):

    def model_fn(features, labels, mode, params):
      del params  # unused
      noise = tf.compat.v1.get_variable(
          "noise", [5],
          initializer=tf.compat.v1.zeros_initializer(),
          trainable=False,
          aggregation=MEAN)
      update = noise.assign(tf.random.uniform([5], seed=1))
      loss = _loss(labels, _linear(features["x"]))
      with tf.control_dependencies([update]):
        train_op = _minimize(loss)
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    # A value without rows (random ops draw per tower, alike here) is
    # written once, by tower 0: nothing to combine.
    names = _train_graph_ops(model_fn, 2, None)
    self.assertEqual([n for n in names if "combined_writes" in n], [])

  def test_reduce_variance_with_mean_aggregation_is_one_devices(self):

    def model_fn(features, labels, mode, params):
      del params  # unused
      x = features["x"]
      spread = tf.compat.v1.get_variable(
          "spread", [5],
          initializer=tf.compat.v1.zeros_initializer(),
          trainable=False,
          aggregation=MEAN)
      update = spread.assign(0.5 * spread + 0.5 * tf.math.reduce_variance(x, 0))
      loss = _loss(labels, _linear(x))
      with tf.control_dependencies([update]):
        train_op = _minimize(loss)
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    values, _ = _assert_equal_to_one_device(model_fn, 4, 10, 3, static=False)
    expected = np.zeros(5)
    for rows in _batches(10, 3):
      expected = 0.5 * expected + 0.5 * rows.var(axis=0)
    np.testing.assert_allclose(values["spread"], expected, rtol=1e-5)


def _ema_model_fn(features, labels, mode, params):
  """A moving average of the weights, updated after the train_op.

  Resource variables use ExponentialMovingAverage (the usual idiom); ref
  variables a hand-written average, since TensorFlow 2 cannot initialise an
  ExponentialMovingAverage of ref variables (one device fails too).
  """
  use_resource = params["resource"]
  logits = _linear(features["x"], use_resource=use_resource)
  loss = _loss(labels, logits)
  train_op = _minimize(loss)
  weights = tf.compat.v1.trainable_variables()
  with tf.control_dependencies([train_op]):
    if use_resource:
      train_op = tf.compat.v1.train.ExponentialMovingAverage(0.5).apply(weights)
    else:
      train_op = tf.group(*[_ref_average(w) for w in weights])
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _ref_average(weight):
  shadow = tf.compat.v1.get_variable(
      f"{weight.op.name}/ExponentialMovingAverage",
      weight.shape,
      initializer=tf.compat.v1.zeros_initializer(),
      trainable=False,
      use_resource=False)
  return tf.compat.v1.assign(shadow, 0.5 * shadow + 0.5 * weight)


_EMA_CASES = _in_turns([dict(resource=True), dict(resource=False)])


class AfterTrainOpTest(parameterized.TestCase):

  @parameterized.parameters(*_EMA_CASES[0])
  def test_ema_shadows_equal_one_device_run_after_run(self, num_towers, batch,
                                                      static, resource):
    self._assert_ema_shadows_equal_one_device(num_towers, batch, static,
                                              resource)

  @parameterized.parameters(*_EMA_CASES[1])
  @pytest.mark.wide
  def test_ema_shadows_equal_one_device_run_after_run_wide(
      self, num_towers, batch, static, resource):
    self._assert_ema_shadows_equal_one_device(num_towers, batch, static,
                                              resource)

  def _assert_ema_shadows_equal_one_device(self, num_towers, batch, static,
                                           resource):
    params = {"resource": resource}
    values, expected = _assert_equal_to_one_device(_ema_model_fn, num_towers,
                                                   batch, 4, static, params)
    shadow = "logits/kernel/ExponentialMovingAverage"
    self.assertIn(shadow, values)
    # The shadow moved with the trained weights, not with stale ones.
    self.assertGreater(
        np.abs(expected[shadow] - values["logits/kernel"]).max(), 0)
    again = harness.train(
        _ema_model_fn,
        DATA,
        batch,
        4,
        tower_devices=_towers(num_towers),
        static=static,
        params=params)[1]
    for name in values:
      np.testing.assert_array_equal(again[name], values[name], err_msg=name)

  @parameterized.parameters((4,))
  def test_global_step_incremented_by_hand_advances_once_per_step(
      self, num_towers):
    self._assert_global_step_advances_once_per_step(num_towers)

  @parameterized.parameters((2,))
  @pytest.mark.wide
  def test_global_step_incremented_by_hand_advances_once_per_step_wide(
      self, num_towers):
    self._assert_global_step_advances_once_per_step(num_towers)

  def _assert_global_step_advances_once_per_step(self, num_towers):

    def model_fn(features, labels, mode, params):
      del params
      loss = _loss(labels, _linear(features["x"]))
      train_op = _minimize(loss, global_step=False)
      with tf.control_dependencies([train_op]):
        train_op = tf.compat.v1.assign_add(tf.compat.v1.train.get_global_step(),
                                           1)
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    values, _ = _assert_equal_to_one_device(model_fn, num_towers, 8, 3, True)
    self.assertEqual(values["global_step"], 3)

  def test_estimator_max_steps_runs_as_many_steps_as_one_device(self):

    def model_fn(features, labels, mode):
      seen = tf.compat.v1.get_variable(
          "examples_seen", [],
          tf.int64,
          trainable=False,
          aggregation=SUM,
          initializer=tf.compat.v1.zeros_initializer())
      count = seen.assign_add(tf.shape(features["x"], out_type=tf.int64)[0])
      loss = _loss(labels, _linear(features["x"]))
      train_op = _minimize(loss, global_step=False)
      with tf.control_dependencies([train_op, count]):
        train_op = tf.compat.v1.assign_add(tf.compat.v1.train.get_global_step(),
                                           1)
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    input_fn = lambda: tf.data.Dataset.from_tensor_slices(DATA).repeat().batch(
        8, drop_remainder=True)
    model_dir = self.enter_context(tempfile.TemporaryDirectory())
    estimator = tf.estimator.Estimator(
        replicate.replicate_model_fn(model_fn, devices=_towers(2)),
        config=harness.estimator_config(model_dir, 1))
    estimator.train(input_fn, max_steps=6)
    self.assertEqual(estimator.get_variable_value("global_step"), 6)
    self.assertEqual(estimator.get_variable_value("examples_seen"), 6 * 8)


def _counting_model_fn(features, labels, mode, params):
  """Counters, a class histogram (scatter) and a moving feature mean."""
  resource = params["resource"]

  def state(name, shape, dtype, aggregation):
    return tf.compat.v1.get_variable(
        name,
        shape,
        dtype,
        initializer=tf.compat.v1.zeros_initializer(),
        trainable=False,
        use_resource=resource,
        aggregation=aggregation)

  x = features["x"]
  seen = state("examples_seen", [], tf.int64, SUM)
  per_class = state("class_counts", [3], tf.float32, SUM)
  running = state("running_mean", [5], tf.float32, MEAN)
  steps = state("steps_seen", [], tf.int64, tf.VariableAggregation.NONE)
  updates = [
      seen.assign_add(tf.shape(x, out_type=tf.int64)[0]),
      tf.compat.v1.scatter_add(per_class, labels,
                               tf.ones_like(labels, tf.float32)),
      running.assign(0.5 * running + 0.5 * tf.reduce_mean(x, axis=0)),
      steps.assign_add(1),
  ]
  loss = _loss(labels, _linear(x, use_resource=resource))
  with tf.control_dependencies(updates):
    train_op = _minimize(loss)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _shard_size_counter_model_fn(features, labels, mode, params):
  """Counts rows with tf.shape()[0] or tf.size() (5 values a row).

  `steps_seen` counts steps with a true constant, left NONE: accepted.
  """
  x = features["x"]
  aggregation = params["aggregation"] or NONE
  seen, steps = (tf.compat.v1.get_variable(
      name, [],
      tf.float32,
      trainable=False,
      aggregation=aggregation,
      initializer=tf.compat.v1.zeros_initializer())
                 for name, aggregation in (("examples_seen", aggregation),
                                           ("steps_seen", NONE)))
  if params["size"] == "shape":
    rows = tf.cast(tf.shape(x)[0], tf.float32)
  else:
    rows = tf.cast(tf.size(x), tf.float32) / 5.0
  updates = [
      tf.compat.v1.assign_add(seen, rows),
      tf.compat.v1.assign_add(steps, 1.0)
  ]
  loss = _loss(labels, _linear(x))
  with tf.control_dependencies(updates):
    train_op = _minimize(loss)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


# The shapes AfterTrainOpTest's default cases leave out.
_COUNTING_CASES = _in_turns(
    [dict(resource=True), dict(resource=False)], start=2)
_SHARD_SIZE_CASES = _in_turns(
    [dict(size="shape"), dict(size="size")], [
        dict(num_towers=4, static=True),
        dict(num_towers=2, static=False),
        dict(num_towers=4, static=False),
        dict(num_towers=2, static=True)
    ])


class AggregationTest(parameterized.TestCase):

  @parameterized.parameters(*_COUNTING_CASES[0])
  def test_sum_mean_and_none_writes_equal_one_device(self, num_towers, batch,
                                                     static, resource):
    self._assert_counters_equal_one_device(num_towers, batch, static, resource)

  @parameterized.parameters(*_COUNTING_CASES[1])
  @pytest.mark.wide
  def test_sum_mean_and_none_writes_equal_one_device_wide(
      self, num_towers, batch, static, resource):
    self._assert_counters_equal_one_device(num_towers, batch, static, resource)

  def _assert_counters_equal_one_device(self, num_towers, batch, static,
                                        resource):
    steps = 3
    values, _ = _assert_equal_to_one_device(_counting_model_fn, num_towers,
                                            batch, steps, static,
                                            {"resource": resource})
    rows = np.concatenate(_batches(batch, steps))
    labels = (np.argmax(rows[:, :3], axis=1))
    self.assertEqual(values["examples_seen"], steps * batch)
    np.testing.assert_array_equal(values["class_counts"],
                                  np.bincount(labels, minlength=3))
    self.assertEqual(values["steps_seen"], steps)

  def test_round_robin_variables_combine_like_shared_ones(self):
    expected = harness.train(
        _counting_model_fn, DATA, 10, 2, params={"resource": True})[1]
    values = harness.train(
        _counting_model_fn,
        DATA,
        10,
        2,
        tower_devices=_towers(4),
        placement=replicate.VariablePlacement.ROUND_ROBIN,
        params={"resource": True})[1]
    harness.assert_close_nests(values, expected, rtol=1e-5, atol=1e-6)

  def test_only_first_replica_of_a_batch_reduction_is_one_devices(self):
    # The batch's mean is the whole batch's in every tower (a reduction),
    # so whatever the aggregation the write is one device's.
    def model_fn(features, labels, mode):
      first = tf.compat.v1.get_variable(
          "first_shard_mean", [5],
          initializer=tf.compat.v1.zeros_initializer(),
          trainable=False,
          aggregation=ONLY_FIRST)
      write = first.assign(tf.reduce_mean(features["x"], axis=0))
      loss = _loss(labels, _linear(features["x"]))
      with tf.control_dependencies([write]):
        train_op = _minimize(loss)
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    _, values = harness.train(model_fn, DATA, 8, 1, tower_devices=_towers(4))
    # Eight values below 2.5 summed in float32: 1.2e-6 at most, /8.
    np.testing.assert_allclose(
        values["first_shard_mean"], X[:8].mean(axis=0), rtol=0, atol=2e-7)

  @parameterized.parameters(True, False)
  def test_none_counter_fed_tf_shape_is_one_devices(self, resource):

    def model_fn(features, labels, mode):
      seen = tf.compat.v1.get_variable(
          "examples_seen", [],
          tf.int64,
          trainable=False,
          initializer=tf.compat.v1.zeros_initializer(),
          use_resource=resource)
      count = seen.assign_add(tf.shape(features["x"], out_type=tf.int64)[0])
      loss = _loss(labels, _linear(features["x"]))
      with tf.control_dependencies([count]):
        train_op = _minimize(loss)
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    # tf.shape(x)[0] read as a value is the whole batch's size.
    _, values = harness.train(
        model_fn, DATA, 8, 2, tower_devices=_towers(2), static=False)
    self.assertEqual(values["examples_seen"], 16)

  @parameterized.parameters(*_SHARD_SIZE_CASES[0])
  def test_none_counter_fed_the_shard_size_is_one_devices(
      self, num_towers, static, size):
    self._assert_none_counter_fed_the_shard_size(num_towers, static, size)

  @parameterized.parameters(*_SHARD_SIZE_CASES[1])
  @pytest.mark.wide
  def test_none_counter_fed_the_shard_size_is_one_devices_wide(
      self, num_towers, static, size):
    self._assert_none_counter_fed_the_shard_size(num_towers, static, size)

  def _assert_none_counter_fed_the_shard_size(self, num_towers, static, size):
    # tf.shape() / tf.size() read as values are the whole batch's (with a
    # static batch too: they are not folded into a shard's constant).
    values, _ = _assert_equal_to_one_device(_shard_size_counter_model_fn,
                                            num_towers, 8, 1, static, {
                                                "size": size,
                                                "aggregation": None
                                            })
    self.assertEqual(values["examples_seen"], 8)

  @parameterized.parameters([_SHAPES[1]])  # uneven, dynamic, 4 towers
  def test_counter_fed_the_shard_size_declared_sum_is_one_devices(
      self, num_towers, batch, static):
    self._assert_declared_sum_counter(num_towers, batch, static)

  @parameterized.parameters(_SHAPES[0], *_SHAPES[2:])
  @pytest.mark.wide
  def test_counter_fed_the_shard_size_declared_sum_is_one_devices_wide(
      self, num_towers, batch, static):
    self._assert_declared_sum_counter(num_towers, batch, static)

  def _assert_declared_sum_counter(self, num_towers, batch, static):
    steps = 2
    for size in ("shape", "size"):
      values, _ = _assert_equal_to_one_device(_shard_size_counter_model_fn,
                                              num_towers, batch, steps, static,
                                              {
                                                  "size": size,
                                                  "aggregation": SUM
                                              })
      self.assertEqual(values["examples_seen"], steps * batch)
      self.assertEqual(values["steps_seen"], steps)

  def test_shards_size_is_unknown_when_built(self):
    # x.shape[0] is the whole batch's on one device (7), the shard's in a
    # tower (4 or 3) if known when built: it is not, as with a batch of
    # unknown size, so no tower can write a shard's size as a constant.
    def model_fn(features, labels, mode):
      seen = tf.compat.v1.get_variable(
          "examples_seen", [],
          tf.int64,
          trainable=False,
          initializer=tf.compat.v1.zeros_initializer())
      count = seen.assign_add(features["x"].shape[0])  # a Python int
      loss = _loss(labels, _linear(features["x"]))
      with tf.control_dependencies([count]):
        train_op = _minimize(loss)
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    with self.assertRaisesRegex(ValueError, "None values not supported"):
      harness.train(model_fn, DATA, 7, 1, tower_devices=_towers(2))

  @parameterized.parameters(True, False)
  def test_writes_inside_a_cond_are_one_devices(self, static):
    # Keras' batch norm with a tensor `training` picks its statistics and
    # their updates in tf.conds, from the batch's moments (the whole
    # batch's): one device's, with a static batch and a dynamic one.
    def model_fn(features, labels, mode, params):
      del params
      training = tf.compat.v1.placeholder_with_default(True, [])
      layer = tf.keras.layers.BatchNormalization(name="bn")
      normalized = layer(features["x"], training=training)
      loss = _loss(labels, _linear(normalized))
      with tf.control_dependencies(layer.updates):
        train_op = _minimize(loss)
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    expected = harness.train(model_fn, DATA, 8, 2, static=static)
    actual = harness.train(
        model_fn, DATA, 8, 2, tower_devices=_towers(2), static=static)
    harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)

  def test_unwrapped_second_optimizer_trains_as_one_device(self):
    # Plain optimizers are routed like TowerOptimizer (see _meet.routing).
    def model_fn(features, labels, mode, params=None):
      del params
      logits = _linear(features["x"]) + _linear(features["x"], name="other")
      loss = _loss(labels, logits)
      first = [
          v for v in tf.compat.v1.trainable_variables()
          if v.op.name.startswith("logits")
      ]
      second = [
          v for v in tf.compat.v1.trainable_variables()
          if v.op.name.startswith("other")
      ]
      train_op = tf.group(
          replicate.TowerOptimizer(
              tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
                  loss, var_list=first),
          tf.compat.v1.train.AdagradOptimizer(0.1).minimize(
              loss, var_list=second))
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    expected_losses, expected = harness.train(model_fn, DATA, 8, 2)
    for num_towers in (2, 4):
      losses, values = harness.train(
          model_fn, DATA, 8, 2, tower_devices=_towers(num_towers))
      np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
      self.assertCountEqual(values, expected)
      for name, value in expected.items():
        np.testing.assert_allclose(
            values[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


class InitFromCheckpointTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    directory = tempfile.TemporaryDirectory()
    cls.addClassCleanup(directory.cleanup)
    cls.checkpoint = os.path.join(directory.name, "model")
    cls.kernel = np.arange(15, dtype=np.float32).reshape(5, 3) / 10.0
    with tf.Graph().as_default():
      tf.compat.v1.get_variable("logits/kernel", initializer=cls.kernel)
      tf.compat.v1.get_variable(
          "logits/bias", initializer=np.ones(3, np.float32))
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        tf.compat.v1.train.Saver().save(session, cls.checkpoint)

  def _train(self, tower_devices, steps=2):

    def model_fn(features, labels, mode):
      logits = _linear(features["x"])
      tf.compat.v1.train.init_from_checkpoint(
          os.path.dirname(self.checkpoint), {"logits/": "logits/"})
      loss = _loss(labels, logits)
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, train_op=_minimize(loss))

    with tf.Graph().as_default():
      tf.compat.v1.train.create_global_step()
      features, labels = harness.batches(DATA, 8)
      spec = harness.wrap(model_fn, tower_devices)(features, labels,
                                                   harness.TRAIN)
      kernel = tf.compat.v1.global_variables()[1]
      with tf.compat.v1.Session(config=harness.session_config()) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        initial = session.run(kernel)
        losses = [
            session.run([spec.loss, spec.train_op])[0] for _ in range(steps)
        ]
        return initial, losses, session.run(kernel)

  @parameterized.parameters((4,))
  def test_towers_start_from_the_checkpoint_and_train_like_one_device(
      self, num_towers):
    self._assert_towers_start_from_the_checkpoint(num_towers)

  @parameterized.parameters((2,))
  @pytest.mark.wide
  def test_towers_start_from_the_checkpoint_and_train_like_one_device_wide(
      self, num_towers):
    self._assert_towers_start_from_the_checkpoint(num_towers)

  def _assert_towers_start_from_the_checkpoint(self, num_towers):
    initial, losses, trained = self._train(_towers(num_towers))
    np.testing.assert_array_equal(initial, self.kernel)
    _, expected_losses, expected = self._train(None)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    np.testing.assert_allclose(trained, expected, rtol=1e-5, atol=1e-6)


def _hooks_model_fn(created):
  """Every tower makes a logging hook; tower 0 alone makes a chief hook."""

  def model_fn(features, labels, mode):
    loss = _loss(labels, _linear(features["x"]))
    tower = replicate.current_tower()
    logging_hook = tf.compat.v1.train.LoggingTensorHook(
        {
            "loss": loss,
            "x": features["x"]
        }, 1)
    nan_hook = tf.compat.v1.train.NanTensorHook(loss)
    hooks = {
        "logging": logging_hook,
        "nan": nan_hook,
        "scaffold": tf.compat.v1.train.Scaffold()
    }
    if tower is None or tower.index == 0:
      hooks["chief"] = tf.compat.v1.train.StepCounterHook()
    created.append(hooks)
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        train_op=_minimize(loss) if mode == harness.TRAIN else None,
        training_hooks=[logging_hook, nan_hook],
        training_chief_hooks=[hooks["chief"]] if "chief" in hooks else [],
        evaluation_hooks=[logging_hook],
        scaffold=hooks["scaffold"])

  return model_fn


class HooksTest(parameterized.TestCase):

  @parameterized.parameters(harness.TRAIN, harness.EVAL)
  def test_hooks_and_scaffold_are_tower_zeros(self, mode):
    created = []
    with tf.Graph().as_default():
      tf.compat.v1.train.create_global_step()
      features, labels = harness.batches(DATA, 8)
      spec = harness.wrap(_hooks_model_fn(created), _towers(4))(features,
                                                                labels, mode)
    self.assertLen(created, 4)
    # Towers are built 1, ..., N-1, then 0: tower 0's hooks were made last.
    hooks = (
        spec.training_hooks if mode == harness.TRAIN else spec.evaluation_hooks)
    tower_hooks = [created[-1]["logging"]]
    if mode == harness.TRAIN:
      tower_hooks.append(created[-1]["nan"])
      self.assertEqual(list(spec.training_chief_hooks), [created[-1]["chief"]])
    self.assertEqual(list(hooks), tower_hooks)
    self.assertIsInstance(hooks[0], tf.compat.v1.train.LoggingTensorHook)
    self.assertIs(spec.scaffold, created[-1]["scaffold"])
    # What the hooks fetch (the whole batch's loss) is in test_whole_batch.


class SummariesTest(parameterized.TestCase):

  def test_only_tower_zeros_summaries_are_kept_with_unwrapped_names(self):

    def model_fn(features, labels, mode):
      tf.compat.v1.summary.scalar("x_mean", tf.reduce_mean(features["x"]))
      loss = _loss(labels, _linear(features["x"]))
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, train_op=_minimize(loss))

    for tower_devices in (_towers(4), None):
      with tf.Graph().as_default() as graph:
        tf.compat.v1.train.create_global_step()
        features, labels = harness.batches(DATA, 8)
        harness.wrap(model_fn, tower_devices)(features, labels, harness.TRAIN)
        summaries = [
            t.op.name for t in tf.compat.v1.get_collection(
                tf.compat.v1.GraphKeys.SUMMARIES)
        ]
        self.assertEqual(summaries, ["x_mean"])
        ops = {op.name for op in graph.get_operations()}
      # The other towers' summary ops exist but nothing collects them.
      self.assertEqual("tower_1/x_mean" in ops, tower_devices is not None)


if __name__ == "__main__":
  parameterized.absltest.main()


def test_rows_scattered_by_tower_zero_alone_are_refused():
  # A memory bank of the batch's rows written by tower 0 only would hold
  # tower 0's rows alone: refused, naming the towers that did not write.
  def model_fn(features, labels, mode):
    x = features["x"]
    bank = tf.compat.v1.get_variable(
        "bank", [64, 5],
        initializer=tf.compat.v1.zeros_initializer(),
        trainable=False)
    loss = _loss(labels, _linear(x))
    tower = replicate.current_tower()
    updates = []
    if tower is None or tower.index == 0:
      rows = tf.range(tf.shape(x)[0])
      updates.append(tf.compat.v1.scatter_update(bank, rows, x))
    with tf.control_dependencies(updates):
      train_op = _minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(DATA, 8)
    with pytest.raises(
        ValueError,
        match=r"'bank' is scattered rows of the batch by "
        r"tower 0 but not by towers \[1\]"):
      harness.wrap(model_fn, _towers(2))(features, labels, harness.TRAIN)
