"""Keras models with TowerOptimizer: checkpoints as the unwrapped optimizer's.

`model_to_estimator` saves a Keras model through its object graph: the
optimizer's hyperparameter variables are saved only if the optimizer
object reaches them. A compiled `TowerOptimizer(keras_optimizer)` hands
that graph the wrapped optimizer's own children, so its checkpoints have
the unwrapped optimizer's keys, and training resumes from them plain or
replicated (it failed to restore before: 'Variables not initialized:
training/SGD/decay, ...'). A conv net with batch norm in
`model_to_estimator` also trains, evaluates and predicts as one device on
4 towers (`assert_replicates` starts them from one device's checkpoint).
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

ROWS = 10

# Keras optimizers, and a tf.compat.v1 one (Keras compiles it in a
# TFOptimizer, which tracks it as a child).
_OPTIMIZERS = {
    "sgd": lambda: tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
    "adam": lambda: tf.keras.optimizers.legacy.Adam(0.01),
    "v1_adam": lambda: tf.compat.v1.train.AdamOptimizer(0.01),
}


def _keras_model(wrapped: bool, optimizer: str = "sgd"):
  """A compiled conv net with batch norm: TowerOptimizer or the optimizer."""
  model = tf.keras.Sequential([
      tf.keras.layers.Reshape([4, 4, 2], input_shape=(32,), name="maps"),
      # No bias before batch norm: its gradient is zero but for rounding,
      # which Adam's normalised steps would magnify.
      tf.keras.layers.Conv2D(
          4,
          2,
          use_bias=False,
          name="conv",
          kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1)),
      tf.keras.layers.BatchNormalization(name="bn"),
      tf.keras.layers.ReLU(),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(
          3,
          name="logits",
          kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))
  ])
  built = _OPTIMIZERS[optimizer]()
  model.compile(
      optimizer=replicate.TowerOptimizer(built) if wrapped else built,
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"])
  return model


def _estimator(tmp_path, wrapped, optimizer="sgd"):
  with tf.Graph().as_default():
    return tf.keras.estimator.model_to_estimator(
        keras_model=_keras_model(wrapped, optimizer),
        model_dir=str(tmp_path / "keras"))


def _input_fn():
  rng = np.random.RandomState(3)
  x = (2.0 * rng.randn(3 * ROWS, 32) + 1.0).astype(np.float32)
  y = rng.randint(0, 3, 3 * ROWS).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices(({"maps_input": x}, y)).batch(ROWS)


# An unwrapped optimizer in model_to_estimator is also in
# test_optimizer_routing.py.
@pytest.mark.parametrize("wrapped", [
    pytest.param(True, id="tower_optimizer"),
    harness.wide(False, id="keras_optimizer")
])
def test_model_to_estimator_with_batch_norm_is_one_devices(wrapped, tmp_path):
  estimator = _estimator(tmp_path, wrapped)
  summary = replicate.testing.assert_replicates(
      estimator,
      _input_fn,
      towers=(4,),
      steps=3,
      model_dir=str(tmp_path / "runs"))
  assert summary.predictions == 3 * ROWS
  assert "accuracy" in summary.metrics
  moving_mean = tf.train.load_variable(
      str(tmp_path / "runs" / "one_device"),
      "layer_with_weights-1/moving_mean/.ATTRIBUTES/VARIABLE_VALUE")
  assert np.abs(moving_mean).min() > 1e-4  # batch norm's statistics moved


def _checkpoint_keys(model_dir):
  return sorted(name for name, _ in tf.train.list_variables(model_dir))


@pytest.mark.parametrize("optimizer", sorted(_OPTIMIZERS))
def test_checkpoint_keys_are_the_unwrapped_optimizers(optimizer, tmp_path):
  keys = {}
  for wrapped in (True, False):
    estimator = tf.estimator.Estimator(
        _estimator(tmp_path / str(wrapped), wrapped, optimizer).model_fn,
        config=replicate.testing.run_config(
            2, model_dir=str(tmp_path / f"run_{wrapped}")))
    estimator.train(_input_fn, steps=1)
    keys[wrapped] = _checkpoint_keys(str(tmp_path / f"run_{wrapped}"))
  assert keys[True] == keys[False]
  # The optimizer's own variables are saved (they were not, through the
  # wrapper): Keras' hyperparameters, v1 Adam's beta powers.
  assert ("optimizer/optimizer/beta1_power/.ATTRIBUTES/VARIABLE_VALUE"
          if optimizer == "v1_adam" else
          "optimizer/learning_rate/.ATTRIBUTES/VARIABLE_VALUE") in keys[True]


def _train_twice(tmp_path, first, second, optimizer):
  """Two Estimator.train calls of 2 steps on one model_dir, each plain
  (the model_to_estimator model_fn) or replicated on 2 towers; the final
  checkpoint's values."""
  model_dir = str(tmp_path / f"{first}_{second}")
  for i, how in enumerate((first, second)):
    model_fn = _estimator(tmp_path / f"{first}_{second}_{i}", True,
                          optimizer).model_fn
    if how == "replicated":
      model_fn = replicate.replicate_model_fn(
          model_fn, devices=harness.devices(harness.VIRTUAL_CPUS, 2))
    tf.estimator.Estimator(
        model_fn,
        config=replicate.testing.run_config(
            2, model_dir=model_dir, tf_random_seed=0)).train(
                _input_fn, steps=2)
  reader = tf.train.load_checkpoint(model_dir)
  return {
      name: reader.get_tensor(name)
      for name in _checkpoint_keys(model_dir)
      if name != "_CHECKPOINTABLE_OBJECT_GRAPH"
  }


