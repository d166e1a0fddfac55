"""Code with no proven row rule gives one device's value on the towers.

What real model_fns call and no rule reads op by op: counts and distinct
values of the batch's labels (class-balanced weights), sets of each row's
classes, v1 metrics at k, a memory bank of the last rows, Python ops, helpers
wrapped in a `tf.function`, custom gradients, tiles of rows, folds, scans
and while_loops over the rows, Keras metric subclasses, and a model_fn
called twice in one graph (adversarial regularization). Each runs once on
the whole batch where it mixes rows: float64, 2, 3 and 4 towers, uneven and
one-row shards, every step's loss and every variable (TRAIN) or every
metric (EVAL) equal to one device's. What cannot be one device's value is
refused naming the op and the fix: a custom gradient that mixes rows and
reads the tower's own rows, a Python op whose output says nothing of its
rows.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness
from tests import user_code

D = tf.float64
CASES = [(2, 9), (3, 7), (4, 5), (3, 2)]


def _data():
  rng = np.random.RandomState(0)
  return {"x": rng.randn(45, 5)}, rng.randint(0, 3, 45).astype(np.int64)


FORMS = {
    "unique_with_counts_weights":
        lambda e, logits, x, y: tf.reduce_sum(e * user_code.class_weights(y, D))
        / tf.reduce_sum(user_code.class_weights(y, D)),
    "distinct_classes":
        lambda e, logits, x, y: tf.reduce_mean(e) * user_code.distinct_count(
            y, D),
    "bincount_weights":
        lambda e, logits, x, y: tf.reduce_mean(e * user_code.bincount_weights(
            y, 3, D)),
    "numpy_function_weights":
        lambda e, logits, x, y: tf.reduce_sum(e * user_code.python_weights(x)),
    "py_function_weights":
        lambda e, logits, x, y: tf.reduce_mean(e * user_code.
                                               eager_python_weights(x)),
    "tf_function_mean":
        lambda e, logits, x, y: tf.reduce_mean(e) + user_code.mean_square(logits
                                                                         ),
    "tf_function_reshaped_rows":
        lambda e, logits, x, y: tf.reduce_mean(e) + 0.01 * user_code.
        column_pairs(logits),
    "custom_gradient_normalised":
        lambda e, logits, x, y: tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=user_code.normalised_gradient(logits))),
    "custom_gradient_per_row":
        lambda e, logits, x, y: tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=user_code.clipped_gradient(logits))),
    "tile_pairwise":
        lambda e, logits, x, y: tf.reduce_mean(e) + 0.01 * user_code.
        pairwise_by_tile(logits),
    "scan_ema":
        lambda e, logits, x, y: tf.reduce_mean(user_code.scan_ema(e) * e),
    "foldl_max":
        lambda e, logits, x, y: tf.reduce_mean(e) + 0.1 * user_code.foldl_max(e
                                                                             ),
    "sets_per_row":
        lambda e, logits, x, y: tf.reduce_mean(e * tf.cast(
            tf.sets.size(
                tf.sets.difference(
                    tf.math.top_k(logits, 2).indices,
                    tf.cast(y[:, None], tf.int32))), D)),
    "while_loop_tensor_array":
        lambda e, logits, x, y: tf.reduce_mean(
            user_code.rows_by_while_loop(e) * e),
}


def _model_fn(form):

  def model_fn(features, labels, mode, params):
    del params
    kernel = tf.compat.v1.get_variable("kernel", [5, 3], D)
    logits = tf.matmul(features["x"], kernel)
    errors = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    loss = FORMS[form](errors, logits, features["x"], labels)
    if mode == harness.EVAL:
      return tf.estimator.EstimatorSpec(
          mode,
          loss=tf.reduce_mean(errors),
          eval_metric_ops={"form": tf.compat.v1.metrics.mean(loss)})
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.2)
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))

  return model_fn


def _assert_same(run, model_fn, towers, batch, static=False):
  expected = run(model_fn, _data(), batch, 3, static=static)
  actual = run(
      model_fn,
      _data(),
      batch,
      3,
      tower_devices=harness.devices(harness.VIRTUAL_CPUS, towers),
      static=static)
  harness.assert_close_nests(actual, expected, rtol=1e-10, atol=1e-12)


_FORM_CASES = [(form, *CASES[index % len(CASES)])
               for index, form in enumerate(sorted(FORMS))] + [
                   harness.wide(form, *CASES[(index + 1) % len(CASES)])
                   for index, form in enumerate(sorted(FORMS))
               ]


@pytest.mark.parametrize("form,towers,batch", _FORM_CASES)
def test_form_trains_as_one_device(form, towers, batch):
  _assert_same(harness.train, _model_fn(form), towers, batch)


@pytest.mark.parametrize("form", [
    "unique_with_counts_weights", "scan_ema", "tf_function_reshaped_rows",
    harness.wide("numpy_function_weights")
])
def test_form_in_a_metric_evaluates_as_one_device(form):
  _assert_same(harness.evaluate, _model_fn(form), 3, 7)


def _keras_metrics_model_fn(features, labels, mode, params):
  del params
  kernel = tf.compat.v1.get_variable("kernel", [5, 3], D)
  logits = tf.matmul(features["x"], kernel)
  errors = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits)
  metrics = {}
  for metric in (user_code.MeanAbsolute(D), user_code.LargestBatchMean(D)):
    metric.update_state(errors)
    metrics[metric.name] = metric
  return tf.estimator.EstimatorSpec(
      mode, loss=tf.reduce_mean(errors), eval_metric_ops=metrics)


@pytest.mark.parametrize(
    "towers,batch",
    [CASES[1], harness.wide(*CASES[2]),
     harness.wide(*CASES[3])])
def test_keras_metric_subclasses_evaluate_as_one_device(towers, batch):
  _assert_same(harness.evaluate, _keras_metrics_model_fn, towers, batch)


@pytest.mark.parametrize("towers,batch", [(2, 1), harness.wide(4, 1)])
def test_keras_metric_subclasses_evaluate_as_one_device_beside_phantoms(
    towers, batch):
  # A static batch smaller than the towers: tower 0's rows are the only
  # rows, so its update_state reads the whole batch as it is built (its
  # write was refused as reading the tower's rows).
  _assert_same(
      harness.evaluate, _keras_metrics_model_fn, towers, batch, static=True)


def _state_model_fn(features, labels, mode, params):
  """State written from the whole batch by ops with no per-row rule: a
  memory bank of the last rows (MoCo's queue) and counts of the labels."""
  del params
  kernel = tf.compat.v1.get_variable("kernel", [5, 3], D)
  embeddings = tf.matmul(features["x"], kernel)
  bank = tf.compat.v1.get_variable(
      "bank", [4, 3], D, initializer=tf.zeros_initializer(), trainable=False)
  counts = tf.compat.v1.get_variable(
      "counts", [3], D, initializer=tf.zeros_initializer(), trainable=False)
  negatives = tf.matmul(embeddings, bank, transpose_b=True)
  loss = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=embeddings)) + 0.1 * tf.reduce_mean(
              tf.reduce_logsumexp(negatives, 1))
  with tf.control_dependencies([loss]):
    writes = [
        bank.assign(tf.concat([bank, tf.stop_gradient(embeddings)], 0)[-4:]),
        counts.assign_add(
            tf.math.bincount(tf.cast(labels, tf.int32), minlength=3, dtype=D))
    ]
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.2)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=tf.group(train_op, *writes))


