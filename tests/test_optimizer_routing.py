"""Optimizers as on one device, wrapped in TowerOptimizer or not.

An optimizer's own `minimize` (v1) or `get_updates` / `minimize` (Keras) is
called once per step with the whole batch's loss, however many towers; an
unwrapped optimizer (the canned estimators' defaults and names included)
trains as one device; what cannot be routed is refused naming
TowerOptimizer. Batches of 7 do not divide by 2 or 4 towers.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

BATCH = 7
STEPS = 3
COLUMNS = [tf.feature_column.numeric_column("x", shape=(5,))]
TRAIN = tf.estimator.ModeKeys.TRAIN


def _data(n=BATCH * STEPS):
  rng = np.random.RandomState(0)
  x = rng.randn(n, 5).astype(np.float32)
  return {"x": x}, np.argmax(x[:, :3], axis=1).astype(np.int64)


def _towers(num_towers):
  return None if num_towers is None else harness.devices(
      harness.VIRTUAL_CPUS, num_towers)


def _train(model_fn, num_towers, config=None):
  """Trains STEPS steps; returns the losses and every variable after."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(), BATCH)
    devices = _towers(num_towers)
    fn = model_fn if devices is None else replicate.replicate_model_fn(
        model_fn, devices=devices)
    kwargs = {} if config is None else {"config": config}
    spec = fn(features, labels, TRAIN, **kwargs)
    # Soft placement: the canned DNN's zero_fraction summary needs it on
    # towers (issue 19 item 6, not an optimizer matter).
    with tf.compat.v1.Session(config=harness.session_config(
        soft=True)) as session:
      return harness.run_training(session, spec, STEPS)


