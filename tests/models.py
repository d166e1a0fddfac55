"""Small model_fns used across the tests, and data for them."""

import numpy as np
import tensorflow as tf

import replicate

NUM_CLASSES = 3
NUM_FEATURES = 5


def data(num_examples=48, seed=0):
  """Features {'x': [n, 5]} and labels [n] in 0..2 that a model can fit."""
  rng = np.random.RandomState(seed)
  x = rng.randn(num_examples, NUM_FEATURES).astype(np.float32)
  y = (np.argmax(x[:, :NUM_CLASSES], axis=1)).astype(np.int64)
  return {"x": x}, y


def _hidden(x, layers):
  if layers == "keras":
    h = tf.keras.layers.Dense(8, activation="relu")(x)
    return tf.keras.layers.Dense(NUM_CLASSES)(h)
  h = tf.compat.v1.layers.dense(x, 8, activation=tf.nn.relu, name="hidden")
  return tf.compat.v1.layers.dense(h, NUM_CLASSES, name="logits")


def _optimizer(params):
  name = params.get("optimizer", "adagrad")
  if name == "adam":
    return tf.compat.v1.train.AdamOptimizer(0.05)
  if name == "momentum":
    return tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.compat.v1.train.AdagradOptimizer(0.3)


def classifier_model_fn(features, labels, mode, params):
  """An MLP classifier with v1 metrics, Keras metrics and export outputs.

  params: 'reduction' (loss reduction), 'layers' ('v1' or 'keras'),
  'optimizer' ('adagrad', 'adam', 'momentum').
  """
  logits = _hidden(features["x"], params.get("layers", "v1"))
  probabilities = tf.nn.softmax(logits)
  classes = tf.argmax(logits, axis=1)
  predictions = {
      "probabilities": probabilities,
      "classes": classes,
      "logits": logits
  }
  if mode == tf.estimator.ModeKeys.PREDICT:
    score = tf.reduce_max(probabilities, axis=1)
    class_names = tf.tile(
        tf.constant([[b"a", b"b", b"c"]]), [tf.shape(logits)[0], 1])
    return tf.estimator.EstimatorSpec(
        mode,
        predictions=predictions,
        export_outputs={
            "serving_default":
                tf.estimator.export.PredictOutput(predictions),
            "classify":
                tf.estimator.export.ClassificationOutput(
                    scores=probabilities, classes=class_names),
            "regress":
                tf.estimator.export.RegressionOutput(value=score)
        })
  reduction = params.get("reduction",
                         tf.compat.v1.losses.Reduction.SUM_BY_NONZERO_WEIGHTS)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, logits, reduction=reduction)
  if mode == tf.estimator.ModeKeys.EVAL:
    keras_accuracy = tf.keras.metrics.Accuracy(name="keras_accuracy")
    keras_accuracy.update_state(labels, classes)
    keras_mean = tf.keras.metrics.Mean(name="keras_mean")
    keras_mean.update_state(probabilities[:, 0])
    metrics = {
        "accuracy":
            tf.compat.v1.metrics.accuracy(labels, classes),
        "mean_top_probability":
            tf.compat.v1.metrics.mean(tf.reduce_max(probabilities, axis=1)),
        "auc":
            tf.compat.v1.metrics.auc(
                tf.one_hot(labels, NUM_CLASSES), probabilities),
        "keras_accuracy":
            keras_accuracy,
        "keras_mean":
            keras_mean,
    }
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, eval_metric_ops=metrics, predictions=predictions)
  optimizer = replicate.TowerOptimizer(_optimizer(params))
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op, predictions=predictions)
