"""Ops that mix the batch's rows give one device's value on the towers.

The loss and metric forms real code writes over a batch's per-example
errors (position discounts, per-group means, hard-example mining, trimmed
and quantile losses, listwise softmaxes, cumulative sums, per-row map_fn,
pairwise and Gram products, row-picking selects, a padded sequence loss
with a run-time pad), and Keras' minimize(loss_fn), whose tape leaves out
what was built before it: float64, 2, 3 and 4 towers, uneven and one-row
shards, every step's loss and every variable (TRAIN) or every metric
(EVAL) equal to one device's. A fold or scan carrying a value from row to
row runs on the whole batch's rows, in one device's order.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests import harness

D = tf.float64
CASES = [(2, 9), (3, 7), (4, 5), (3, 2)]


def _data():
  rng = np.random.RandomState(0)
  # Sorted in every batch, as segment ops need them: 3 rows a group.
  groups = np.arange(45) // 3 % 4 + np.arange(45) // 12 * 4
  return ({
      "x": rng.randn(45, 5),
      "group": groups.astype(np.int64)
  }, rng.randint(0, 3, 45).astype(np.int64))


def _rows(e):
  return tf.shape(e)[0]


FORMS = {
    "position_discounts":
        lambda e, logits, f: tf.reduce_sum(e / tf.math.log(2.0 + tf.cast(
            tf.range(_rows(e)), D))) / tf.reduce_sum(1.0 / tf.math.log(
                2.0 + tf.cast(tf.range(_rows(e)), D))),
    "segment_sum_mean":
        lambda e, logits, f: tf.reduce_mean(tf.math.segment_sum(e, f["group"])),
    "segment_mean_mean":
        lambda e, logits, f: tf.reduce_mean(
            tf.math.segment_mean(e, f["group"])),
    "hard_example_top_k":
        lambda e, logits, f: tf.reduce_mean(
            tf.math.top_k(
                e, tf.cast(tf.math.ceil(tf.cast(_rows(e), D) / 2), tf.int32)).
            values),
    "top_k_gather":
        lambda e, logits, f: tf.reduce_mean(
            tf.gather(logits,
                      tf.math.top_k(e, 1).indices)) + tf.reduce_mean(e),
    "argsort_rank_weights":
        lambda e, logits, f: tf.reduce_sum(
            tf.gather(e, tf.argsort(e)) * tf.cast(tf.range(_rows(e)), D)) / tf.
        cast(tf.size(e), D) + tf.reduce_mean(
            tf.gather(logits, tf.argsort(e, direction="DESCENDING"))[:, 0] * e),
    "trimmed_sort":
        lambda e, logits, f: tf.reduce_sum(tf.sort(e)[:-1]) + tf.reduce_max(e),
    "sort_difference":
        lambda e, logits, f: tf.reduce_mean(tf.abs(e - tf.sort(e))),
    "cumsum":
        lambda e, logits, f: tf.reduce_mean(tf.math.cumsum(e, axis=0)),
    "listwise_softmax":
        lambda e, logits, f: -tf.reduce_mean(
            tf.nn.log_softmax(logits, axis=0)[:, 0]),
    "softmax_weights":
        lambda e, logits, f: tf.reduce_sum(tf.nn.softmax(-e, axis=0) * e),
    "map_fn_per_row":
        lambda e, logits, f: tf.reduce_mean(
            tf.map_fn(lambda row: tf.reduce_sum(row * row), logits)),
    "tensordot":
        lambda e, logits, f: tf.tensordot(e, e, 1) / tf.cast(tf.size(e), D),
    "gram_in_batch_negatives":
        lambda e, logits, f: tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.range(_rows(e)),
                logits=tf.matmul(logits, logits, transpose_b=True))),
    "pairwise_hinge":
        lambda e, logits, f: tf.reduce_mean(
            tf.nn.relu(e[:, None] - e[None, :])),
    "argmax_pick":
        lambda e, logits, f: tf.reduce_mean(e) + 0.1 * tf.gather(
            e, tf.argmax(e)),
    "v1_select_rows":
        lambda e, logits, f: tf.reduce_mean(
            tf.compat.v1.where(e > tf.reduce_mean(e), logits,
                               tf.zeros_like(logits))),
    "reverse_and_roll":
        lambda e, logits, f: tf.reduce_mean(
            tf.reverse(e, [0]) * e + tf.roll(e, 1, 0)),
    "foldl_sum":
        lambda e, logits, f: tf.foldl(lambda total, row: total + row, e) / tf.
        cast(tf.size(e), D),
    "scan_running_max":
        lambda e, logits, f: tf.reduce_mean(
            tf.scan(lambda top, row: tf.maximum(top, row), e) * e),
    "gather_nd_by_position":
        lambda e, logits, f: -tf.reduce_mean(
            tf.gather_nd(
                tf.nn.log_softmax(logits),
                tf.stack(
                    [tf.range(_rows(e)),
                     tf.zeros_like(tf.range(_rows(e)))], 1))),
}


def _model_fn(form):

  def model_fn(features, labels, mode, params):
    del params
    kernel = tf.compat.v1.get_variable("kernel", [5, 3], D)
    logits = tf.matmul(features["x"], kernel)
    errors = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    loss = FORMS[form](errors, logits, features)
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


def _assert_same(run, model_fn, towers, batch):
  expected = run(model_fn, _data(), batch, 3, static=False)
  actual = run(
      model_fn,
      _data(),
      batch,
      3,
      tower_devices=harness.devices(harness.VIRTUAL_CPUS, towers),
      static=False)
  harness.assert_close_nests(actual, expected, rtol=1e-10, atol=1e-12)


# Each form on two of the cases, the cases taking turns; the second in the
# wide run.
_FORM_CASES = [(form, *CASES[index % len(CASES)])
               for index, form in enumerate(sorted(FORMS))] + [
                   harness.wide(form, *CASES[(index + 1) % len(CASES)])
                   for index, form in enumerate(sorted(FORMS))
               ]


@pytest.mark.parametrize("form,towers,batch", _FORM_CASES)
def test_form_trains_as_one_device(form, towers, batch):
  _assert_same(harness.train, _model_fn(form), towers, batch)


@pytest.mark.parametrize("towers,batch", CASES[:2])
@pytest.mark.parametrize(
    "form",
    ["segment_sum_mean", "hard_example_top_k", "tensordot", "map_fn_per_row"])
def test_form_in_a_metric_evaluates_as_one_device(form, towers, batch):
  _assert_same(harness.evaluate, _model_fn(form), towers, batch)


def _padded_sequence_model_fn(features, labels, mode, params):
  """The official Transformer's padded cross entropy: logits padded to the
  labels' length at run time, label smoothing, weights of non-padding."""
  del params
  kernel = tf.compat.v1.get_variable("kernel", [5, 4 * 3], D)
  logits = tf.reshape(tf.matmul(features["x"], kernel), [-1, 4, 3])
  targets = tf.stack([labels, (labels + 1) % 3, labels, labels], 1)
  targets = targets[:, :tf.reduce_max(labels) % 2 + 3]
  length = tf.maximum(tf.shape(logits)[1], tf.shape(targets)[1])
  logits = tf.pad(logits, [[0, 0], [0, length - tf.shape(logits)[1]], [0, 0]])
  targets = tf.pad(targets, [[0, 0], [0, length - tf.shape(targets)[1]]])
  smoothed = tf.one_hot(targets, 3, on_value=0.9, off_value=0.05, dtype=D)
  xentropy = tf.nn.softmax_cross_entropy_with_logits(
      labels=smoothed, logits=logits)
  weights = tf.cast(tf.not_equal(targets, 0), D)
  loss = tf.reduce_sum(xentropy * weights) / tf.reduce_sum(weights)
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.2)
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


