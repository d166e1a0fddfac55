"""A batch smaller than the number of towers gives one device's results.

Such a batch leaves towers without examples; they compute on one phantom
row (the batch's last), which must not show in losses, gradients, metrics,
predictions, export outputs or model-state writes. The models are ones that
cannot take a 0-row batch: the canned linear models (v1 and v2, alone and
in DNNLinearCombinedClassifier, with a weight column) over vocabulary,
hashed and crossed columns, whose SparseReshape fails on an empty batch,
and a custom model_fn that reshapes a SparseTensor the same way and writes
SUM counters, scatter rows and fused batch-norm statistics.

Each graph is built once with a dynamic batch dimension and fed every batch
size B in 1..N-1 and N+1 (N = 2 and 4 towers), in TRAIN, EVAL and PREDICT;
static batches, which build the phantom towers' gates in Python, get their
own graphs.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

TRAIN, EVAL, PREDICT = harness.TRAIN, harness.EVAL, harness.PREDICT
MODES = (TRAIN, EVAL, PREDICT)
R = tf.compat.v1.losses.Reduction
fc = tf.feature_column

NUM_EXAMPLES = 5  # the largest batch fed: N + 1 for N = 4
TOWERS = (2, 4)
# Float sums over shards in another order: a few ulps of float32.
RTOL, ATOL = 1e-5, 1e-6


def _batch_sizes(num_towers):
  """Every B that leaves a tower empty, and one that does not: N + 1."""
  return list(range(1, num_towers)) + [num_towers + 1]


def _data():
  """Five examples: dense, string and weight features, int labels [n, 1]."""
  rng = np.random.RandomState(4)
  features = {
      "x": rng.randn(NUM_EXAMPLES, 2).astype(np.float32),
      "color": np.array([b"r", b"g", b"b", b"g", b"r"]),
      "word": np.array([b"a", b"bb", b"c", b"dd", b"bb"]),
      "w": rng.uniform(0.5, 2.0, (NUM_EXAMPLES, 1)).astype(np.float32),
  }
  labels = np.array([[0], [2], [1], [2], [0]], np.int64)
  return features, labels


def _inputs(static_size=None):
  """The data as constants of `static_size` rows, or fed by dynamic size.

  Returns (features, labels, feed): `feed(B)` is the feed_dict that makes
  the dynamic batch the first B examples (empty for a static batch).
  """
  features, labels = _data()
  if static_size is not None:
    return (tf.nest.map_structure(lambda a: tf.constant(a[:static_size]),
                                  features), tf.constant(labels[:static_size]),
            lambda size: {})
  arrays = dict(features, labels=labels)
  tensors = {
      key:
          tf.compat.v1.placeholder_with_default(
              value, [None] + list(value.shape[1:]), name=key)
      for key, value in arrays.items()
  }
  feed = lambda size: {tensors[k]: v[:size] for k, v in arrays.items()}
  features = {k: v for k, v in tensors.items() if k != "labels"}
  return features, tensors["labels"], feed


# The canned estimators, v1 (tf.compat.v1 optimizers, SUM) and v2 (Keras
# optimizers, SUM_OVER_BATCH_SIZE), multi-class heads.


def _columns():
  color = fc.categorical_column_with_vocabulary_list("color", ["r", "g", "b"])
  word = fc.categorical_column_with_hash_bucket("word", 7)
  crossed = fc.crossed_column(["color", "word"], 11)
  return [color, word, crossed], [fc.numeric_column("x", shape=(2,))]


def _canned(name):
  linear_columns, dnn_columns = _columns()
  if name.endswith("v1"):
    estimators = tf.compat.v1.estimator
    optimizer = lambda: replicate.TowerOptimizer(
        tf.compat.v1.train.FtrlOptimizer(0.1))
  else:
    estimators = tf.estimator
    optimizer = lambda: replicate.TowerOptimizer(
        tf.keras.optimizers.legacy.Ftrl(0.1))
  if name.startswith("linear"):
    return estimators.LinearClassifier(
        feature_columns=linear_columns,
        n_classes=3,
        weight_column="w",
        optimizer=optimizer())
  return estimators.DNNLinearCombinedClassifier(
      linear_feature_columns=linear_columns,
      dnn_feature_columns=dnn_columns,
      dnn_hidden_units=[3],
      n_classes=3,
      weight_column="w",
      linear_optimizer=optimizer(),
      dnn_optimizer=optimizer())


# A custom model_fn that cannot take zero rows either.


def _custom_model_fn(features, labels, mode, params):
  """Linear over x and a bag of words; counters, scatter rows, batch norm.

  `tf.sparse.reshape(..., [batch size, -1])` fails on a 0-row batch, as in
  TensorFlow's linear columns.
  """
  training = mode == TRAIN
  # Ids 1..6: from_dense keeps every entry.
  words = tf.strings.to_hash_bucket_fast(features["word"], 6)[:, None] + 1
  pairs = tf.sparse.reshape(
      tf.sparse.from_dense(tf.concat([words, words], axis=1)),
      [tf.shape(words)[0], -1])
  table = tf.compat.v1.get_variable(
      "table", [7, 2], initializer=tf.compat.v1.zeros_initializer())
  bag = tf.nn.embedding_lookup_sparse(table, pairs, None, combiner="sum")
  hidden = tf.concat([features["x"], bag], axis=1)
  # Only its moving statistics (model state) are compared: its output, each
  # tower's shard normalised by its own statistics, is not one device's.
  tf.compat.v1.layers.batch_normalization(
      tf.reshape(hidden, [-1, 2, 2, 1]),
      training=training,
      fused=True,
      name="bn")
  logits = tf.compat.v1.layers.dense(hidden, 3, name="logits")
  with tf.control_dependencies(_state_writes(features, words)):
    logits = tf.identity(logits)
  predictions = {
      "logits": logits,
      "classes": tf.argmax(logits, axis=1),
      "words": words
  }
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(
        mode,
        predictions=predictions,
        export_outputs={
            "serving_default":
                tf.estimator.export.ClassificationOutput(
                    scores=tf.nn.softmax(logits)),
            "regress":
                tf.estimator.export.RegressionOutput(
                    value=tf.reduce_max(logits, axis=1))
        })
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, logits, weights=features["w"], reduction=params["reduction"])
  if mode == EVAL:
    mean = tf.keras.metrics.Mean(name="keras_mean")
    mean.update_state(logits[:, 0], sample_weight=features["w"])
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        eval_metric_ops={
            "accuracy":
                tf.compat.v1.metrics.accuracy(
                    labels[:, 0], predictions["classes"],
                    weights=features["w"]),
            "max_logit":
                tf.compat.v1.metrics.mean(tf.reduce_max(logits, 1)),
            "keras_mean":
                mean
        })
  update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  with tf.control_dependencies(update_ops):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op, predictions=predictions)


def _state_writes(features, words):
  """A SUM row counter, a SUM weight total and SUM per-bucket scatter counts."""

  def counter(name, shape=()):
    return tf.compat.v1.get_variable(
        name,
        shape,
        trainable=False,
        use_resource=True,
        initializer=tf.compat.v1.zeros_initializer(),
        aggregation=tf.VariableAggregation.SUM)

  rows = tf.cast(tf.shape(features["x"])[0], tf.float32)
  buckets = counter("bucket_counts", [7])
  return [
      counter("rows_seen").assign_add(rows),
      counter("weight_seen").assign_add(tf.reduce_sum(features["w"])),
      tf.compat.v1.scatter_add(buckets, words[:, 0],
                               tf.ones_like(words[:, 0], tf.float32)),
  ]


# Running one graph for several batch sizes.


def _model_fn(model):
  """(model_fn, loss reduction, its keyword arguments) for `model`."""
  if model == "custom":
    reduction = R.SUM_BY_NONZERO_WEIGHTS
    return _custom_model_fn, reduction, {"params": {"reduction": reduction}}
  reduction = R.SUM if model.endswith("v1") else R.SUM_OVER_BATCH_SIZE
  config = tf.estimator.RunConfig(session_config=_session_config())
  return _canned(model).model_fn, reduction, {"config": config}


def _session_config():
  # Soft placement as Estimator's RunConfig in these tests: a canned
  # model's summaries read variables inside tf.cond, which the placer
  # cannot colocate across virtual CPUs otherwise.
  return harness.session_config(harness.VIRTUAL_CPUS, soft=True)


def _run(model, mode, num_towers, sizes, static=False):
  """{B: what `mode` gives on the first B examples} for each B in sizes.

  One graph serves every size unless `static` (then sizes is one size).
  Every B starts from the same seeded weights and fresh state.
  """
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels, feed = _inputs(sizes[0] if static else None)
    model_fn, reduction, kwargs = _model_fn(model)
    if num_towers > 1:
      model_fn = replicate.replicate_model_fn(
          model_fn,
          loss_reduction=reduction,
          devices=harness.devices(harness.VIRTUAL_CPUS, num_towers))
    spec = model_fn(features, None if mode == PREDICT else labels, mode,
                    **kwargs)
    with tf.compat.v1.Session(config=_session_config()) as session:
      return {size: _outcome(session, spec, mode, feed(size)) for size in sizes}


def _initialise(session):
  session.run([
      tf.compat.v1.global_variables_initializer(),
      tf.compat.v1.local_variables_initializer(),
      tf.compat.v1.tables_initializer()
  ])
  harness.set_trainable_weights(session)


def _model_state():
  """Every global variable but the towers' sinks, by name."""
  return {
      v.op.name: v
      for v in tf.compat.v1.global_variables()
      if "replicate_sink" not in v.op.name
  }


