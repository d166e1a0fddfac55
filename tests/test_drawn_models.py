"""Model_fns drawn from a grammar give one device's results on N towers.

A drawn `Case` says how a model_fn is written: per-row layers (dense,
batch normalization, rows mixed with a whole-batch statistic), a loss that
is a random algebraic combination of batch reductions (means, masked and
weighted means, sums, maxima, ratios, scaled and weighted sums, nested
means), model-state writes, control dependencies, an optimizer and the
way it is called (inside a tf.cond too), Python state kept between the
model_fn's calls, metrics, and the batch size, tower count and shape
(uneven shards, empty towers, one row). Its choices include code no
per-row rule reads (tests/user_code.py): weights from the counts and
distinct values of the batch's classes, Python ops, `tf.function`
helpers, custom gradients, scans, folds and while_loops over the rows,
tiles of rows, sparse, ragged and string features (a vocabulary
lookup), state written from the whole batch (counts of the classes, a
memory bank of the last rows), and a user's own Keras metrics and
`precision_at_k` in evaluation. Each case runs
unreplicated and on the towers from the same seeded weights on the same
batches; losses, summaries, trained variables (slots, global step and
state included), metrics and predictions must agree.

The default run draws a sample (`_EXAMPLES`); `pytest -m drawn` draws
`_MANY` per test. A failure prints the falsifying `Case`, which is the
whole reproduction, and hypothesis' seed.
"""

import dataclasses
from typing import Tuple

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness
from tests import user_code

pytestmark = pytest.mark.drawn

TRAIN, EVAL, PREDICT = harness.TRAIN, harness.EVAL, harness.PREDICT
R = tf.compat.v1.losses.Reduction
FEATURES = 3
CLASSES = 3
STEPS = 2
BANK = 4  # rows a memory bank keeps
# Examples per test in the default run, and under `-m drawn`.
_EXAMPLES = {"train": 16, "eval": 8, "predict": 6}
_MANY = 1000


@dataclasses.dataclass(frozen=True)
class Case:
  """How one drawn model_fn is written, and the batches it is run on."""
  layers: Tuple[tuple, ...]
  loss: tuple
  task: str  # "classes" (softmax) or "values" (squared error)
  optimizer: str
  route: str  # how the optimizer is called
  state: Tuple[str, ...]  # model-state writes
  metrics: Tuple[str, ...]  # EVAL metrics beside the v1 ones
  control: bool  # the loss waits for the state writes
  python_state: str  # what the model_fn keeps between its calls
  regularize: bool
  batch: int
  towers: int
  static: bool


# The grammar.

_ACTIVATIONS = (None, "relu", "tanh")
_REDUCTIONS = (R.SUM, R.MEAN, R.SUM_BY_NONZERO_WEIGHTS, R.SUM_OVER_BATCH_SIZE,
               R.SUM_OVER_NONZERO_WEIGHTS)
_WEIGHTS = ("none", "mask", "weights")


def _layers():
  dense = st.tuples(
      st.just("dense"), st.integers(2, 4), st.sampled_from(_ACTIVATIONS),
      st.sampled_from(["v1", "keras"]))
  other = st.one_of(
      st.tuples(st.just("batch_norm"), st.sampled_from(["v1", "keras"])),
      st.just(("center",)),  # minus the whole batch's mean row
      st.just(("batch_max",)),  # divided by the whole batch's max
      st.just(("row_norm",)),  # a reduction within each row
      st.just(("first_row",)),  # minus the batch's first row
      st.just(("concat",)),
      # A gradient normalised over the whole batch, or clipped per row.
      st.tuples(
          st.just("custom_gradient"), st.sampled_from(["normalised",
                                                       "clipped"])),
      # Features of other forms, each row's values summed or looked up.
      st.just(("sparse_feature",)),
      st.just(("ragged_feature",)),
      st.just(("string_lookup",)))
  return st.lists(
      st.one_of(dense, dense, other), min_size=1, max_size=3).map(tuple)


