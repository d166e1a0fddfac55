"""Code real model_fns write that no per-row rule reads, in any float dtype.

Counts and distinct values of the batch's classes gathered back per row,
Python ops, helpers wrapped in a `tf.function`, custom gradients, tiles of
rows, scans, folds and while_loops over the rows, and a user's own Keras
metrics. tests/test_safe_default.py runs each as a fixed form,
tests/test_drawn_models.py draws them into its grammar.
"""

import numpy as np
import tensorflow as tf


def class_weights(ids, dtype):
  """Class-balanced weights: 1 / the count of each row's class."""
  _, index, counts = tf.unique_with_counts(ids)
  return 1.0 / tf.cast(tf.gather(counts, index), dtype)


def bincount_weights(ids, classes, dtype):
  """1 / (1 + the count of each row's class), counted by `bincount`."""
  counts = tf.math.bincount(
      tf.cast(ids, tf.int32), minlength=classes, dtype=dtype)
  return tf.gather(1.0 / (counts + 1.0), ids)


def distinct_count(ids, dtype):
  """How many classes the batch holds."""
  return tf.cast(tf.size(tf.unique(ids)[0]), dtype)


def python_weights(x):
  """Per-row weights computed in numpy from the whole batch."""
  weights = tf.numpy_function(
      lambda a: ((np.abs(a[:, 0]) + 1.0) /
                 (np.abs(a[:, 0]).sum() + 1.0)).astype(a.dtype), [x], x.dtype)
  weights.set_shape([None])
  return weights


def eager_python_weights(x):
  """Per-row weights computed eagerly (a softmax over the batch)."""
  weights = tf.py_function(
      lambda a: tf.nn.softmax(a[:, 0]) * tf.cast(tf.size(a[:, 0]), a.dtype),
      [x], x.dtype)
  weights.set_shape([None])
  return weights


def python_scale(x):
  """One value of the whole batch computed in numpy."""
  scale = tf.numpy_function(
      lambda a: np.asarray(1.0 + np.abs(a).mean(), a.dtype), [x], x.dtype)
  scale.set_shape([])
  return scale


@tf.function
def mean_square(t):
  return tf.reduce_mean(tf.square(t))


@tf.function
def pairwise_hinge(e):
  return tf.reduce_mean(tf.nn.relu(e[:, None] - e[None, :]))


@tf.function
def column_pairs(t):
  # Rows reshaped across their axis: no rule reads it.
  flat = tf.reshape(tf.transpose(t), [-1, 1])
  return tf.reduce_sum(flat * tf.reverse(flat, [0]))


@tf.custom_gradient
def normalised_gradient(t):
  """The identity, its gradient divided by the batch's mean |dy|."""

  def gradient(dy):
    return dy / (tf.reduce_mean(tf.abs(dy)) + 1e-3)

  return tf.identity(t), gradient


@tf.custom_gradient
def clipped_gradient(t):
  """The identity, its gradient clipped row by row."""
  return tf.identity(t), lambda dy: tf.clip_by_value(dy, -0.05, 0.05)


def pairwise_by_tile(t):
  """The mean squared distance of all pairs of rows, by tile."""
  count = tf.shape(t)[0]
  left = tf.tile(t[None], [count, 1, 1])
  return tf.reduce_mean(
      tf.reduce_sum(tf.square(left - tf.transpose(left, [1, 0, 2])), -1))


def scan_ema(e):
  """A running average over the rows, row by row."""
  return tf.scan(
      lambda average, row: 0.9 * average + 0.1 * row,
      e,
      initializer=tf.constant(0.0, e.dtype))


def foldl_max(e):
  return tf.foldl(tf.maximum, e, initializer=tf.constant(-1e9, e.dtype))


def rows_by_while_loop(e):
  """A running average over the rows, written row by row to a TensorArray."""
  count = tf.shape(e)[0]

  def body(i, running, written):
    running = 0.5 * running + e[i]
    return i + 1, running, written.write(i, running)

  _, _, written = tf.while_loop(
      lambda i, running, written: i < count, body,
      [0, tf.constant(0.0, e.dtype),
       tf.TensorArray(e.dtype, size=count)])
  return written.stack()


class MeanAbsolute(tf.keras.metrics.Metric):
  """A user's own Keras metric: Keras runs its update_state as a
  tf.function that writes the metric's variables."""

  def __init__(self, dtype):
    super().__init__(name="mean_absolute", dtype=dtype)
    self.total = self.add_weight("total", initializer="zeros", dtype=dtype)
    self.count = self.add_weight("count", initializer="zeros", dtype=dtype)

  def update_state(self, values):
    self.total.assign_add(tf.reduce_sum(tf.abs(values)))
    self.count.assign_add(tf.cast(tf.size(values), self.dtype))

  def result(self):
    return self.total / self.count


class LargestBatchMean(tf.keras.metrics.Metric):
  """The largest batch mean seen: written with assign, not added."""

  def __init__(self, dtype):
    super().__init__(name="largest_batch_mean", dtype=dtype)
    self.largest = self.add_weight(
        "largest",
        initializer=tf.keras.initializers.Constant(-1e9),
        dtype=dtype)

  def update_state(self, values):
    self.largest.assign(tf.maximum(self.largest, tf.reduce_mean(values)))

  def result(self):
    return tf.identity(self.largest)