def _outcome(session, spec, mode, feed):
  """Two train steps or eval batches, or one prediction, from fresh state."""
  _initialise(session)
  if mode == PREDICT:
    outputs = {
        key: {
            name: getattr(output, name)
            for name in ("scores", "classes", "value", "outputs")
            if getattr(output, name, None) is not None
        } for key, output in spec.export_outputs.items()
    }
    return session.run((spec.predictions, outputs), feed)
  if mode == TRAIN:
    losses = [
        session.run((spec.loss, spec.train_op), feed)[0] for _ in range(2)
    ]
  else:
    updates = [update for _, update in spec.eval_metric_ops.values()]
    losses = [session.run((spec.loss, updates), feed)[0] for _ in range(2)]
    losses.append(
        session.run({
            key: value for key, (value, _) in spec.eval_metric_ops.items()
        }))
  return losses, session.run(_model_state())


@functools.lru_cache(maxsize=None)
def _one_device(model, mode):
  return _run(model, mode, 1,
              sorted({b for n in TOWERS for b in _batch_sizes(n)}))


def _assert_one_device(model, mode, actual):
  expected = _one_device(model, mode)
  for size, outcome in actual.items():
    harness.assert_close_nests(outcome, expected[size], rtol=RTOL, atol=ATOL)


def _cases(kept, cases):
  """pytest.params of `cases` (tuples), ids their values joined by "-";
  the default run keeps those in `kept`, the others are `wide`."""
  return [(pytest.param if case in kept else harness.wide)(
      *case, id="-".join(map(str, case))) for case in cases]