def _leaf():
  return st.one_of(
      st.just(("mean",)),
      st.just(("masked_mean",)),
      st.just(("batch_sum_mean",)),
      st.tuples(
          st.just("v1_losses"), st.sampled_from(_REDUCTIONS),
          st.sampled_from(_WEIGHTS)),
      st.tuples(
          st.just("v1_direct"), st.sampled_from(_REDUCTIONS),
          st.sampled_from(_WEIGHTS)),
      st.just(("sum_over_size",)),
      st.just(("sum",)),
      st.just(("max",)),
      st.just(("logsumexp",)),
      st.just(("variance",)),
      # Forms that mix rows: run on the whole batch, or positions in it.
      st.just(("position_weights",)),
      st.just(("segment_mean",)),
      st.just(("top_k_mean",)),
      st.just(("sorted_trim",)),
      st.just(("cumsum_mean",)),
      st.just(("softmax_over_batch",)),
      st.just(("map_fn",)),
      st.just(("tensordot",)),
      st.just(("pairwise",)),
      st.just(("argsort_ranks",)),
      # Code no rule reads, as users write it.
      st.just(("class_balanced",)),  # 1 / count of the row's class
      st.just(("bincount_weights",)),
      st.just(("distinct_classes",)),
      st.just(("numpy_function_weights",)),
      st.just(("py_function_weights",)),
      st.just(("numpy_function_scale",)),  # one value of the whole batch
      st.just(("tf_function_mean",)),
      st.just(("tf_function_pairwise",)),
      st.just(("scan_ema",)),
      st.just(("foldl_max",)),
      st.just(("while_loop_rows",)),
      st.just(("tile_pairwise",)))


def _loss():
  coefficient = st.sampled_from([0.5, 1.0, 2.0])
  return st.recursive(
      _leaf(),
      lambda sub: st.one_of(
          st.tuples(st.just("scaled"), coefficient, sub),
          st.tuples(
              st.just("weighted_sum"), coefficient, sub, coefficient, sub),
          st.tuples(st.just("ratio"), sub, sub)),
      max_leaves=3)


@st.composite
def cases(draw):
  towers = draw(st.integers(2, 4))
  return Case(
      layers=draw(_layers()),
      loss=draw(_loss()),
      task=draw(st.sampled_from(["classes", "values"])),
      optimizer=draw(
          st.sampled_from(["sgd", "momentum", "adam", "adagrad", "rmsprop"])),
      route=draw(
          st.sampled_from(
              ["minimize", "compute_apply", "clipped", "in_cond",
               "gradients"])),
      state=tuple(
          draw(
              st.lists(
                  st.sampled_from(
                      ["count", "moving_mean", "class_counts", "bank"]),
                  unique=True,
                  max_size=2))),
      metrics=tuple(
          draw(
              st.lists(
                  st.sampled_from(
                      ["keras_mean_absolute", "keras_largest", "at_k"]),
                  unique=True,
                  max_size=2))),
      control=draw(st.booleans()),
      python_state=draw(st.sampled_from(["none", "object", "shared_layer"])),
      regularize=draw(st.booleans()),
      # Fewer rows than towers (empty towers), one row, uneven shards.
      batch=draw(st.integers(1, 9)),
      towers=towers,
      static=draw(st.booleans()))


# The model_fn a case describes.


