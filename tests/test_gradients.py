"""The gradient pipeline: clipping, sparse rows, gradient transforms, loss
scaling.

Each case trains a few steps on one device and on 2 and 4 towers from the
same weights and data, and compares every variable (weights, optimizer
slots, loss scales) after every step. A clip is only tested where it binds:
the clipped one-device run must differ from the unclipped one.

The models look up an embedding (sparse gradients). With
`embedding_lookup_sparse` (what embedding columns use) one device's gradient
has each row once, while the towers' concatenated slices repeat every row
that several towers looked up, which Keras' `clipnorm`/`clipvalue` and any
norm would count twice if the sum did not merge them. With
`embedding_lookup` rows repeat on one device too; a gradient transform gets
them merged on one device as on N towers.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

LSO = tf.keras.mixed_precision.LossScaleOptimizer
V1LSO = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer
KerasAdagrad = tf.keras.optimizers.legacy.Adagrad
NUM_IDS = 10
BATCH = 8
OVERFLOW = 1e36  # finite, but times a loss scale of 2**15 it is not


def _data(num_batches=3, overflow_batch=None):
  """Ids (2 per example, 0..9, repeating across towers), x and labels.

  In `overflow_batch` the first two examples (tower 0's shard with 2 or 4
  towers) get a huge feature and labels 0 and 1: the logits saturate, at
  least one label is not the largest logit's, and its gradient, finite,
  overflows once the loss is scaled.
  """
  rng = np.random.RandomState(0)
  n = num_batches * BATCH
  ids = rng.randint(0, NUM_IDS, size=(n, 2)).astype(np.int64)
  x = rng.randn(n, 2).astype(np.float32)
  y = rng.randint(0, 3, size=n).astype(np.int64)
  if overflow_batch is not None:
    first = overflow_batch * BATCH
    x[first:first + 2, 0] = OVERFLOW
    y[first:first + 2] = [0, 1]
  return {"ids": ids, "x": x}, y


def _train(model_fn, data, devices=None, **kwargs):
  """Trains one step per batch; returns the losses and, per step, the
  variables."""
  steps = len(data[1]) // BATCH
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(data, BATCH)
    spec = harness.wrap(model_fn, devices)(features, labels, harness.TRAIN,
                                           **kwargs)
    variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      harness.set_trainable_weights(session)
      losses, values = [], []
      for _ in range(steps):
        losses.append(session.run([spec.loss, spec.train_op])[0])
        values.append(session.run(variables))
  return np.array(losses), values


def _towers(num_towers):
  return harness.devices(harness.VIRTUAL_CPUS, num_towers)


def _assert_same_steps(actual, expected, rtol=1e-5, atol=1e-6):
  for step, (a, e) in enumerate(zip(actual, expected)):
    assert sorted(a) == sorted(e)
    for name in e:
      np.testing.assert_allclose(
          a[name],
          e[name],
          rtol=rtol,
          atol=atol,
          err_msg=f"{name} after step {step + 1}")


def _max_change(before, after):
  return max(
      np.abs(after[n] - before[n]).max()
      for n in before
      if np.asarray(before[n]).dtype.kind == "f")


def _look_up(embeddings, ids, unique_rows):
  """Each example's embeddings, summed; `unique_rows`: as embedding columns."""
  if not unique_rows:
    return tf.reduce_sum(tf.nn.embedding_lookup(embeddings, ids), axis=1)
  sparse_ids = tf.SparseTensor(
      tf.where(tf.ones_like(ids, dtype=tf.bool)), tf.reshape(ids, [-1]),
      tf.shape(ids, out_type=tf.int64))
  return tf.nn.embedding_lookup_sparse(
      embeddings, sparse_ids, None, combiner="sum")