@pytest.mark.parametrize(
    "towers,batch",
    [CASES[3], harness.wide(*CASES[0]),
     harness.wide(*CASES[2])])
def test_state_written_from_the_whole_batch_trains_as_one_device(towers, batch):
  _assert_same(harness.train, _state_model_fn, towers, batch)


def _metrics_at_k_model_fn(features, labels, mode, params):
  del params
  kernel = tf.compat.v1.get_variable("kernel", [5, 3], D)
  logits = tf.matmul(features["x"], kernel)
  top = tf.math.top_k(logits, 2).indices
  return tf.estimator.EstimatorSpec(
      mode,
      loss=tf.reduce_mean(
          tf.nn.sparse_softmax_cross_entropy_with_logits(
              labels=labels, logits=logits)),
      eval_metric_ops={
          "precision_at_2":
              tf.compat.v1.metrics.precision_at_k(labels, logits, 2),
          "recall_at_2":
              tf.compat.v1.metrics.recall_at_k(labels, logits, 2),
          "precision_at_top_2":
              tf.compat.v1.metrics.precision_at_top_k(labels, top),
      })


@pytest.mark.parametrize("towers,batch", [CASES[2], harness.wide(*CASES[0])])
def test_v1_metrics_at_k_evaluate_as_one_device(towers, batch):
  # Each names its variables by the name scope it opened (`tower_1/...`
  # in a tower) and takes sets of each row's labels and top classes.
  _assert_same(harness.evaluate, _metrics_at_k_model_fn, towers, batch)


