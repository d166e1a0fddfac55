"""The gradient applied is the gradient of the loss reported.

`replicate` rewires graphs after the towers are built (combined state
writes, the between-shard variance of moving variances), when their
gradients already exist. A rewired tensor that the model reads would change
the forward pass behind its gradient's back. These tests take one training
step and compare the update the optimizer applied with an independent
`tf.gradients` of the merged `spec.loss`, fetched in the same run; and
check that unfused batch norm normalises with each tower's own shard
statistics while its moving variance is one device's.
"""

import inspect

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import conftest
from tests import harness
from tests import test_state

# The independent tf.gradients of spec.loss is taken after the model_fn;
# under MIRRORED each tower then reads its own copy, which that gradient of
# the original does not see (docs/behaviour.md).
pytestmark = pytest.mark.skipif(
    conftest.forced_placement() == "mirrored",
    reason="tf.gradients taken after the model_fn see tower 0's reads only "
    "under MIRRORED")

LEARNING_RATE = 0.5  # test_state's TowerOptimizer: gradient descent, 0.5
EPSILON = 1e-3  # Keras and v1 batch norm's default
# (towers, batch, static): 10 rows on 4 towers is uneven.
_SHAPES = (dict(num_towers=2, batch=8,
                static=True), dict(num_towers=4, batch=10, static=False))