@pytest.fixture(scope="module")
def plain_twice(tmp_path_factory):
  """plain -> plain's values, per optimizer (computed once each)."""
  values = {}

  def get(optimizer):
    if optimizer not in values:
      values[optimizer] = _train_twice(
          tmp_path_factory.mktemp(optimizer), "plain", "plain", optimizer)
    return values[optimizer]

  return get


# Every order with one optimizer; the others (their keys are checked above)
# resume a replicated run. The default run keeps the two orders that mix
# plain and replicated runs (replicated -> replicated combines their save
# and restore).
@pytest.mark.parametrize("first,second,optimizer", [
    ("plain", "replicated", "sgd"),
    harness.wide(
        "replicated", "replicated", "sgd", id="replicated-replicated-sgd"),
    ("replicated", "plain", "sgd"),
    harness.wide(
        "replicated", "replicated", "adam", id="replicated-replicated-adam"),
    harness.wide(
        "replicated",
        "replicated",
        "v1_adam",
        id="replicated-replicated-v1_adam"),
])
def test_training_resumes_from_either_runs_checkpoint(first, second, optimizer,
                                                      plain_twice, tmp_path):
  expected = plain_twice(optimizer)
  actual = _train_twice(tmp_path, first, second, optimizer)
  assert sorted(actual) == sorted(expected)
  assert expected["estimator_global_step/.ATTRIBUTES/VARIABLE_VALUE"] == 4
  for name, value in expected.items():
    # Four small steps; the towers sum in another order (float32 roundings
    # far below the tolerance).
    np.testing.assert_allclose(
        actual[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _eager_step(layer, optimizer):
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(layer(tf.ones([4, 3]))**2)
  gradients = tape.gradient(loss, layer.trainable_variables)
  optimizer.apply_gradients(zip(gradients, layer.trainable_variables))


def _eager_layer_and_optimizer(wrapped, kind):
  layer = tf.keras.layers.Dense(2, kernel_initializer="ones")
  layer.build([None, 3])
  optimizer = (
      tf.keras.optimizers.legacy.Adam(0.1)
      if kind == "keras" else tf.compat.v1.train.AdamOptimizer(0.1))
  return layer, (replicate.TowerOptimizer(optimizer) if wrapped else optimizer)


@pytest.mark.parametrize("kind", ["keras", "v1"])
@pytest.mark.parametrize("save_wrapped,restore_wrapped", [(True, False),
                                                          (False, True),
                                                          (True, True)])
def test_object_checkpoints_restore_either_way(save_wrapped, restore_wrapped,
                                               kind, tmp_path):
  # tf.train.Checkpoint, restored before the optimizer has created its
  # slots and hyperparameters (deferred restoration): one more step lands
  # where three uninterrupted steps do.
  layer, optimizer = _eager_layer_and_optimizer(save_wrapped, kind)
  for _ in range(2):
    _eager_step(layer, optimizer)
  path = tf.train.Checkpoint(
      model=layer, optimizer=optimizer).save(str(tmp_path / "ckpt"))
  restored, restored_optimizer = _eager_layer_and_optimizer(
      restore_wrapped, kind)
  status = tf.train.Checkpoint(
      model=restored, optimizer=restored_optimizer).restore(path)
  _eager_step(restored, restored_optimizer)
  status.assert_consumed()
  _eager_step(layer, optimizer)
  if kind == "keras":
    assert restored_optimizer.iterations.numpy() == 3
  np.testing.assert_allclose(
      restored.kernel.numpy(), layer.kernel.numpy(), rtol=1e-6)