def _data(case: Case):
  rows = case.batch * STEPS
  rng = np.random.RandomState(case.batch * 7 + case.towers)
  x = rng.randn(rows, FEATURES).astype(np.float32)
  mask = (rng.rand(rows) > 0.4).astype(np.float32)
  mask[::case.batch] = 1.0  # every batch has a valid row
  weights = rng.uniform(0.5, 2.0, rows).astype(np.float32)
  # Sorted group ids within each batch (segment ops need them sorted).
  group = np.concatenate([
      np.sort(rng.randint(0, 3, case.batch)) for _ in range(STEPS)
  ]).astype(np.int64)
  if case.task == "classes":
    labels = rng.randint(0, CLASSES, rows).astype(np.int64)
  else:
    labels = rng.randn(rows, 2).astype(np.float32)
  features = {"x": x, "mask": mask, "weights": weights, "group": group}
  if ("sparse_feature",) in case.layers:  # some rows have no entries
    present = np.argwhere(rng.rand(rows, 4) < 0.4)
    features["sparse"] = tf.compat.v1.SparseTensorValue(
        present,
        rng.uniform(-1.0, 1.0, len(present)).astype(np.float32), [rows, 4])
  if ("ragged_feature",) in case.layers:  # rows of 0 to 3 values
    lengths = rng.randint(0, 4, rows)
    features["ragged"] = tf.RaggedTensor.from_row_lengths(
        rng.uniform(-1.0, 1.0, lengths.sum()).astype(np.float32), lengths)
  if ("string_lookup",) in case.layers:  # "d" is out of the vocabulary
    features["words"] = rng.choice(np.array([b"a", b"b", b"c", b"d"]), rows)
  return features, labels


class _Model:
  """A model object in TensorFlow Ranking's style: one call computes and
  keeps tensors on itself, a later call reads them."""

  def __init__(self):
    self.hidden = None

  def compute(self, hidden):
    self.hidden = hidden
    return hidden

  def penalty(self):
    return 1e-2 * tf.reduce_mean(tf.reduce_sum(tf.square(self.hidden), 1))


def _layer(spec, h, features, training, index, regularizer):
  kind = spec[0]
  name = f"layer{index}"
  if kind == "dense":
    _, width, activation, api = spec
    if api == "v1":
      return tf.compat.v1.layers.dense(
          h,
          width,
          activation=activation,
          kernel_regularizer=regularizer,
          name=name)
    return tf.keras.layers.Dense(
        width, activation=activation, kernel_regularizer=regularizer,
        name=name)(
            h)
  if kind == "batch_norm":
    if spec[1] == "v1":
      return tf.compat.v1.layers.batch_normalization(
          h, training=training, momentum=0.5, name=name)
    return tf.keras.layers.BatchNormalization(
        momentum=0.5, name=name)(
            h, training=training)
  if kind == "center":
    return h - tf.reduce_mean(h, axis=0, keepdims=True)
  if kind == "batch_max":
    return h / (1.0 + tf.reduce_max(tf.abs(h)))
  if kind == "first_row":
    return h - tf.gather(h, 0) + 0.5 * h[-1:]
  if kind == "row_norm":
    return h / (1.0 + tf.reduce_sum(tf.square(h), axis=1, keepdims=True))
  if kind == "custom_gradient":
    if spec[1] == "normalised":
      return user_code.normalised_gradient(h)
    return user_code.clipped_gradient(h)
  if kind == "sparse_feature":
    sums = tf.sparse.reduce_sum(features["sparse"], axis=1)
    return tf.concat([h, tf.reshape(sums, [-1, 1])], axis=1)
  if kind == "ragged_feature":
    sums = tf.reduce_sum(features["ragged"], axis=1)
    return tf.concat([h, tf.reshape(sums, [-1, 1])], axis=1)
  if kind == "string_lookup":
    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(["a", "b", "c"],
                                            tf.constant([0, 1, 2], tf.int64)),
        default_value=3)
    ids = table.lookup(features["words"])
    embeddings = tf.compat.v1.get_variable(f"{name}_embeddings", [4, 2])
    return tf.concat([h, tf.nn.embedding_lookup(embeddings, ids)], axis=1)
  assert kind == "concat"
  return tf.concat([h, tf.tanh(h)], axis=1)


def _weights_of(which, features):
  return {
      "none": 1.0,
      "mask": features["mask"],
      "weights": features["weights"]
  }[which]


def _class_ids(case, features, labels):
  """Each row's class: its label, or its group when labels are values."""
  return labels if case.task == "classes" else features["group"]


