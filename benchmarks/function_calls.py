r"""Step time of function calls against the same code written inline.

A `tf.function` loss helper and a Keras `Metric` subclass are function
calls in the graph (`PartitionedCall`, `StatefulPartitionedCall`) that
replicate analyses as their body or runs on the whole batch. Each pair
below computes the same values both ways, replicated on N virtual CPUs
(and unwrapped, N = 1, for scale):

- `train`: an MLP whose loss is cross-entropy plus a batch-mixing term
  (the variance of the logits over the batch), inline vs in a
  `tf.function` helper; a training step.
- `eval`: a streaming accuracy, as v1 local variables updated inline vs a
  Keras `Metric` subclass (its `update_state` a `tf.function` Keras
  builds); an evaluation step (the update ops).

The two graphs of a pair live in one process and take turns window by
window; reported: median step ms of each and function / inline.

  .venv/bin/python benchmarks/function_calls.py --towers=1,2,4
"""

import statistics
import time
from typing import Callable, Dict, List, Tuple

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import replicate

FLAGS = flags.FLAGS
flags.DEFINE_list("towers", ["1", "2"], "Tower counts (1: unwrapped).")
flags.DEFINE_integer("batch_size", 512, "Global batch.")
flags.DEFINE_integer("width", 256, "Hidden units of the MLP.")
flags.DEFINE_integer("windows", 15, "Timed windows per graph, in turn.")
flags.DEFINE_integer("steps", 10, "Steps per window.")

_INPUTS, _CLASSES = 64, 10


def _logits(x: tf.Tensor) -> tf.Tensor:
  init = tf.compat.v1.glorot_uniform_initializer(seed=1)
  hidden = tf.compat.v1.layers.dense(
      x, FLAGS.width, tf.nn.relu, kernel_initializer=init, name="hidden")
  return tf.compat.v1.layers.dense(
      hidden, _CLASSES, kernel_initializer=init, name="logits")


def _loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
  entropy = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  _, variance = tf.nn.moments(logits, axes=[0])
  return entropy + 0.1 * tf.reduce_mean(variance)


_loss_helper = tf.function(_loss)


class _Accuracy(tf.keras.metrics.Metric):
  """A user's own streaming accuracy."""

  def __init__(self) -> None:
    super().__init__(name="accuracy")
    self.correct = self.add_weight("correct", initializer="zeros")
    self.count = self.add_weight("count", initializer="zeros")

  def update_state(self, labels: tf.Tensor, predictions: tf.Tensor) -> None:
    hits = tf.cast(tf.equal(labels, predictions), tf.float32)
    self.correct.assign_add(tf.reduce_sum(hits))
    self.count.assign_add(tf.cast(tf.size(hits), tf.float32))

  def result(self) -> tf.Tensor:
    return self.correct / self.count


def _inline_accuracy(labels: tf.Tensor,
                     predictions: tf.Tensor) -> Tuple[tf.Tensor, tf.Operation]:
  local = tf.compat.v1.GraphKeys.LOCAL_VARIABLES
  correct, count = (
      tf.compat.v1.get_variable(
          name, [], initializer=tf.zeros_initializer(), collections=[local])
      for name in ("correct", "count"))
  hits = tf.cast(tf.equal(labels, predictions), tf.float32)
  update = tf.group(
      correct.assign_add(tf.reduce_sum(hits)),
      count.assign_add(tf.cast(tf.size(hits), tf.float32)))
  return correct / count, update


def _model_fn(call: str) -> Callable[..., tf.estimator.EstimatorSpec]:
  """A model_fn computing its loss and metric `inline` or by `function`."""

  def model_fn(features, labels, mode):
    logits = _logits(features["x"])
    loss = (_loss_helper if call == "function" else _loss)(labels, logits)
    if mode == tf.estimator.ModeKeys.EVAL:
      predictions = tf.argmax(logits, 1, output_type=tf.int32)
      if call == "function":
        metric = _Accuracy()
        metric.update_state(labels, predictions)
      else:
        metric = _inline_accuracy(labels, predictions)
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, eval_metric_ops={"accuracy": metric})
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.01))
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _step(mode: str, call: str, towers: int) -> Tuple[tf.Graph, tf.Operation]:
  """The graph of one (mode, call, towers) and the op a step runs."""
  graph = tf.Graph()
  with graph.as_default():
    rng = np.random.RandomState(0)
    x = rng.randn(FLAGS.batch_size, _INPUTS).astype(np.float32)
    y = rng.randint(0, _CLASSES, FLAGS.batch_size).astype(np.int32)
    tf.compat.v1.train.create_global_step()  # As Estimator does.
    model_fn = _model_fn(call)
    if towers > 1:
      model_fn = replicate.replicate_model_fn(
          model_fn, devices=[f"/device:CPU:{i}" for i in range(towers)])
    spec = model_fn({"x": tf.constant(x)}, tf.constant(y), mode)
    if mode == tf.estimator.ModeKeys.EVAL:
      op = tf.group(*(update for _, update in spec.eval_metric_ops.values()))
    else:
      op = spec.train_op
  return graph, op


def _time_pair(mode: str, towers: int) -> Dict[str, float]:
  """Median step seconds of inline and function, windows in turn."""
  config = tf.compat.v1.ConfigProto(device_count={"CPU": max(towers, 1)})
  runs = {}
  for call in ("inline", "function"):
    graph, op = _step(mode, call, towers)
    session = tf.compat.v1.Session(graph=graph, config=config)
    with graph.as_default():
      session.run([
          tf.compat.v1.global_variables_initializer(),
          tf.compat.v1.local_variables_initializer()
      ])
    for _ in range(FLAGS.steps):  # Warm-up.
      session.run(op)
    runs[call] = (session, op)
  times: Dict[str, List[float]] = {call: [] for call in runs}
  for _ in range(FLAGS.windows):
    for call, (session, op) in runs.items():
      start = time.perf_counter()
      for _ in range(FLAGS.steps):
        session.run(op)
      times[call].append((time.perf_counter() - start) / FLAGS.steps)
  for session, _ in runs.values():
    session.close()
  return {call: statistics.median(t) for call, t in times.items()}


def main(argv: List[str]) -> None:
  del argv  # Unused.
  tf.compat.v1.disable_eager_execution()
  print(f"batch {FLAGS.batch_size}, {FLAGS.windows} windows of "
        f"{FLAGS.steps} steps; medians")
  print(f"{'mode':6s} {'N':>2s} {'inline ms':>10s} {'function ms':>12s} "
        f"{'function/inline':>16s}")
  for mode in (tf.estimator.ModeKeys.TRAIN, tf.estimator.ModeKeys.EVAL):
    for towers in map(int, FLAGS.towers):
      median = _time_pair(mode, towers)
      print(f"{mode:6s} {towers:2d} {median['inline'] * 1e3:10.2f} "
            f"{median['function'] * 1e3:12.2f} "
            f"{median['function'] / median['inline']:16.3f}")


if __name__ == "__main__":
  app.run(main)