# A custom model_fn: an embedding lookup and a dense layer; a Keras
# optimizer applies through get_updates, as the v2 canned heads do.
def _custom_model_fn(make_optimizer, keras=False, unique_rows=False):

  def model_fn(features, labels, mode, params):
    del params
    embeddings = tf.compat.v1.get_variable("embeddings", [NUM_IDS, 3])
    looked_up = _look_up(embeddings, features["ids"], unique_rows)
    logits = tf.compat.v1.layers.dense(
        tf.concat([looked_up, features["x"]], axis=1), 3, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = make_optimizer()
    if keras:
      train_op = optimizer.get_updates(loss,
                                       tf.compat.v1.trainable_variables())[0]
    else:
      train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


# A v2 canned estimator with an embedding column (deduplicated per shard by
# embedding_lookup_sparse) and a numeric one.
COLUMNS = [
    tf.feature_column.embedding_column(
        tf.feature_column.categorical_column_with_identity("ids", NUM_IDS), 3),
    tf.feature_column.numeric_column("x", shape=(2,)),
]


def _canned_train(optimizer_fn, data, num_towers=None):
  canned = tf.estimator.DNNClassifier(
      hidden_units=[4],
      feature_columns=COLUMNS,
      n_classes=3,
      optimizer=optimizer_fn(),
      config=tf.estimator.RunConfig())
  devices = None if num_towers is None else _towers(num_towers)
  return _train(canned.model_fn, data, devices, config=canned.config)


# Keras' own clipping, and a gradient_transform, with a Keras optimizer.
KERAS_CLIPS = {
    "none":
        lambda: replicate.TowerOptimizer(KerasAdagrad(0.1)),
    "clipnorm":
        lambda: replicate.TowerOptimizer(KerasAdagrad(0.1, clipnorm=0.02)),
    "clipvalue":
        lambda: replicate.TowerOptimizer(KerasAdagrad(0.1, clipvalue=0.002)),
    "global_clipnorm":
        lambda: replicate.TowerOptimizer(
            KerasAdagrad(0.1, global_clipnorm=0.02)),
    "gradient_transform":
        lambda: replicate.TowerOptimizer(
            KerasAdagrad(0.1),
            gradient_transform=replicate.TowerOptimizer.clip_by_global_norm(0.02
                                                                           )),
}
EMBEDDING_ACCUMULATOR = {
    False:
        "Adagrad/embeddings/accumulator",
    True: ("training/Adagrad/dnn/input_from_feature_columns/input_layer/"
           "ids_embedding/embedding_weights/accumulator"),
}


@functools.lru_cache(maxsize=None)
def _keras_clip_run(clip, canned, num_towers):
  if canned:
    return _canned_train(KERAS_CLIPS[clip], _data(), num_towers)
  devices = None if num_towers is None else _towers(num_towers)
  model_fn = _custom_model_fn(KERAS_CLIPS[clip], keras=True, unique_rows=True)
  return _train(model_fn, _data(), devices, params={})


# The default run: each clip once, clipnorm in the canned estimator.
@pytest.mark.parametrize("clip,canned,num_towers", [
    ("clipnorm", True, 2),
    harness.wide("gradient_transform", True, 2),
    harness.wide("clipnorm", False, 4),
    harness.wide("clipvalue", False, 2),
    ("clipvalue", False, 4),
    ("global_clipnorm", False, 4),
    ("gradient_transform", False, 4),
])
def test_keras_clipping_equals_one_device(clip, canned, num_towers):
  losses, values = _keras_clip_run(clip, canned, num_towers)
  expected_losses, expected = _keras_clip_run(clip, canned, None)
  _, unclipped = _keras_clip_run("none", canned, None)
  # The clip binds: the embedding's accumulator grows far less.
  name = EMBEDDING_ACCUMULATOR[canned]
  growth = expected[-1][name] - 0.1
  assert growth.max() < 0.5 * (unclipped[-1][name] - 0.1).max()
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  _assert_same_steps(values, expected, atol=1e-9)


# gradient_transform in a custom model_fn with v1 optimizers.
V1_OPTIMIZERS = {
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.3),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.05),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
}