# Losses over (errors, outputs, features, class ids) as users write them
# with code no per-row rule reads.
_UNREAD = {
    "class_balanced":
        lambda e, outputs, features, ids: tf.reduce_sum(
            e * user_code.class_weights(ids, e.dtype)) / tf.reduce_sum(
                user_code.class_weights(ids, e.dtype)),
    "bincount_weights":
        lambda e, outputs, features, ids: tf.reduce_mean(
            e * user_code.bincount_weights(ids, CLASSES, e.dtype)),
    "distinct_classes":
        lambda e, outputs, features, ids: tf.reduce_mean(e) * user_code.
        distinct_count(ids, e.dtype),
    "numpy_function_weights":
        lambda e, outputs, features, ids: tf.reduce_sum(
            e * user_code.python_weights(features["x"])),
    "py_function_weights":
        lambda e, outputs, features, ids: tf.reduce_mean(
            e * user_code.eager_python_weights(features["x"])),
    "numpy_function_scale":
        lambda e, outputs, features, ids: tf.reduce_mean(e) * user_code.
        python_scale(features["x"]),
    "tf_function_mean":
        lambda e, outputs, features, ids: tf.reduce_mean(e) + 0.1 * user_code.
        mean_square(outputs),
    "tf_function_pairwise":
        lambda e, outputs, features, ids: user_code.pairwise_hinge(e),
    "scan_ema":
        lambda e, outputs, features, ids: tf.reduce_mean(
            user_code.scan_ema(e) * e),
    "foldl_max":
        lambda e, outputs, features, ids: tf.reduce_mean(e) + 0.1 * user_code.
        foldl_max(e),
    "while_loop_rows":
        lambda e, outputs, features, ids: tf.reduce_mean(
            user_code.rows_by_while_loop(e) * e),
    "tile_pairwise":
        lambda e, outputs, features, ids: tf.reduce_mean(e) + 0.01 * user_code.
        pairwise_by_tile(outputs),
}


