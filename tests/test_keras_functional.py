"""Keras models with batch norm, built in the model_fn, train as one device.

A functional model (and a Sequential one given its input shape) builds its
layers once on its `tf.keras.Input` placeholder, with the learning phase as
a tensor `training`, so batch norm's moving-average writes sit inside a
tf.cond that no step runs; the model_fn then calls the model on the
features with `training=True` (TRAIN) or False (EVAL, PREDICT). Those
never-run writes are not refused (issue 20 item 5), nor is any write in a
tf.cond that nothing fetches; writes inside a tf.cond the step runs (through
the train_op or a hook's tensors) still are. N towers against the unwrapped
model_fn on one device, same data and initial weights: every step's loss, every
trained variable and the moving statistics; eval losses and metrics;
predictions.

Tolerances: rtol 1e-5 with atol 1e-6. The towers add the same float32
terms in another order (sums over a batch of 7-10 rows, three layers, 3
steps): a few roundings of 2**-24 relative each, far below 1e-5; atol
covers values that cross zero. A tower's own statistics in place of the
batch's are off by 1e-2 or more.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness
from tests import models

TRAIN, EVAL, PREDICT = harness.TRAIN, harness.EVAL, harness.PREDICT
STEPS = 3
# (towers, batch, static): an uneven split, a dynamic batch, an even one.
SHAPES = [(2, 7, True), (4, 10, False), (4, 8, True)]
SHAPE_IDS = [
    f"{n}towers-batch{b}-{'static' if s else 'dynamic'}" for n, b, s in SHAPES
]
STYLES = [
    "functional", "sequential_with_input_shape", "sequential", "subclassed"
]


def _style_shapes():
  """Every style on every shape; the default run takes each style on one
  shape, in turn from the dynamic one, the others are `wide` cases."""
  cases = []
  for j, (shape, shape_id) in enumerate(zip(SHAPES, SHAPE_IDS)):
    for i, style in enumerate(STYLES):
      case = pytest.param if (i + 1) % len(SHAPES) == j else harness.wide
      cases.append(case(style, *shape, id=f"{style}-{shape_id}"))
  return cases


def _data(batch, steps=STEPS):
  rng = np.random.RandomState(batch)
  n = batch * steps
  x = rng.randn(n, 3).astype(np.float32) * 2.0 + 1.0
  return {"x": x}, rng.randn(n, 1).astype(np.float32)


def _layers():
  # No bias before batch norm: its gradient is zero up to rounding, and
  # Adam's step for a zero gradient (m / sqrt(v) of roundings) is noise.
  return [
      tf.keras.layers.Dense(4, use_bias=False, name="dense"),
      tf.keras.layers.BatchNormalization(
          name="bn",
          momentum=0.5,
          moving_mean_initializer=tf.keras.initializers.Constant(0.2),
          moving_variance_initializer=tf.keras.initializers.Constant(2.)),
      tf.keras.layers.Dense(1, name="out")
  ]


class _Subclassed(tf.keras.Model):

  def __init__(self):
    super().__init__(name="subclassed")
    self.dense, self.bn, self.out = _layers()

  def call(self, x, training=None):  # pylint: disable=arguments-differ
    return self.out(self.bn(self.dense(x), training=training))


class _Layers:
  """The layers called on the features, no model: no graph on an Input."""

  def __init__(self):
    self.dense, self.bn, self.out = _layers()

  def __call__(self, x, training):
    return self.out(self.bn(self.dense(x), training=training))

  def get_updates_for(self, inputs):
    return self.bn.updates if inputs is not None else []


def _model(style):
  if style == "functional":
    inputs = tf.keras.Input(shape=(3,))
    x = inputs
    for layer in _layers():
      x = layer(x)
    return tf.keras.Model(inputs, x)
  if style == "sequential_with_input_shape":
    return tf.keras.Sequential([tf.keras.Input(shape=(3,)), *_layers()])
  if style == "sequential":
    return tf.keras.Sequential(_layers())
  if style == "subclassed":
    return _Subclassed()
  assert style == "layers", style
  return _Layers()


def _model_fn(features, labels, mode, params):
  model = _model(params["style"])
  x = features["x"]
  if mode != TRAIN:
    predictions = model(x, training=False)
    if mode == PREDICT:
      return tf.estimator.EstimatorSpec(mode, predictions={"y": predictions})
    return tf.estimator.EstimatorSpec(
        mode,
        loss=tf.compat.v1.losses.mean_squared_error(labels, predictions),
        eval_metric_ops={
            "mae": tf.compat.v1.metrics.mean_absolute_error(
                labels, predictions)
        })
  step = tf.compat.v1.train.get_global_step()
  with tf.GradientTape() as tape:
    predictions = model(x, training=True)
    loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  # As users write it: the collection (empty for Keras layers in TF 2) and
  # the model's updates for its inputs (a functional model's `updates`
  # also hold those built on its Input, which no step can run).
  updates = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  if hasattr(model, "get_updates_for"):
    updates += model.get_updates_for(None) + model.get_updates_for(x)
  with tf.control_dependencies(updates):
    if params.get("optimizer") == "keras":
      optimizer = replicate.TowerOptimizer(
          tf.keras.optimizers.legacy.Adam(0.05))
      train_op = optimizer.minimize(
          loss, tf.compat.v1.trainable_variables(), tape=tape)
      with tf.control_dependencies([train_op]):
        train_op = step.assign_add(1)
    else:
      optimizer = replicate.TowerOptimizer(
          tf.compat.v1.train.AdamOptimizer(0.05))
      train_op = optimizer.minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _towers(n):
  return harness.devices(harness.VIRTUAL_CPUS, n)


def _train(params, batch, towers=None, static=True, **replicate_kwargs):
  """Losses of every step and every global variable after them."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(batch), batch, static)
    model_fn = _model_fn if towers is None else replicate.replicate_model_fn(
        _model_fn, devices=_towers(towers), **replicate_kwargs)
    spec = model_fn(features, labels, TRAIN, params)
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      return harness.run_training(session, spec, STEPS)