def _turns(cases):
  """(default, wide): each case (a dict of parameters) with each of
  _SHAPES; the default run takes a case with one shape, in staggered turns
  from the uneven one."""
  return harness.in_turns(
      cases, _SHAPES, lambda i, j: j ==
      (1 + i + i // len(_SHAPES)) % len(_SHAPES))


def _replicated(model_fn, num_towers):
  """Replicated with each tower's own batch-norm statistics, where optional."""
  kwargs = {}
  if "sync_batch_norm" in inspect.signature(
      replicate.replicate_model_fn).parameters:
    kwargs["sync_batch_norm"] = False
  return replicate.replicate_model_fn(
      model_fn,
      devices=harness.devices(harness.VIRTUAL_CPUS, num_towers),
      **kwargs)


def _one_step(model_fn, params, num_towers, batch, static):
  """One training step on the first batch.

  Returns the loss, the gradient applied ((before - after) / rate), the
  gradient of the loss by `tf.gradients`, the weights before and every
  variable after.
  """
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(test_state.DATA, batch, static)
    spec = _replicated(model_fn,
                       num_towers)(features, labels,
                                   tf.estimator.ModeKeys.TRAIN, params)
    variables = tf.compat.v1.trainable_variables()
    gradients = tf.gradients(spec.loss, variables)
    names = [v.op.name for v in variables]
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run([
          tf.compat.v1.global_variables_initializer(),
          tf.compat.v1.local_variables_initializer()
      ])
      harness.set_trainable_weights(session)
      before = session.run(variables)
      loss, true, _ = session.run([spec.loss, gradients, spec.train_op])
      after = {
          v.op.name: session.run(v) for v in tf.compat.v1.global_variables()
      }
  applied = {n: (b - after[n]) / LEARNING_RATE for n, b in zip(names, before)}
  return loss, applied, dict(zip(names, true)), dict(zip(names, before)), after


def _dense_batch_norm_model_fn(features, labels, mode, params):
  """Unfused batch norm on 2-D inputs, after a dense layer or on the input.

  After a dense layer the batch variance depends on trainable weights, so
  its gradient shows whether the forward pass was rewired.
  """
  x = features["x"]
  if params["hidden"]:
    x = tf.compat.v1.layers.dense(x, 5, name="hidden")
  if params["layers"] == "v1":
    x = tf.compat.v1.layers.batch_normalization(
        x, momentum=test_state.MOMENTUM, training=True, fused=False, name="bn")
    update_ops = tf.compat.v1.get_collection(test_state.UPDATE_OPS)
  else:
    layer = tf.keras.layers.BatchNormalization(
        momentum=test_state.MOMENTUM, fused=False, name="bn")
    x = layer(x, training=True)
    update_ops = layer.updates
  loss = test_state._loss(labels, test_state._linear(x))  # pylint: disable=protected-access
  with tf.control_dependencies(update_ops):
    train_op = test_state._minimize(loss)  # pylint: disable=protected-access
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _batch_norm_inputs(weights, rows, hidden):
  rows = rows.astype(np.float64)
  if hidden:
    return rows @ weights["hidden/kernel"] + weights["hidden/bias"]
  return rows


def _shard_statistics_loss(weights, rows, labels, num_towers, hidden):
  """The loss each tower's shard gives with its own statistics, weighted."""
  sizes = test_state._shard_sizes(len(rows), num_towers)  # pylint: disable=protected-access
  bounds = np.cumsum([0] + sizes)
  inputs = _batch_norm_inputs(weights, rows, hidden)
  total = 0.0
  for start, end in zip(bounds[:-1], bounds[1:]):
    x, y = inputs[start:end], labels[start:end]
    normalized = (
        (x - x.mean(0)) / np.sqrt(x.var(0) + EPSILON) * weights["bn/gamma"] +
        weights["bn/beta"])
    logits = normalized @ weights["logits/kernel"] + weights["logits/bias"]
    logits -= logits.max(1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    total += (end -
              start) / len(rows) * -log_softmax[np.arange(len(y)), y].mean()
  return total


def _one_devices_moving_statistics(weights, rows, hidden):
  """After one step from (0, 1): one device's moving mean and variance."""
  x = _batch_norm_inputs(weights, rows, hidden)
  decay = 1.0 - test_state.MOMENTUM
  return {
      "bn/moving_mean": decay * x.mean(0),
      "bn/moving_variance": test_state.MOMENTUM + decay * x.var(0)
  }


# The model_fns whose graphs replicate rewires: batch norm (moving
# statistics, between-shard variance) and SUM/MEAN/NONE state writes.
_MODELS = dict((name, (model_fn, params)) for name, model_fn, params in (
    ("keras_unfused_after_dense", _dense_batch_norm_model_fn, {
        "layers": "keras",
        "hidden": True
    }),
    ("v1_2d_after_dense", _dense_batch_norm_model_fn, {
        "layers": "v1",
        "hidden": True
    }),
    (
        "keras_fused",
        test_state._batch_norm_model_fn,  # pylint: disable=protected-access
        {
            "layers": "keras",
            "fused": True
        }),
    (
        "v1_fused",
        test_state._batch_norm_model_fn,  # pylint: disable=protected-access
        {
            "layers": "v1",
            "fused": True
        }),
    ("counters_resource", test_state._counting_model_fn, {
        "resource": True
    }),  # pylint: disable=protected-access
    ("counters_ref", test_state._counting_model_fn, {
        "resource": False
    }),  # pylint: disable=protected-access
))

_MODEL_CASES = _turns([{"model": model} for model in _MODELS])


class AppliedGradientTest(parameterized.TestCase):

  @parameterized.parameters(*_MODEL_CASES[0])
  def test_applied_gradient_is_the_reported_losses_gradient(self, **case):
    self._check_applied_gradient(**case)

  @parameterized.parameters(*_MODEL_CASES[1])
  @pytest.mark.wide
  def test_applied_gradient_is_the_reported_losses_gradient_wide(self, **case):
    self._check_applied_gradient(**case)

  def _check_applied_gradient(self, num_towers, batch, static, model):
    model_fn, params = _MODELS[model]
    _, applied, true, _, _ = _one_step(model_fn, params, num_towers, batch,
                                       static)
    self.assertGreater(max(np.abs(g).max() for g in true.values()), 1e-3)
    for name, gradient in true.items():
      np.testing.assert_allclose(
          applied[name], gradient, rtol=1e-5, atol=1e-6, err_msg=name)


_UNFUSED_CASES = _turns([{
    "layers": layers,
    "hidden": hidden
} for layers in ("keras", "v1") for hidden in (True, False)])


class UnfusedBatchNormTest(parameterized.TestCase):
  """2-D batch norm (tf.nn.moments): the normalisation is not rewired."""

  @parameterized.parameters(*_UNFUSED_CASES[0])
  def test_towers_normalise_with_their_shards_statistics(self, **case):
    self._check_shard_statistics(**case)

  @parameterized.parameters(*_UNFUSED_CASES[1])
  @pytest.mark.wide
  def test_towers_normalise_with_their_shards_statistics_wide(self, **case):
    self._check_shard_statistics(**case)

  def _check_shard_statistics(self, num_towers, batch, static, layers, hidden):
    loss, _, _, before, after = _one_step(_dense_batch_norm_model_fn, {
        "layers": layers,
        "hidden": hidden
    }, num_towers, batch, static)
    rows, labels = test_state.X[:batch], test_state.Y[:batch]
    np.testing.assert_allclose(
        loss,
        _shard_statistics_loss(before, rows, labels, num_towers, hidden),
        rtol=1e-5,
        atol=1e-6)
    moving = _one_devices_moving_statistics(before, rows, hidden)
    for name, value in moving.items():
      np.testing.assert_allclose(
          after[name], value, rtol=1e-5, atol=1e-6, err_msg=name)

  def test_statistic_changed_before_the_models_reader_is_left_with_a_warning(
      self):

    def model_fn(features, labels, mode, params):
      del params
      x = features["x"]
      doubled = 2.0 * tf.nn.moments(x, [0])[1]  # read by the model too
      moving = tf.compat.v1.get_variable(
          "moving_doubled", [5],
          trainable=False,
          aggregation=test_state.MEAN,
          initializer=tf.compat.v1.ones_initializer())
      update = moving.assign(0.5 * moving + 0.5 * doubled)
      loss = test_state._loss(labels, test_state._linear(x / doubled))  # pylint: disable=protected-access
      with tf.control_dependencies([update]):
        train_op = test_state._minimize(loss)  # pylint: disable=protected-access
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    with self.assertLogs("absl", "WARNING") as logs:
      _, applied, true, _, after = _one_step(model_fn, {}, 2, 8, True)
    self.assertIn(
        "moving_doubled is not given the variance between the "
        "towers' shards", "\n".join(logs.output))
    for name, gradient in true.items():
      np.testing.assert_allclose(
          applied[name], gradient, rtol=1e-5, atol=1e-6, err_msg=name)
    shards = np.split(test_state.X[:8], 2)
    np.testing.assert_allclose(
        after["moving_doubled"],
        0.5 + 0.5 * np.mean([2.0 * s.var(0) for s in shards], 0),
        rtol=1e-5)