def _loss_value(spec, errors, features, labels, outputs, case):
  """The loss a spec describes, over per-example `errors`."""
  kind = spec[0]
  mask = features["mask"]
  if kind in _UNREAD:
    return _UNREAD[kind](errors, outputs, features,
                         _class_ids(case, features, labels))
  if kind == "mean":
    return tf.reduce_mean(errors)
  if kind == "masked_mean":
    return tf.reduce_sum(errors * mask) / tf.reduce_sum(mask)
  if kind == "batch_sum_mean":
    # As the library asked before the construction: still one device's.
    return replicate.batch_sum(tf.reduce_sum(errors * mask)) / (
        replicate.batch_sum(tf.reduce_sum(mask)))
  if kind == "v1_losses":
    return tf.compat.v1.losses.compute_weighted_loss(
        errors,
        weights=_weights_of(spec[2], features),
        reduction=spec[1],
        loss_collection=None)
  if kind == "v1_direct":
    weights = _weights_of(spec[2], features)
    if case.task == "classes":
      return tf.compat.v1.losses.sparse_softmax_cross_entropy(
          labels,
          outputs,
          weights=weights,
          reduction=spec[1],
          loss_collection=None)
    if not isinstance(weights, float):
      weights = weights[:, None]
    return tf.compat.v1.losses.mean_squared_error(
        labels,
        outputs,
        weights=weights,
        reduction=spec[1],
        loss_collection=None)
  if kind == "sum_over_size":
    return tf.reduce_sum(errors) / tf.cast(tf.shape(errors)[0], tf.float32)
  if kind == "sum":
    return 0.1 * tf.reduce_sum(errors)
  if kind == "max":
    return tf.reduce_max(errors)
  if kind == "logsumexp":
    return tf.reduce_logsumexp(errors) - tf.math.log(
        tf.cast(tf.size(errors), tf.float32))
  if kind == "variance":
    return tf.reduce_mean(tf.square(errors - tf.reduce_mean(errors)))
  rows = tf.shape(errors)[0]
  if kind == "position_weights":  # DCG-style discounts by position
    weights = 1.0 / tf.math.log(2.0 + tf.cast(tf.range(rows), tf.float32))
    return tf.reduce_sum(weights * errors) / tf.reduce_sum(weights)
  if kind == "segment_mean":  # a mean per group, then over groups
    return tf.reduce_mean(tf.math.segment_mean(errors, features["group"]))
  if kind == "top_k_mean":  # hard-example mining
    k = tf.cast(tf.math.ceil(tf.cast(rows, tf.float32) / 2.0), tf.int32)
    return tf.reduce_mean(tf.math.top_k(errors, k).values)
  if kind == "sorted_trim":
    return tf.reduce_sum(tf.sort(errors)[:-1]) + tf.reduce_max(errors)
  if kind == "cumsum_mean":
    return 0.1 * tf.reduce_mean(tf.math.cumsum(errors, axis=0))
  if kind == "softmax_over_batch":  # listwise
    return tf.reduce_sum(tf.nn.softmax(-errors, axis=0) * errors)
  if kind == "map_fn":
    return tf.reduce_mean(tf.map_fn(lambda e: tf.square(e) + e, errors))
  if kind == "tensordot":
    return tf.tensordot(errors, errors, 1) / tf.cast(
        tf.size(errors), tf.float32)
  if kind == "pairwise":
    return tf.reduce_mean(tf.nn.relu(errors[:, None] - errors[None, :]))
  if kind == "argsort_ranks":  # each loss weighted by its rank
    ranks = tf.cast(tf.range(rows), tf.float32) + 1.0
    return tf.reduce_sum(tf.gather(errors, tf.argsort(errors)) * ranks) / (
        tf.reduce_sum(ranks))
  sub = lambda s: _loss_value(s, errors, features, labels, outputs, case)
  if kind == "scaled":
    return spec[1] * sub(spec[2])
  if kind == "weighted_sum":
    return tf.add_n([spec[1] * sub(spec[2]), spec[3] * sub(spec[4])])
  assert kind == "ratio"
  return sub(spec[1]) / (1.0 + sub(spec[2]))


def _optimizer(name):
  # Adam's and RMSProp's epsilon bounds how much a gradient's rounding
  # (towers sum in another order) moves the update: by lr / epsilon times.
  return {
      "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
      "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
      "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.01, epsilon=0.1),
      "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.1),
      "rmsprop": lambda: tf.compat.v1.train.RMSPropOptimizer(0.01, epsilon=0.1),
  }[name]()


def _train_op(case, loss):
  optimizer = _optimizer(case.optimizer)
  step = tf.compat.v1.train.get_global_step()
  if case.route == "minimize":
    return optimizer.minimize(loss, step)
  if case.route == "compute_apply":
    return optimizer.apply_gradients(optimizer.compute_gradients(loss), step)
  if case.route == "clipped":
    grads, variables = zip(*optimizer.compute_gradients(loss))
    clipped, _ = tf.clip_by_global_norm(grads, 1.0)
    return optimizer.apply_gradients(zip(clipped, variables), step)
  if case.route == "gradients":
    variables = tf.compat.v1.trainable_variables()
    return optimizer.apply_gradients(
        zip(tf.gradients(loss, variables), variables), step)
  assert case.route == "in_cond"
  # Trains every other step; the step counts every step.
  update = tf.cond(
      tf.equal(step % 2, 0), lambda: optimizer.minimize(loss), tf.no_op)
  with tf.control_dependencies([update]):
    return step.assign_add(1)


