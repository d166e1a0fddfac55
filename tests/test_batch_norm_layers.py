"""Batch-norm layers as users configure them: N towers against one device.

Keras' own synchronised layers (`SyncBatchNormalization`,
`BatchNormalization(synchronized=True)`), 5-D maps, sequences, several
feature axes, no scale or offset, channels-first v1 layers, a Sequential
model, and a layer called with `training=True` in every mode (evaluation
and prediction then normalise with the batch's statistics, which the
towers must take from the whole batch too). Each trains, evaluates and
predicts through `replicate.testing.assert_replicates` on 4 towers (10
rows: shards of 3, 3, 2 and 2) from one device's initial weights; fused
layers also with the towers' moments meeting on the hub, as GPUs do.

Tolerances: assert_replicates' rtol 1e-5 / atol 1e-6. Three steps of a
tiny model whose sums the towers add in another order: a few float32
roundings (2**-24 relative) each. Keras' synchronised layer computes the
variance as E[x^2] - E[x]^2 on one device, the towers as squared distances
from the mean: with the data's mean near 1 and spread near 3 the two agree
to about 1e-7 relative. A tower's own statistics are 1e-2 or more apart.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate._batch_norm import whole_batch
from tests import harness

TRAIN = tf.estimator.ModeKeys.TRAIN
PREDICT = tf.estimator.ModeKeys.PREDICT
ROWS = 10


def _called(layer, x, training):
  """`layer(x)`, its moving-statistics updates in UPDATE_OPS.

  A Keras layer called in a graph keeps its updates to itself
  (`layer.updates`); the train_op below runs UPDATE_OPS, as tf.compat.v1
  layers add theirs there.
  """
  y = layer(x, training=training)
  for update in layer.updates:
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
  return y


def _normalised(form, x, training):
  """The hidden layer's output through the form's batch normalization."""
  keras_bn = tf.keras.layers.BatchNormalization
  if form == "keras_sync_layer":
    return _called(
        tf.keras.layers.experimental.SyncBatchNormalization(name="bn"),
        tf.reshape(x, [-1, 16]), training)
  if form == "keras_synchronized":
    return _called(
        keras_bn(synchronized=True, name="bn"), tf.reshape(x, [-1, 16]),
        training)
  if form == "keras_5d":
    return _called(
        keras_bn(name="bn"), tf.reshape(x, [-1, 2, 2, 2, 2]), training)
  if form == "keras_sequence":
    return _called(keras_bn(name="bn"), tf.reshape(x, [-1, 4, 4]), training)
  if form == "keras_two_axes":
    return _called(
        keras_bn(axis=[2, 3], name="bn"), tf.reshape(x, [-1, 2, 2, 4]),
        training)
  if form == "keras_no_scale_or_offset":
    return _called(
        keras_bn(center=False, scale=False, name="bn"),
        tf.reshape(x, [-1, 2, 2, 4]), training)
  if form == "keras_always_training":
    return _called(keras_bn(name="bn"), tf.reshape(x, [-1, 2, 2, 4]), True)
  if form == "v1_channels_first":
    return tf.compat.v1.layers.batch_normalization(
        tf.reshape(x, [-1, 4, 2, 2]), axis=1, training=training, name="bn")
  assert form == "keras_sequential", form
  return _called(
      tf.keras.Sequential([
          tf.keras.layers.Reshape([2, 2, 4]),
          keras_bn(name="bn"),
          tf.keras.layers.ReLU()
      ],
                          name="head"), x, training)


FORMS = [
    "keras_sync_layer", "keras_synchronized", "keras_5d", "keras_sequence",
    "keras_two_axes", "keras_no_scale_or_offset", "keras_always_training",
    "v1_channels_first", "keras_sequential"
]
# Fused-kernel forms (4-D and 5-D maps) also checked with the towers'
# moments meeting on the hub.
FUSED = {"keras_5d", "keras_no_scale_or_offset", "v1_channels_first"}


def _model_fn(features, labels, mode, params):
  hidden = tf.compat.v1.layers.dense(features["x"], 16, name="hidden")
  x = _normalised(params["form"], hidden, mode == TRAIN)
  logits = tf.compat.v1.layers.dense(
      tf.compat.v1.layers.flatten(x), 3, name="logits")
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  predicted = tf.argmax(logits, 1)
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=train_op,
      eval_metric_ops={
          "accuracy": tf.compat.v1.metrics.accuracy(labels, predicted),
          "mean_logit": tf.compat.v1.metrics.mean(logits)
      })


def _input_fn():
  rng = np.random.RandomState(7)
  x = (3.0 * rng.randn(3 * ROWS, 5) + 1.0).astype(np.float32)
  y = rng.randint(0, 3, 3 * ROWS).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(ROWS)


def _moving_statistics_moved(model_dir):
  """Whether one device's training updated every channel's moving statistics.

  They start at exactly 0 and 1 and stay there only if never updated. How
  far they move depends on the random initial weights (the moving means
  of keras_5d ended between 1.3e-3 and 1.0e-2 in six runs), so the test is
  whether they moved at all.
  """
  names = {
      n.rsplit("/", 1)[-1]: n
      for n, _ in tf.train.list_variables(model_dir)
      if n.endswith(("bn/moving_mean", "bn/moving_variance"))
  }
  assert len(names) == 2, tf.train.list_variables(model_dir)
  mean = tf.train.load_variable(model_dir, names["moving_mean"])
  variance = tf.train.load_variable(model_dir, names["moving_variance"])
  return bool(np.all(mean != 0.0) and np.all(variance != 1.0))


# The default run's cases; the others are `wide`. keras_sync_layer is
# keras_synchronized's layer under another name, keras_sequence reduces as
# keras_two_axes does, test_whole_batch has channels first and a fused
# layer's ReLU (the Sequential model's); fused layers meet each way once.
DEFAULT = {("keras_synchronized", True), ("keras_two_axes", True),
           ("keras_always_training", True), ("keras_5d", True),
           ("keras_no_scale_or_offset", False)}


@pytest.mark.parametrize("form,concatenate",
                         [(pytest.param if (f, c) in DEFAULT else harness.wide)(
                             f, c, id=f if c else f + "-through_the_hub")
                          for c in (True, False)
                          for f in FORMS
                          if c or f in FUSED])
def test_batch_norm_layer_is_one_devices(form, concatenate, tmp_path,
                                         monkeypatch):
  # Without concatenation, towers on CPUs meet with their shards' moments
  # on the hub, as towers on GPUs do.
  monkeypatch.setattr(whole_batch, "_CONCATENATE_ON_HOST", concatenate)
  summary = replicate.testing.assert_replicates(
      _model_fn,
      _input_fn,
      towers=(4,),
      steps=3,
      params={"form": form},
      model_dir=str(tmp_path))
  assert summary.towers == [4]
  assert set(summary.metrics) >= {"accuracy", "mean_logit", "loss"}
  assert summary.predictions == 3 * ROWS  # every row
  assert _moving_statistics_moved(str(tmp_path / "one_device"))