def _turns(forms, tower_counts=(4, 2)):
  """Each form on one tower count, the default run's cases, and on the
  others as `wide` cases. The counts take staggered turns (4, 2, 2, 4, 4,
  ...), so that both values of a form's last factor meet both counts."""
  n = len(tower_counts)
  default = [(*f, tower_counts[(i + i // n) % n]) for i, f in enumerate(forms)]
  return default + [
      harness.wide(*f, count)
      for f in forms
      for count in tower_counts
      if (*f, count) not in default
  ]


def _assert_one_device(actual, expected):
  (losses, values), (expected_losses, expected_values) = actual, expected
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)
  assert sorted(values) == sorted(expected_values)
  for name, value in expected_values.items():
    # An accumulator (Ftrl's `linear`) sums terms as large as its largest
    # entries, so a small entry's rounding error is theirs: on a GPU one
    # entry of 4.6e-3 beside 12.0 came 2.7e-6 off.
    atol = 1e-6 * max(1.0, float(np.max(np.abs(value))))
    np.testing.assert_allclose(
        values[name], value, rtol=1e-5, atol=atol, err_msg=name)
  assert values["global_step"] == STEPS


# Subclasses counting the calls of their own methods.
class _CountingAdagrad(tf.compat.v1.train.AdagradOptimizer):
  losses = []

  def minimize(self, loss, *args, **kwargs):
    _CountingAdagrad.losses.append(loss)
    return super().minimize(loss, *args, **kwargs)


class _CountingKerasAdam(tf.keras.optimizers.legacy.Adam):
  losses = []

  def get_updates(self, loss, params):
    _CountingKerasAdam.losses.append(loss)
    return super().get_updates(loss, params)

  def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
    _CountingKerasAdam.losses.append(loss)
    return super().minimize(loss, var_list, grad_loss, name, tape)


class _OnlyGetUpdates(tf.keras.optimizers.legacy.Optimizer):
  """Like tensorflow_estimator's mock_optimizer_v2: get_updates only.

  It records the loss it gets in `seen_loss` and counts the step itself.
  """
  losses = []

  def get_updates(self, loss, params):
    _OnlyGetUpdates.losses.append(loss)
    seen = tf.compat.v1.get_variable(
        "seen_loss", [], trainable=False, initializer=tf.zeros_initializer())
    with tf.control_dependencies([seen.assign(loss)]):
      return [self.iterations.assign_add(1).op]

  def get_config(self):
    return super().get_config()


def _model_fn(make_optimizer, call):
  """A small MLP; `call` is how the optimizer is used."""

  def model_fn(features, labels, mode):
    global_step = tf.compat.v1.train.get_global_step()
    tape = tf.GradientTape() if call == "keras_minimize" else None
    with tape or tf.name_scope("forward"):
      hidden = tf.compat.v1.layers.dense(
          features["x"], 4, tf.nn.relu, name="hidden")
      logits = tf.compat.v1.layers.dense(hidden, 3, name="logits")
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = make_optimizer()
    variables = tf.compat.v1.trainable_variables()
    if call == "v1_minimize":
      train_op = optimizer.minimize(loss, global_step)
    else:
      optimizer.iterations = global_step  # as the v2 canned heads do
      if call == "get_updates":
        train_op = optimizer.get_updates(loss, variables)[0]
      else:
        train_op = optimizer.minimize(loss, variables, tape=tape)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


OPTIMIZERS = {
    "v1_minimize": (_CountingAdagrad, lambda: _CountingAdagrad(0.3)),
    "get_updates": (_CountingKerasAdam, lambda: _CountingKerasAdam(0.05)),
    "keras_minimize": (_CountingKerasAdam, lambda: _CountingKerasAdam(0.05)),
}


def _counted_run(call, wrapped, num_towers):
  cls, make = OPTIMIZERS[call]
  make_optimizer = ((lambda: replicate.TowerOptimizer(make()))
                    if wrapped else make)
  cls.losses = []
  result = _train(_model_fn(make_optimizer, call), num_towers)
  return len(cls.losses), result


@pytest.mark.parametrize("call", sorted(OPTIMIZERS))
def test_own_method_called_once_outside_and_on_one_tower(call):
  calls, expected = _counted_run(call, False, None)
  assert calls == 1
  calls, outside = _counted_run(call, True, None)  # not replicated at all
  assert calls == 1
  _assert_one_device(outside, expected)
  calls, one_tower = _counted_run(call, True, 1)
  assert calls == 1
  _assert_one_device(one_tower, expected)


@pytest.mark.parametrize(
    "call,wrapped,num_towers",
    _turns([(c, w) for c in sorted(OPTIMIZERS) for w in (True, False)]))
def test_own_method_called_once_in_towers(call, wrapped, num_towers):
  _, expected = _counted_run(call, False, None)
  calls, result = _counted_run(call, wrapped, num_towers)
  assert calls == 1
  _assert_one_device(result, expected)


@pytest.mark.parametrize(
    "shared,wrapped,num_towers",
    _turns([(s, w) for s in (True, False) for w in (True, False)]))
def test_only_get_updates_gets_the_whole_batch_loss(shared, wrapped,
                                                    num_towers):
  instance = {}

  def make():
    # One instance every tower uses, or a new one in every model_fn call.
    optimizer = instance.get("optimizer") or _OnlyGetUpdates(name="mock")
    if shared:
      instance["optimizer"] = optimizer
    return replicate.TowerOptimizer(optimizer) if wrapped else optimizer

  _OnlyGetUpdates.losses = []
  expected = _train(_model_fn(make, "get_updates"), None)
  instance.clear()
  _OnlyGetUpdates.losses = []
  result = _train(_model_fn(make, "get_updates"), num_towers)
  assert len(_OnlyGetUpdates.losses) == 1
  # seen_loss: the loss get_updates got, one device's; global_step: once a step.
  _assert_one_device(result, expected)
  assert result[1]["seen_loss"] == pytest.approx(expected[0][-1], rel=1e-5)


def _mock_v1_optimizer():
  """A v1 mock as tensorflow_estimator's mock_optimizer: `minimize` only."""
  optimizer = tf.compat.v1.test.mock.NonCallableMagicMock(
      spec=tf.compat.v1.train.Optimizer,
      wraps=tf.compat.v1.train.Optimizer(use_locking=False, name="mock"))

  def minimize(loss, global_step=None, var_list=None):
    del var_list
    seen = tf.compat.v1.get_variable(
        "seen_loss", [], trainable=False, initializer=tf.zeros_initializer())
    with tf.control_dependencies([seen.assign(loss)]):
      return tf.compat.v1.assign_add(global_step, 1).op

  optimizer.minimize = tf.compat.v1.test.mock.MagicMock(wraps=minimize)
  return optimizer


@pytest.mark.parametrize("num_towers", [harness.wide(2), 4])
def test_mock_v1_optimizer(num_towers):
  mocks = []

  def make(wrapped):

    def make_optimizer():
      mocks.append(_mock_v1_optimizer())
      return replicate.TowerOptimizer(mocks[-1]) if wrapped else mocks[-1]

    return make_optimizer

  with pytest.raises(
      ValueError,
      match="no optimizer call the towers could "
      "share.*a mock.*replicate.TowerOptimizer"):
    _train(_model_fn(make(False), "v1_minimize"), num_towers)
  mocks.clear()
  expected = _train(_model_fn(make(False), "v1_minimize"), None)
  mocks.clear()
  result = _train(_model_fn(make(True), "v1_minimize"), num_towers)
  # Towers are built 1, ..., N-1, then 0: tower 0's optimizer (the last
  # made) makes the one call.
  assert [m.minimize.call_count for m in mocks] == [0] * (num_towers - 1) + [1]
  _assert_one_device(result, expected)


# Canned v2 estimators with their optimizers unwrapped: defaults, names,
# an instance, and DNNLinearCombined's two optimizers (two get_updates).
CANNED = {
    "dnn_default":
        lambda config: tf.estimator.DNNClassifier(
            hidden_units=[4],
            feature_columns=COLUMNS,
            n_classes=3,
            config=config),
    "dnn_adagrad_name":
        lambda config: tf.estimator.DNNClassifier(
            hidden_units=[4],
            feature_columns=COLUMNS,
            n_classes=3,
            optimizer="Adagrad",
            config=config),
    "dnn_ftrl_name":
        lambda config: tf.estimator.DNNClassifier(
            hidden_units=[4],
            feature_columns=COLUMNS,
            n_classes=3,
            optimizer="Ftrl",
            config=config),
    "dnn_instance":
        lambda config: tf.estimator.DNNClassifier(
            hidden_units=[4],
            feature_columns=COLUMNS,
            n_classes=3,
            optimizer=tf.keras.optimizers.legacy.Adam(0.05),
            config=config),
    "dnn_linear_combined_defaults":
        lambda config: (tf.estimator.DNNLinearCombinedClassifier(
            linear_feature_columns=COLUMNS,
            dnn_feature_columns=COLUMNS,
            dnn_hidden_units=[4],
            n_classes=3,
            config=config)),
}


def _canned_run(name, num_towers):
  canned = CANNED[name](tf.estimator.RunConfig())
  return _train(canned.model_fn, num_towers, config=canned.config)


@pytest.mark.parametrize("name,num_towers",
                         _turns([(n,) for n in sorted(CANNED)]))
def test_canned_v2_unwrapped_optimizers(name, num_towers):
  expected = _canned_run(name, None)
  result = _canned_run(name, num_towers)
  _assert_one_device(result, expected)
  # It trained: the variables moved from their seeded start.
  kernel = [n for n in expected[1] if n.endswith("kernel")][0]
  start = harness.initial_value(kernel, expected[1][kernel].shape, tf.float32)
  assert np.abs(result[1][kernel] - start).max() > 1e-4


def _keras_model_fn(wrapped, model_dir):
  """model_to_estimator's model_fn of a compiled Keras model."""
  model = tf.keras.Sequential([
      tf.keras.layers.Dense(
          4, activation="relu", input_shape=(5,), name="hidden"),
      tf.keras.layers.Dense(3, name="logits")
  ])
  optimizer = tf.keras.optimizers.legacy.Adam(0.05)
  model.compile(
      optimizer=replicate.TowerOptimizer(optimizer) if wrapped else optimizer,
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  estimator = tf.keras.estimator.model_to_estimator(
      keras_model=model,
      model_dir=str(model_dir),
      config=tf.estimator.RunConfig())

  def model_fn(features, labels, mode, config):
    return estimator.model_fn({"hidden_input": features["x"]}, labels, mode,
                              config)

  return model_fn, estimator.config


@pytest.mark.parametrize("wrapped,num_towers", _turns([(True,), (False,)]))
def test_model_to_estimator(wrapped, num_towers, tmp_path):
  with tf.Graph().as_default():
    model_fn, config = _keras_model_fn(wrapped, tmp_path / "plain")
  expected = _train(model_fn, None, config)
  with tf.Graph().as_default():
    model_fn, config = _keras_model_fn(wrapped, tmp_path / "towers")
  _assert_one_device(_train(model_fn, num_towers, config), expected)


def test_keras_tower_optimizer_config_round_trips():
  transform = replicate.TowerOptimizer.clip_by_global_norm(1.0)
  optimizer = replicate.TowerOptimizer(
      tf.keras.optimizers.legacy.Adam(0.03, beta_1=0.8),
      gradient_transform=transform)
  clone = type(optimizer).from_config(optimizer.get_config())
  assert type(clone.optimizer) is tf.keras.optimizers.legacy.Adam
  assert clone.optimizer.get_config() == optimizer.optimizer.get_config()
  assert clone.get_config()["gradient_transform"] is transform


def _sdca():
  return tf.estimator.LinearClassifier(
      feature_columns=COLUMNS,
      optimizer=tf.estimator.experimental.LinearSDCA(
          example_id_column="example_id"),
      config=tf.estimator.RunConfig())


def _kmeans():
  return tf.compat.v1.estimator.experimental.KMeans(
      num_clusters=2, config=tf.estimator.RunConfig())


@pytest.mark.parametrize(
    "make,name,other_modes",
    [(_sdca, "LinearSDCA", "its EVAL and PREDICT graphs replicate"),
     (_kmeans, "KMeansClustering", "evaluate and predict with it unwrapped")])
def test_gradient_free_trainers_refused(make, name, other_modes):
  estimator = make()
  data, y = _data(8)
  x = data["x"]
  for mode in (TRAIN, tf.estimator.ModeKeys.EVAL):
    with tf.Graph().as_default():
      tf.compat.v1.train.create_global_step()
      if name == "KMeansClustering":
        features, labels = tf.constant(x), None
      else:
        features = {
            "x": tf.constant(x),
            "example_id": tf.constant([str(i) for i in range(8)])
        }
        labels = tf.constant(y[:, None] % 2)
      fn = replicate.replicate_model_fn(estimator.model_fn, devices=_towers(2))
      if mode == TRAIN:
        with pytest.raises(
            ValueError,
            match=(
                f"{name}.*trains without gradients of a loss.*with or without "
                "replicate.TowerOptimizer; train it with the unwrapped "
                f"model_fn; {other_modes}")):
          fn(features, labels, mode, config=estimator.config)
      elif name == "KMeansClustering":
        with pytest.raises(
            ValueError,
            match=(f"{name} cannot be replicated in eval: {other_modes}")):
          fn(features, labels, mode, config=estimator.config)
      else:
        spec = fn(features, labels, mode, config=estimator.config)
        assert spec.loss is not None


@pytest.mark.parametrize("dynamic,num_towers", _turns([(True,), (False,)]))
def test_unwrapped_keras_loss_scale_optimizer(dynamic, num_towers):
  # Its get_gradients / apply_gradients are its own (routed overrides).
  def make():
    return tf.keras.mixed_precision.LossScaleOptimizer(
        tf.keras.optimizers.legacy.Adam(0.05),
        dynamic=dynamic,
        **({} if dynamic else {
            "initial_scale": 128.0
        }))

  expected = _train(_model_fn(make, "get_updates"), None)
  _assert_one_device(
      _train(_model_fn(make, "get_updates"), num_towers), expected)


@pytest.mark.parametrize("num_towers", [harness.wide(2), 4])
def test_unwrapped_v1_loss_scale_optimizer(num_towers):
  # Its compute_gradients / apply_gradients are its own (routed overrides).
  def make():
    return tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
        tf.compat.v1.train.AdagradOptimizer(0.3), loss_scale=128.0)

  expected = _train(_model_fn(make, "v1_minimize"), None)
  _assert_one_device(
      _train(_model_fn(make, "v1_minimize"), num_towers), expected)


def test_routing_is_undone_after_the_towers():
  v1, keras = tf.compat.v1.train.Optimizer, tf.keras.optimizers.legacy.Optimizer
  names = ("minimize", "compute_gradients", "apply_gradients", "get_updates",
           "get_gradients", "iterations")
  before = {
      (cls, n): cls.__dict__.get(n) for cls in (v1, keras, _CountingAdagrad)
      for n in names
  }
  with pytest.raises(ValueError, match="no optimizer call"):
    _train(_model_fn(lambda: _mock_v1_optimizer(), "v1_minimize"), 2)
  _counted_run("get_updates", False, 2)
  assert {k: k[0].__dict__.get(k[1]) for k in before} == before