def _halve_embedding_gradients(grads_and_vars):
  """A per-variable transform on a sparse gradient (README's example)."""
  return [(tf.IndexedSlices(g.values * 0.5, g.indices, g.dense_shape)
           if v.op.name == "embeddings" else g, v) for g, v in grads_and_vars]


TRANSFORMS = {
    "none":
        None,
    "global_norm":
        replicate.TowerOptimizer.clip_by_global_norm(0.05),
    "list": [
        _halve_embedding_gradients,
        replicate.TowerOptimizer.clip_by_global_norm(0.05)
    ],
}


@functools.lru_cache(maxsize=None)
def _custom_run(optimizer, transform, num_towers):
  make = lambda: replicate.TowerOptimizer(
      V1_OPTIMIZERS[optimizer](), gradient_transform=TRANSFORMS[transform])
  devices = None if num_towers is None else _towers(num_towers)
  return _train(_custom_model_fn(make), _data(), devices, params={})


@pytest.mark.parametrize("optimizer,transform,num_towers", [
    harness.wide("adagrad", "global_norm", 2),
    ("adagrad", "global_norm", 4),
    ("adam", "list", 4),
    ("momentum", "list", 2),
])
def test_gradient_transform_equals_one_device(optimizer, transform, num_towers):
  losses, values = _custom_run(optimizer, transform, num_towers)
  expected_losses, expected = _custom_run(optimizer, transform, None)
  _, unclipped = _custom_run(optimizer, "none", None)
  assert _max_change(unclipped[-1], expected[-1]) > 0.01  # the clip binds
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  _assert_same_steps(values, expected)


@pytest.mark.parametrize("optimizer", sorted(V1_OPTIMIZERS))
def test_sparse_sums_without_transform_equal_one_device(optimizer):
  _, expected = _custom_run(optimizer, "none", None)
  _, values = _custom_run(optimizer, "none", 4)
  _assert_same_steps(values, expected)


def _clip_in_model_fn():
  """What the issue saw: clipping before apply_gradients, in each tower."""
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1))

  class Clipping:

    def minimize(self, loss, global_step):
      grads, variables = zip(*optimizer.compute_gradients(loss))
      clipped, _ = tf.clip_by_global_norm(grads, 0.05)
      return optimizer.apply_gradients(zip(clipped, variables), global_step)

  return Clipping()


@pytest.mark.parametrize("num_towers", [harness.wide(2), 4])
def test_clipping_in_the_model_fn_equals_one_device(num_towers):
  """compute_gradients hands every tower the whole batch's gradients."""
  model_fn = _custom_model_fn(_clip_in_model_fn)
  expected_losses, expected = _train(model_fn, _data(1), params={})
  losses, actual = _train(model_fn, _data(1), _towers(num_towers), params={})
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  _assert_same_steps(actual, expected)


def _log_norm(grads_and_vars):
  """A transform that writes the gradients' global norm as a summary."""
  tf.compat.v1.summary.scalar(
      "gradient_norm", tf.linalg.global_norm([g for g, _ in grads_and_vars]))
  return grads_and_vars


def _summarised_norms(num_towers):
  """The SUMMARIES collection's names, and the logged norm of step 1."""
  make = lambda: replicate.TowerOptimizer(
      tf.compat.v1.train.AdagradOptimizer(0.1), gradient_transform=_log_norm)
  devices = None if num_towers is None else _towers(num_towers)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(1), BATCH)
    spec = harness.wrap(_custom_model_fn(make), devices)(
        features, labels, harness.TRAIN, params={})
    summaries = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      harness.set_trainable_weights(session)
      serialized, _ = session.run([summaries, spec.train_op])
  norms = [
      tf.compat.v1.Summary.FromString(s).value[0].simple_value
      for s in serialized
  ]
  return [s.op.name for s in summaries], norms


