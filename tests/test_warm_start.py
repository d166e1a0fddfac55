"""An Estimator's warm start comes with its model_fn when it is replicated.

`Estimator.train` warm-starts after calling its model_fn: a canned
estimator's `warm_start_from`, and `model_to_estimator`'s start from the
Keras model's own weights. The documented recipe,
`Estimator(replicate_model_fn(canned.model_fn), model_dir=..., config=...)`,
passes neither, and started from fresh initial values (a pretrained Keras
model trained from scratch, silently). The replicated model_fn now warm-starts
as the Estimator it came from: trained variables equal the plain estimator's.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

ROWS = 8
STEPS = 2


def _input_fn():
  rng = np.random.RandomState(5)
  x = rng.randn(STEPS * ROWS, 4).astype(np.float32)
  y = rng.randint(0, 3, STEPS * ROWS).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(ROWS)


def _config(model_dir, seed):
  return replicate.testing.run_config(
      4, model_dir=str(model_dir), tf_random_seed=seed)


def _replicated(estimator, num_towers, **estimator_kwargs):
  """The README's recipe: the estimator's model_fn, model_dir and config
  (and `estimator_kwargs`), in an Estimator of the same API version."""
  estimator_class = (
      tf.estimator.Estimator if isinstance(estimator, tf.estimator.Estimator)
      else tf.compat.v1.estimator.Estimator)
  return estimator_class(
      replicate.replicate_model_fn(
          estimator.model_fn,
          devices=harness.devices(harness.VIRTUAL_CPUS, num_towers)),
      model_dir=estimator.model_dir,
      config=estimator.config,
      **estimator_kwargs)


def _values(model_dir):
  reader = tf.train.load_checkpoint(str(model_dir))
  return {
      name: reader.get_tensor(name)
      for name in reader.get_variable_to_shape_map()
      if name != "_CHECKPOINTABLE_OBJECT_GRAPH"
  }


def _assert_same_values(actual, expected):
  assert sorted(actual) == sorted(expected)
  for name, value in expected.items():
    # Two small steps; the towers sum in another order.
    np.testing.assert_allclose(
        actual[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _columns():
  return [tf.feature_column.numeric_column("x", shape=(4,))]


def _optimizer():
  # A function, not a name: tensorflow_estimator 2.13 looks a named (or
  # default) optimizer's learning rate up with inspect.getargspec, which
  # Python 3.11 removed.
  return tf.keras.optimizers.legacy.Adagrad(0.1)


def _dnn(model_dir, seed, warm_start_from=None, v1=False):
  """A DNNClassifier (v2, or the tf.compat.v1 one) on the test's columns."""
  if v1:
    return tf.compat.v1.estimator.DNNClassifier(
        hidden_units=[5],
        feature_columns=_columns(),
        n_classes=3,
        config=_config(model_dir, seed),
        warm_start_from=warm_start_from)
  return tf.estimator.DNNClassifier(
      hidden_units=[5],
      feature_columns=_columns(),
      n_classes=3,
      optimizer=_optimizer,
      config=_config(model_dir, seed),
      warm_start_from=warm_start_from)


@pytest.fixture(scope="module")
def warm_checkpoint(tmp_path_factory):
  """A DNNClassifier trained with another seed: the warm start's source."""
  model_dir = tmp_path_factory.mktemp("source")
  _dnn(model_dir, seed=11).train(_input_fn, steps=STEPS)
  return str(model_dir)


@pytest.mark.parametrize("num_towers", [harness.wide(1), harness.wide(2), 4])
def test_canned_warm_start_from_is_kept(warm_checkpoint, num_towers, tmp_path):
  _dnn(tmp_path / "plain", 1, warm_checkpoint).train(_input_fn, steps=STEPS)
  _replicated(_dnn(tmp_path / "towers", 1, warm_checkpoint), num_towers).train(
      _input_fn, steps=STEPS)
  expected = _values(tmp_path / "plain")
  _assert_same_values(_values(tmp_path / "towers"), expected)
  # The warm start mattered: seed 1's own initial values train elsewhere.
  _dnn(tmp_path / "cold", 1).train(_input_fn, steps=STEPS)
  cold = _values(tmp_path / "cold")
  assert not np.allclose(cold["dnn/hiddenlayer_0/kernel"],
                         expected["dnn/hiddenlayer_0/kernel"])


def test_v1_canned_warm_start_settings_with_a_subset(warm_checkpoint, tmp_path):
  # Only the hidden layer warm-starts; the logits start from seed 1's values.
  settings = tf.estimator.WarmStartSettings(
      ckpt_to_initialize_from=warm_checkpoint,
      vars_to_warm_start="dnn/hiddenlayer_0/.*")
  _dnn(tmp_path / "plain", 1, settings, v1=True).train(_input_fn, steps=STEPS)
  _replicated(_dnn(tmp_path / "towers", 1, settings, v1=True), 2).train(
      _input_fn, steps=STEPS)
  _assert_same_values(_values(tmp_path / "towers"), _values(tmp_path / "plain"))


def test_warm_start_also_given_to_the_replicated_estimator(
    warm_checkpoint, tmp_path):
  # Both the model_fn and the Estimator warm-start, from the same place.
  _dnn(tmp_path / "plain", 1, warm_checkpoint).train(_input_fn, steps=STEPS)
  _replicated(
      _dnn(tmp_path / "towers", 1, warm_checkpoint),
      2,
      warm_start_from=warm_checkpoint).train(
          _input_fn, steps=STEPS)
  _assert_same_values(_values(tmp_path / "towers"), _values(tmp_path / "plain"))


def _keras_estimator(model_dir):
  """model_to_estimator of a model whose weights were set ("pretrained")."""
  with tf.Graph().as_default():
    inputs = tf.keras.Input((4,), name="x")
    hidden = tf.keras.layers.Dense(5, activation="relu", name="hidden")(inputs)
    model = tf.keras.Model(inputs,
                           tf.keras.layers.Dense(3, name="logits")(hidden))
    rng = np.random.RandomState(2)
    model.set_weights(
        [rng.randn(*w.shape).astype(np.float32) for w in model.get_weights()])
    model.compile(
        optimizer=tf.keras.optimizers.legacy.SGD(0.1),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return tf.keras.estimator.model_to_estimator(
        keras_model=model, config=_config(model_dir, seed=1))


@pytest.mark.parametrize("num_towers", [harness.wide(1), 2])
def test_keras_model_weights_are_the_start(num_towers, tmp_path):
  _keras_estimator(tmp_path / "plain").train(_input_fn, steps=STEPS)
  _replicated(_keras_estimator(tmp_path / "towers"), num_towers).train(
      _input_fn, steps=STEPS)
  _assert_same_values(_values(tmp_path / "towers"), _values(tmp_path / "plain"))


def test_a_model_fn_of_no_estimator_does_not_warm_start(tmp_path):

  def model_fn(features, labels, mode):
    logits = tf.compat.v1.layers.dense(
        features["x"],
        3,
        name="logits",
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=4))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  for name, fn in (("plain", model_fn),
                   ("towers",
                    replicate.replicate_model_fn(
                        model_fn,
                        devices=harness.devices(harness.VIRTUAL_CPUS, 2)))):
    tf.estimator.Estimator(
        fn, config=_config(tmp_path / name, seed=3)).train(
            _input_fn, steps=STEPS)
  _assert_same_values(_values(tmp_path / "towers"), _values(tmp_path / "plain"))