_ONE_DEVICE = {}


def _one_device(params, batch, static):
  key = (tuple(sorted(params.items())), batch, static)
  if key not in _ONE_DEVICE:
    _ONE_DEVICE[key] = _train(params, batch, static=static)
  return _ONE_DEVICE[key]


def _assert_close(actual, expected):
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style,towers,batch,static", _style_shapes())
def test_keras_model_with_batch_norm_trains_as_one_device(
    style, towers, batch, static):
  params = {"style": style}
  expected_losses, expected = _one_device(params, batch, static)
  losses, actual = _train(params, batch, towers, static)
  _assert_close(losses, expected_losses)
  assert sorted(actual) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(
        actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
  # The moving statistics moved: the updates ran, once per step.
  moving_mean = [n for n in expected if n.endswith("bn/moving_mean")]
  assert len(moving_mean) == 1
  assert np.all(np.abs(expected[moving_mean[0]] - 0.2) > 1e-3)


@pytest.mark.parametrize("towers", [harness.wide(2), 4])
def test_functional_model_with_a_keras_optimizer(towers):
  params = {"style": "functional", "optimizer": "keras"}
  expected_losses, expected = _one_device(params, 7, False)
  losses, actual = _train(params, 7, towers, static=False)
  _assert_close(losses, expected_losses)
  for name in expected:
    np.testing.assert_allclose(
        actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def _conv_model_fn(features, labels, mode, params):
  """A functional model whose batch norm Keras fuses (4-D input)."""
  del params  # unused
  inputs = tf.keras.Input(shape=(4, 4, 1))
  x = tf.keras.layers.Conv2D(3, 2, use_bias=False, name="conv")(inputs)
  x = tf.keras.layers.BatchNormalization(name="bn", momentum=0.5)(x)
  x = tf.keras.layers.Dense(1, name="out")(tf.keras.layers.Flatten()(x))
  model = tf.keras.Model(inputs, x)
  loss = tf.compat.v1.losses.mean_squared_error(
      labels, model(features["x"], training=True))
  with tf.control_dependencies(model.get_updates_for(features["x"])):
    train_op = replicate.TowerOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
            loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers", [harness.wide(2), 4])
def test_functional_model_with_fused_batch_norm(towers):
  rng = np.random.RandomState(3)
  data = ({
      "x": rng.randn(21, 4, 4, 1).astype(np.float32)
  }, rng.randn(21, 1).astype(np.float32))
  expected_losses, expected = harness.train(
      _conv_model_fn, data, 7, STEPS, static=False)
  losses, actual = harness.train(
      _conv_model_fn, data, 7, STEPS, _towers(towers), static=False)
  _assert_close(losses, expected_losses)
  for name in expected:
    np.testing.assert_allclose(
        actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
  assert np.all(np.abs(expected["bn/moving_mean"]) > 1e-3)


@pytest.mark.parametrize("towers", [harness.wide(2), 4])
def test_unsynchronised_functional_model_is_the_layers_own(towers):
  """sync_batch_norm=False: each tower's statistics, as the bare layers'."""
  losses, actual = _train({"style": "functional"},
                          10,
                          towers,
                          sync_batch_norm=False)
  expected_losses, expected = _train({"style": "layers"},
                                     10,
                                     towers,
                                     sync_batch_norm=False)
  _assert_close(losses, expected_losses)
  for name in expected:
    np.testing.assert_allclose(
        actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
  one_device_losses, _ = _one_device({"style": "layers"}, 10, True)
  # The shards' statistics, not the batch's: the first loss already differs.
  assert abs(losses[0] - one_device_losses[0]) > 1e-3


# The default run takes the dynamic shape.
@pytest.mark.parametrize(
    "towers,batch,static",
    [(harness.wide if shape[2] else pytest.param)(*shape, id=shape_id)
     for shape, shape_id in zip(SHAPES, SHAPE_IDS)])
def test_functional_model_evaluates_and_predicts_as_one_device(
    towers, batch, static):
  params = {"style": "functional"}
  data = _data(batch)
  expected_losses, expected_metrics = harness.evaluate(
      _model_fn, data, batch, STEPS, params=params, static=static)
  losses, metrics = harness.evaluate(
      _model_fn,
      data,
      batch,
      STEPS,
      _towers(towers),
      params=params,
      static=static)
  _assert_close(losses, expected_losses)
  _assert_close(metrics["mae"], expected_metrics["mae"])
  expected = harness.predict(
      _model_fn, data[0], batch, STEPS, params=params, static=static)
  actual = harness.predict(
      _model_fn,
      data[0],
      batch,
      STEPS,
      _towers(towers),
      params=params,
      static=static)
  harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)


def test_a_tensor_training_in_a_functional_model_is_one_devices():
  """The functional model called with a tensor `training` on the features:
  batch norm's statistics and updates in tf.conds, one device's."""

  def model_fn(features, labels, mode, params):
    del params  # unused
    model = _model("functional")
    training = tf.compat.v1.placeholder_with_default(True, [])
    loss = tf.compat.v1.losses.mean_squared_error(
        labels, model(features["x"], training=training))
    with tf.control_dependencies(model.get_updates_for(features["x"])):
      train_op = replicate.TowerOptimizer(
          tf.compat.v1.train.AdamOptimizer(0.05)).minimize(
              loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  expected_losses, expected = harness.train(model_fn, _data(8), 8, STEPS)
  losses, actual = harness.train(
      model_fn, _data(8), 8, STEPS, tower_devices=_towers(2))
  _assert_close(losses, expected_losses)
  for name in expected:
    np.testing.assert_allclose(
        actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def _counter_in_a_cond_model_fn(features, labels, mode, params):
  """A linear model; a counter written in a tf.cond, fetched as `params` say."""
  counter = tf.compat.v1.get_variable(
      "counter", [],
      tf.float32,
      trainable=False,
      initializer=tf.compat.v1.zeros_initializer(),
      aggregation=tf.VariableAggregation.SUM)
  x = features["x"]
  count = tf.cond(
      tf.reduce_sum(x) > -1e9,
      lambda: counter.assign_add(tf.reduce_sum(tf.ones_like(x))),
      lambda: tf.identity(counter))
  predictions = tf.compat.v1.layers.dense(x, 1, name="linear")
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  train_op = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1)).minimize(
          loss, tf.compat.v1.train.get_global_step())
  hooks = []
  if params["fetch"] == "hook":
    hooks = [tf.compat.v1.train.LoggingTensorHook({"count": count}, 1)]
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op, training_hooks=hooks)


@pytest.mark.parametrize("towers", [harness.wide(2), 4])
def test_a_write_in_a_tf_cond_no_fetch_reaches_is_left_alone(towers):
  params = {"fetch": None}
  expected_losses, expected = harness.train(
      _counter_in_a_cond_model_fn, _data(7), 7, STEPS, params=params)
  losses, actual = harness.train(
      _counter_in_a_cond_model_fn,
      _data(7),
      7,
      STEPS,
      _towers(towers),
      params=params)
  _assert_close(losses, expected_losses)
  for name in expected:
    np.testing.assert_allclose(
        actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
  assert expected["counter"] == 0  # on one device too, nothing ran it


def _counts_fetched_by_the_hook(tower_devices):
  """The counter after STEPS steps whose hook fetches the tf.cond's count."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(7), 7)
    spec = harness.wrap(_counter_in_a_cond_model_fn,
                        tower_devices)(features, labels, harness.TRAIN, {
                            "fetch": "hook"
                        })
    hook, = spec.training_hooks
    hook.begin()
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      counts = [
          session.run([spec.train_op,
                       hook.before_run(None).fetches])[1] for _ in range(STEPS)
      ]
  return [c["count"] for c in counts]


@pytest.mark.parametrize("towers", [harness.wide(2), 4])
def test_a_write_in_a_tf_cond_a_hook_fetches_is_one_devices(towers):
  # The tf.cond reduces the rows in its branch: it runs once, on the whole
  # batch, when the hook fetches it (once per step, as on one device).
  expected = _counts_fetched_by_the_hook(None)
  assert expected == [21.0 * (step + 1) for step in range(STEPS)]  # 7 x 3
  assert _counts_fetched_by_the_hook(_towers(towers)) == expected


def _op_layer_model_fn(features, labels, mode, params):
  """A functional model with TensorFlow ops on its Keras tensors: Keras
  wraps each in a layer named after the op (`tf_op_layer_Relu`), which in
  tower i's name scope is `tf_op_layer_tower_i/Relu`."""
  del params  # unused
  inputs = tf.keras.Input((5,))
  hidden = tf.nn.relu(tf.keras.layers.Dense(8, name="hidden")(inputs))
  outputs = tf.keras.layers.Dense(3, name="logits")(tf.math.square(hidden))
  model = tf.keras.Model(inputs, outputs)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, model(features["x"]))
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers", [harness.wide(2), 4])
def test_tensorflow_ops_on_keras_tensors_train_as_one_device(towers):
  # These were refused as towers building different models.
  expected_losses, expected = harness.train(_op_layer_model_fn, models.data(),
                                            8, 3)
  losses, actual = harness.train(
      _op_layer_model_fn,
      models.data(),
      8,
      3,
      tower_devices=harness.devices(harness.VIRTUAL_CPUS, towers))
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  assert sorted(actual) == sorted(expected)
  harness.assert_close_nests(actual, expected)