def _state_writes(case, features, hidden, ids):
  writes = []
  if "count" in case.state:
    count = tf.compat.v1.get_variable(
        "valid_rows", [], initializer=tf.zeros_initializer(), trainable=False)
    writes.append(count.assign_add(tf.reduce_sum(features["mask"])))
  if "moving_mean" in case.state:
    mean = tf.compat.v1.get_variable(
        "hidden_mean",
        hidden.shape[1:],
        initializer=tf.zeros_initializer(),
        trainable=False)
    writes.append(mean.assign(0.5 * mean + 0.5 * tf.reduce_mean(hidden, 0)))
  if "class_counts" in case.state:
    counts = tf.compat.v1.get_variable(
        "class_counts", [CLASSES],
        initializer=tf.zeros_initializer(),
        trainable=False)
    writes.append(
        counts.assign_add(
            tf.math.bincount(
                tf.cast(ids, tf.int32), minlength=CLASSES, dtype=tf.float32)))
  if "bank" in case.state:  # MoCo's queue: the last rows seen
    bank = tf.compat.v1.get_variable(
        "bank", [BANK, hidden.shape[1]],
        initializer=tf.zeros_initializer(),
        trainable=False)
    writes.append(
        bank.assign(tf.concat([bank, tf.stop_gradient(hidden)], 0)[-BANK:]))
  return writes


_KERAS_METRICS = {
    "keras_mean_absolute": user_code.MeanAbsolute,
    "keras_largest": user_code.LargestBatchMean
}


def _drawn_metrics(case, errors, outputs, ids):
  metrics = {}
  for name in case.metrics:
    if name == "at_k":
      metrics[name] = tf.compat.v1.metrics.precision_at_k(ids, outputs, 2)
    else:  # update_state as users call it; Keras wraps it in a tf.function
      metrics[name] = _KERAS_METRICS[name](tf.float32)
      metrics[name].update_state(errors)
  return metrics