# Each canned model at one tower count (a replicated canned graph takes
# seconds to build per tower); each count gets a v1 and a v2, a linear and
# a combined model.
CANNED_TOWERS = (("linear_v1", 4), ("linear_v2", 2), ("combined_v1", 2),
                 ("combined_v2", 4))


# The default run: each model in one mode, every mode, EVAL on 4 towers.
@pytest.mark.parametrize(
    "model,num_towers,mode",
    _cases(
        {("linear_v1", 4, EVAL), ("linear_v2", 2, TRAIN),
         ("combined_v1", 2, PREDICT), ("combined_v2", 4, TRAIN)},
        [(model, n, mode) for model, n in CANNED_TOWERS for mode in MODES]))
def test_canned_linear_models_match_one_device(model, num_towers, mode):
  actual = _run(model, mode, num_towers, _batch_sizes(num_towers))
  _assert_one_device(model, mode, actual)


@pytest.mark.parametrize(
    "mode,num_towers",
    _cases({(TRAIN, 4), (EVAL, 2), (PREDICT, 4)},
           [(mode, n) for mode in MODES for n in TOWERS]))
def test_custom_model_fn_matches_one_device(mode, num_towers):
  actual = _run("custom", mode, num_towers, _batch_sizes(num_towers))
  _assert_one_device("custom", mode, actual)
  if mode != PREDICT:
    for size, (_, state) in actual.items():
      assert state["rows_seen"] == 2 * size  # two steps, no phantom row


@pytest.mark.parametrize(
    "mode,size",
    _cases({(TRAIN, 1), (EVAL, 3), (PREDICT, 1)},
           [(mode, size) for mode in MODES for size in (1, 3)]))
def test_static_batches_match_one_device(mode, size):
  """Static shapes: phantom towers are known when the graph is built.

  On 4 towers, B = 1 leaves only tower 0 real, B = 3 one phantom tower.
  """
  actual = _run("custom", mode, 4, [size], static=True)
  _assert_one_device("custom", mode, actual)


def test_phantom_rows_are_left_out_of_sparse_and_ragged_predictions():
  """Outputs EstimatorSpec does not check (dict predictions of any kind)."""
  # pylint: disable=g-import-not-at-top
  from replicate import _context
  from replicate._batch import row_kinds
  from replicate._meet import rewiring
  from replicate._merge import specs
  with tf.Graph().as_default() as graph:
    size = tf.compat.v1.placeholder_with_default(tf.constant(0, tf.int64), [])
    replication = _context.Replication(
        num_towers=3,
        fractions=[1.0, 0.0, 0.0],
        sizes=[1, size, 0],
        graph=graph,
        valid=[True, size > 0, False])
    rows = lambda first: [[first, 0], [first + 1, 0]]
    towers = [{
        "sparse": tf.sparse.from_dense(tf.constant([[i + 1, 0]])),
        "ragged": tf.ragged.constant(rows(10 * i)),
        "dense": tf.constant([[i]])
    } for i in range(3)]
    towers[0] = {k: v[:1] for k, v in towers[0].items() if k != "sparse"}
    towers[0]["sparse"] = tf.sparse.from_dense(tf.constant([[1, 0]]))
    # Tower 0's predictions hold rows (as the towers' analysis finds).
    replication.rewiring = rewiring.Rewiring(replication)
    for value in (towers[0]["dense"], towers[0]["sparse"].values,
                  towers[0]["ragged"].flat_values):
      replication.rewiring.declare(value, row_kinds.Rows(0))
    merged = specs.concat_predictions(towers, replication)
    with tf.compat.v1.Session() as session:
      phantom = session.run(merged)
      real = session.run(merged, {size: 1})
  np.testing.assert_array_equal(phantom["dense"], [[0]])
  np.testing.assert_array_equal(phantom["sparse"].values, [1])
  assert phantom["ragged"].to_list() == [[0, 0]]
  np.testing.assert_array_equal(real["dense"], [[0], [1]])
  np.testing.assert_array_equal(real["sparse"].values, [1, 2])
  assert real["ragged"].to_list() == [[0, 0], [10, 0]]