def test_summary_of_a_gradient_transform_is_kept_once():
  names, norms = _summarised_norms(4)
  expected_names, expected_norms = _summarised_norms(None)
  assert names == expected_names == ["gradient_norm"]
  np.testing.assert_allclose(norms, expected_norms, rtol=1e-5)


def test_gradient_transform_must_be_functions():
  with pytest.raises(
      TypeError,
      match="got gradient_transform=3; pass a "
      "function from a list of"):
    replicate.TowerOptimizer(
        tf.compat.v1.train.AdagradOptimizer(0.1), gradient_transform=3)
  with pytest.raises(
      TypeError, match="got gradient_transform=.*; pass a "
      "function"):
    replicate.TowerOptimizer(KerasAdagrad(0.1), gradient_transform=[len, 3])


def test_clip_norm_must_be_positive():
  with pytest.raises(
      ValueError, match="got clip_norm=0; pass the largest "
      "global norm"):
    replicate.TowerOptimizer.clip_by_global_norm(0)
  with pytest.raises(
      TypeError, match="got clip_norm='5' of type str; pass the largest"):
    replicate.TowerOptimizer.clip_by_global_norm("5")


def test_gradient_transform_returning_none_is_an_error():
  make = lambda: replicate.TowerOptimizer(
      tf.compat.v1.train.AdagradOptimizer(0.1),
      gradient_transform=lambda grads_and_vars: None)
  with pytest.raises(
      ValueError, match="returned None; it must return the "
      "list of"):
    _train(_custom_model_fn(make), _data(1), _towers(2), params={})


# Loss scaling: a step where one tower overflows is skipped, as on one device.
LOSS_SCALING = {
    "v1_dynamic":
        lambda: V1LSO(tf.compat.v1.train.AdagradOptimizer(0.3), "dynamic"),
    "keras_dynamic":
        lambda: LSO(KerasAdagrad(0.3)),
    "keras_fixed":
        lambda: LSO(KerasAdagrad(0.3), dynamic=False, initial_scale=1024.0),
}
LOSS_SCALE_VARIABLE = {
    "v1_dynamic": "current_loss_scale",
    "keras_dynamic": "current_loss_scale"
}


@functools.lru_cache(maxsize=None)
def _loss_scaling_run(scaling, canned, num_towers):
  data = _data(overflow_batch=None if scaling == "keras_fixed" else 1)
  if canned:
    # A function, called in the estimator's graph, where a dynamic loss
    # scale creates its variables.
    return _canned_train(
        lambda: replicate.TowerOptimizer(LOSS_SCALING[scaling]), data,
        num_towers)
  make = lambda: replicate.TowerOptimizer(LOSS_SCALING[scaling]())
  devices = None if num_towers is None else _towers(num_towers)
  keras = scaling.startswith("keras")
  return _train(_custom_model_fn(make, keras), data, devices, params={})


@pytest.mark.parametrize("scaling,canned,num_towers", [
    harness.wide("v1_dynamic", False, 2),
    ("v1_dynamic", False, 4),
    ("keras_dynamic", False, 4),
    ("keras_dynamic", True, 2),
    ("keras_fixed", True, 2),
])
def test_loss_scaling_equals_one_device(scaling, canned, num_towers):
  losses, values = _loss_scaling_run(scaling, canned, num_towers)
  expected_losses, expected = _loss_scaling_run(scaling, canned, None)
  if scaling in LOSS_SCALE_VARIABLE:
    # Step 2 overflows in tower 0's shard only: skipped, loss scale halved.
    scale = LOSS_SCALE_VARIABLE[scaling]
    for run in (expected, values):
      assert run[1][scale] == run[0][scale] / 2 == 2.0**14
      assert _max_change({
          n: v for n, v in run[0].items() if n != scale
      }, {
          n: v for n, v in run[1].items() if n != scale
      }) == 0
      assert _max_change(run[1], run[2]) > 0.01
    losses, expected_losses = losses[[0, 2]], expected_losses[[0, 2]]
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  _assert_same_steps(values, expected)