def make_model_fn(case: Case):
  """A fresh model_fn for one graph (its Python state is its own)."""
  model = _Model()
  shared = tf.keras.layers.Dense(2, name="shared")

  def model_fn(features, labels, mode):
    training = mode == TRAIN
    regularizer = (tf.keras.regularizers.l2(1e-2) if case.regularize else None)
    h = features["x"]
    for index, spec in enumerate(case.layers):
      h = _layer(spec, h, features, training, index, regularizer)
    if case.python_state == "shared_layer":
      h = tf.concat([h, shared(features["x"])], axis=1)
    if case.python_state == "object":
      h = model.compute(h)
    width = CLASSES if case.task == "classes" else 2
    outputs = tf.compat.v1.layers.dense(h, width, name="out")
    predictions = {"outputs": outputs, "hidden": h}
    if mode == PREDICT:
      return tf.estimator.EstimatorSpec(mode, predictions=predictions)
    if case.task == "classes":
      errors = tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=outputs)
    else:
      errors = tf.reduce_sum(tf.square(outputs - labels), axis=1)
    loss = _loss_value(case.loss, errors, features, labels, outputs, case)
    tf.compat.v1.summary.scalar("data_loss", loss)
    tf.compat.v1.summary.histogram("hidden", h)
    tf.compat.v1.summary.scalar("last_output", outputs[-1, 0])
    if case.python_state == "object":
      loss += model.penalty()
    if case.regularize:
      loss += tf.compat.v1.losses.get_regularization_loss()
    ids = _class_ids(case, features, labels)
    writes = _state_writes(case, features, h, ids)
    if case.control and writes:
      with tf.control_dependencies(writes):
        loss = tf.identity(loss)
    tf.compat.v1.summary.scalar("loss", loss)
    if mode == EVAL:
      metrics = {
          "error": tf.compat.v1.metrics.mean(errors, weights=features["mask"]),
          "batch_loss": tf.compat.v1.metrics.mean(loss),
          **_drawn_metrics(case, errors, outputs, ids)
      }
      if case.task == "classes":
        metrics["accuracy"] = tf.compat.v1.metrics.accuracy(
            labels, tf.argmax(outputs, 1))
      else:
        metrics["mse"] = tf.compat.v1.metrics.mean_squared_error(
            labels, outputs)
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, eval_metric_ops=metrics)
    update_ops = tf.compat.v1.get_collection(
        tf.compat.v1.GraphKeys.UPDATE_OPS) + writes
    with tf.control_dependencies(update_ops):
      train_op = _train_op(case, loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


# Running a case.


def _run(case: Case, mode, towers):
  """(per-step fetches, final variables) of `case` on `towers` (1: plain)."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(case), case.batch, case.static)
    if mode == PREDICT:
      labels = None
    model_fn = make_model_fn(case)
    if towers > 1:
      model_fn = replicate.replicate_model_fn(
          model_fn, devices=harness.devices(harness.VIRTUAL_CPUS, towers))
    spec = model_fn(features, labels, mode)
    if mode == TRAIN:
      fetches = {
          "loss": spec.loss,
          "train": spec.train_op,
          "summary": tf.compat.v1.summary.merge_all()
      }
    elif mode == EVAL:
      fetches = {
          "loss": spec.loss,
          "updates": [u for _, u in spec.eval_metric_ops.values()]
      }
    else:
      fetches = {"predictions": spec.predictions}
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run([
          tf.compat.v1.global_variables_initializer(),
          tf.compat.v1.local_variables_initializer(),
          tf.compat.v1.tables_initializer()
      ])
      harness.set_trainable_weights(session)
      runs = [session.run(fetches) for _ in range(STEPS)]
      if mode == EVAL:
        runs.append(
            session.run({
                k: v for k, (v, _) in spec.eval_metric_ops.items()
            }))
      variables = {
          v.op.name: session.run(v) for v in tf.compat.v1.global_variables()
      }
  for run in runs:
    run.pop("train", None)
    run.pop("updates", None)
    if "summary" in run:
      summary = tf.compat.v1.Summary.FromString(run.pop("summary"))
      run["summaries"] = {
          v.tag: (v.simple_value if v.HasField("simple_value") else [
              v.histo.num, v.histo.sum, v.histo.sum_squares, v.histo.min,
              v.histo.max
          ]) for v in summary.value
      }
  return runs, variables


def _tolerance(case: Case):
  """float32 sums in another order differ by a few ulps of their terms'
  magnitude; a max, a ratio or a batch statistic passes that on at most
  ~10x per level of the loss and layers, and two steps of an optimizer
  add the update's rounding (lr / epsilon times a gradient's for Adam and
  RMSProp)."""
  return dict(rtol=2e-4, atol=2e-5)


def _assert_same(case: Case, mode):
  expected_runs, expected = _run(case, mode, 1)
  runs, actual = _run(case, mode, case.towers)
  tolerance = _tolerance(case)
  for step, (run, expected_run) in enumerate(zip(runs, expected_runs)):
    assert sorted(run) == sorted(expected_run), step
    for key in expected_run:
      harness.assert_close_nests(run[key], expected_run[key], **tolerance)
  assert sorted(actual) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(
        actual[name], expected[name], err_msg=name, **tolerance)


def _examples(request, test):
  marked = "drawn" in (request.config.getoption("markexpr") or "")
  return _MANY if marked else _EXAMPLES[test]


def _settings(request, test):
  return hypothesis.settings(
      max_examples=_examples(request, test),
      deadline=None,
      suppress_health_check=list(hypothesis.HealthCheck),
      print_blob=True,
      database=None)


def test_drawn_model_fns_train_as_one_device(request):

  @_settings(request, "train")
  @hypothesis.given(case=cases())
  def check(case):
    _assert_same(case, TRAIN)

  check()


def test_drawn_model_fns_evaluate_as_one_device(request):

  @_settings(request, "eval")
  @hypothesis.given(case=cases())
  def check(case):
    _assert_same(case, EVAL)

  check()


def test_drawn_model_fns_predict_as_one_device(request):

  @_settings(request, "predict")
  @hypothesis.given(case=cases())
  def check(case):
    _assert_same(case, PREDICT)

  check()