def _adversarial_train(model_fn, towers, batch, steps=3):
  """As Neural Structured Learning's estimator wrapper: the (replicated)
  model_fn called twice in one graph, on the batch and on a perturbation
  of it made from the first call's gradient, one optimizer outside."""
  if towers:
    model_fn = replicate.replicate_model_fn(
        model_fn, devices=harness.devices(harness.VIRTUAL_CPUS, towers))
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(), batch, static=False)
    with tf.compat.v1.variable_scope(
        tf.compat.v1.get_variable_scope(),
        reuse=tf.compat.v1.AUTO_REUSE,
        auxiliary_name_scope=False):
      first = model_fn(features, labels, harness.TRAIN, {})
      gradient = tf.gradients(first.loss, features["x"])[0]
      perturbed = {"x": features["x"] + 0.05 * tf.sign(gradient)}
      second = model_fn(perturbed, labels, harness.TRAIN, {})
    loss = first.loss + 0.2 * second.loss
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf.compat.v1.train.get_global_step())
    spec = tf.estimator.EstimatorSpec(
        harness.TRAIN, loss=loss, train_op=train_op)
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      return harness.run_training(session, spec, steps)


@pytest.mark.parametrize("towers,batch", [CASES[0], harness.wide(*CASES[2])])
def test_a_model_fn_called_twice_trains_as_one_device(towers, batch):
  model_fn = _model_fn("unique_with_counts_weights")
  expected = _adversarial_train(model_fn, 0, batch)
  actual = _adversarial_train(model_fn, towers, batch)
  harness.assert_close_nests(actual, expected, rtol=1e-10, atol=1e-12)


def _refused_model_fn(loss_of):

  def model_fn(features, labels, mode, params):
    del params
    kernel = tf.compat.v1.get_variable("kernel", [5, 3], D)
    logits = tf.matmul(features["x"], kernel)
    loss = loss_of(logits, labels)
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        train_op=tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            loss, tf.compat.v1.train.get_global_step()))

  return model_fn


def _mixing_gradient_reading_rows(logits, labels):

  @tf.custom_gradient
  def scaled(t):
    return tf.identity(t), lambda dy: dy * t / tf.reduce_mean(tf.abs(t))

  return tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=scaled(logits)))


def test_a_custom_gradient_mixing_rows_and_reading_the_towers_is_refused():
  with pytest.raises(ValueError, match="custom gradient .* reads the tower's"):
    harness.train(
        _refused_model_fn(_mixing_gradient_reading_rows),
        _data(),
        6,
        1,
        tower_devices=harness.devices(harness.VIRTUAL_CPUS, 2))


def _unranked_python_weights(logits, labels):
  weights = tf.numpy_function(lambda a: np.abs(a[:, 0]) + 1.0, [logits], D)
  return tf.reduce_mean(weights) * tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits))


def _miscounted_python_rows(logits, labels):
  # A row per class, not per example, though the shape says rows.
  counts = tf.numpy_function(lambda a: np.abs(a).sum(0), [logits], D)
  counts.set_shape([None])
  return tf.reduce_sum(counts) * tf.reduce_mean(logits)


@pytest.mark.parametrize("loss_of,expected", [
    (_unranked_python_weights, "rank being unknown, but it holds a row per"),
    (_miscounted_python_rows, "hold a row per example on axis 0"),
])
def test_a_python_op_whose_shape_misleads_fails_naming_it(loss_of, expected):
  with pytest.raises(tf.errors.InvalidArgumentError, match=expected):
    harness.train(
        _refused_model_fn(loss_of),
        _data(),
        6,
        1,
        tower_devices=harness.devices(harness.VIRTUAL_CPUS, 2))