@pytest.mark.parametrize("towers,batch", CASES[1:3])
def test_padded_sequence_loss_trains_as_one_device(towers, batch):
  _assert_same(harness.train, _padded_sequence_model_fn, towers, batch)


def _keras_loss_fn_model_fn(features, labels, mode, params):
  """Keras' minimize(loss_fn): a term built before the tape is constant."""
  del labels, params
  x = features["x"][:, :2]
  kernel = tf.compat.v1.get_variable(
      "kernel", [2, 1], D, initializer=tf.constant_initializer([[0.5], [-1.0]]))
  outside = tf.reduce_mean(tf.square(tf.matmul(x, kernel)))
  optimizer = tf.keras.optimizers.legacy.SGD(1.0)
  optimizer.iterations = tf.compat.v1.train.get_global_step()
  # The reported loss is read before the update (else it races with it).
  with tf.control_dependencies([outside]):
    train_op = optimizer.minimize(
        lambda: tf.reduce_mean(tf.matmul(x, kernel)) + outside, [kernel])
  return tf.estimator.EstimatorSpec(mode, loss=outside, train_op=train_op)


@pytest.mark.parametrize("towers,batch", CASES[::2])
def test_keras_minimize_of_a_loss_fn_leaves_out_what_the_tape_did_not_record(
    towers, batch):
  _assert_same(harness.train, _keras_loss_fn_model_fn, towers, batch)
