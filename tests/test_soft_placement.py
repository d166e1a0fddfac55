"""Replicated graphs place without soft placement, as the plain graph does.

Every session here has four virtual CPUs and `allow_soft_placement=False`:
a tower op that asks for '/device:CPU:1' while TensorFlow must run it (or
an op colocated with it) where its variable lives would fail to place.
Embedding lookups are the common case (their gradients are colocated with
the lookup, which reads the variable), conds over variables (the canned
linear model's zero-fraction summary) and loops over shared variables (a
Keras LSTM). Values are one device's.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

TRAIN, EVAL, PREDICT = harness.TRAIN, harness.EVAL, harness.PREDICT
NUM_IDS, NUM_CLASSES = 10, 3
# (towers, placement, batch): 10 rows on 4 towers is uneven.
LAYOUTS = [(2, "shared", 8), (2, "round_robin", 8), (4, "shared", 10),
           (4, "round_robin", 10)]


def _data(num_examples=40):
  rng = np.random.RandomState(3)
  ids = rng.randint(0, NUM_IDS, size=(num_examples, 2)).astype(np.int64)
  return {"ids": ids}, (ids[:, 0] % NUM_CLASSES).astype(np.int64)


def _embedded(features, lookup):
  """[batch, 4] embeddings of the two ids of each row, averaged."""
  ids = features["ids"]
  if lookup == "gather_resource":
    table = tf.compat.v1.get_variable("table", [NUM_IDS, 4], use_resource=True)
    return tf.reduce_mean(tf.gather(table, ids), axis=1)
  if lookup == "embedding_lookup_ref":
    table = tf.compat.v1.get_variable("table", [NUM_IDS, 4], use_resource=False)
    return tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(table, ids), 1)
  if lookup == "keras_embedding":
    return tf.reduce_mean(
        tf.keras.layers.Embedding(NUM_IDS, 4, name="embedding")(ids), axis=1)
  if lookup == "keras_lstm":
    # A while loop that reads the LSTM's variables in its body.
    embedded = tf.keras.layers.Embedding(NUM_IDS, 4, name="embedding")(ids)
    return tf.keras.layers.LSTM(4, name="lstm")(embedded)
  column = tf.feature_column.embedding_column(
      tf.feature_column.categorical_column_with_identity("ids", NUM_IDS), 4)
  return tf.compat.v1.feature_column.input_layer(features, [column])


def _model_fn(features, labels, mode, params):
  """Embeddings, a dense layer and a cond that reads the kernel."""
  embedded = _embedded(features, params["lookup"])
  logits = tf.compat.v1.layers.dense(embedded, NUM_CLASSES, name="logits")
  kernel = tf.compat.v1.trainable_variables("logits/kernel")[0]
  # Like the canned linear model's summary: a variable read inside a cond.
  sparsity = tf.compat.v1.cond(
      tf.size(kernel) > 0, lambda: tf.math.zero_fraction(kernel),
      lambda: tf.constant(0.0))
  tf.compat.v1.summary.scalar("sparsity", sparsity)
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(
        mode,
        predictions={
            "probabilities": tf.nn.softmax(logits),
            "sparsity": tf.fill([tf.shape(logits)[0]], sparsity)
        })
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  metrics = {
      "accuracy": tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1))
  }
  optimizer = replicate.TowerOptimizer(tf.compat.v1.train.AdagradOptimizer(0.3))
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op, eval_metric_ops=metrics)


def _session_config():
  config = harness.session_config(harness.VIRTUAL_CPUS, soft=False)
  assert not config.allow_soft_placement and config.device_count["CPU"] == 4
  return config


@functools.lru_cache(maxsize=None)
def _run(lookup, towers, placement, batch):
  """Trains 3 steps, evaluates and predicts 2 batches in one graph each."""
  model_fn = _model_fn
  if towers:
    model_fn = replicate.replicate_model_fn(
        _model_fn,
        devices=[f"/device:CPU:{i}" for i in range(towers)],
        variable_placement=placement)
  params = {"lookup": lookup}
  features, labels = _data()
  results = {}
  for mode in (TRAIN, EVAL, PREDICT):
    with tf.Graph().as_default():
      tf.compat.v1.train.create_global_step()
      data = (features, labels) if mode != PREDICT else features
      inputs = harness.batches(data, batch)
      if mode == PREDICT:
        spec = model_fn(inputs, None, mode, params)
      else:
        spec = model_fn(inputs[0], inputs[1], mode, params)
      with tf.compat.v1.Session(config=_session_config()) as session:
        if mode == TRAIN:
          losses, values = harness.run_training(session, spec, 3)
          results["losses"] = losses
          results["variables"] = {
              k: v
              for k, v in values.items()
              if k in {x.op.name for x in tf.compat.v1.trainable_variables()}
          }
          continue
        session.run([
            tf.compat.v1.global_variables_initializer(),
            tf.compat.v1.local_variables_initializer()
        ])
        harness.set_trainable_weights(session)
        if mode == EVAL:
          updates = [u for _, u in spec.eval_metric_ops.values()]
          results["eval_losses"] = [
              session.run([spec.loss, updates])[0] for _ in range(2)
          ]
          results["metrics"] = session.run({
              k: v for k, (v, _) in spec.eval_metric_ops.items()
          })
        else:
          results["predictions"] = [
              session.run(spec.predictions) for _ in range(2)
          ]
  return results


LOOKUPS = [
    "gather_resource", "embedding_lookup_ref", "keras_embedding",
    "embedding_column"
]

# Each lookup on 2 and on 4 towers, the placements swapped by turns: every
# layout meets two lookups. The default run keeps one case of each lookup,
# the first two on 4 towers, the others on 2: every layout meets one.
_LOOKUP_LAYOUTS = [
    (pytest.param if (towers == 4) == (index < 2) else harness.wide)(
        lookup,
        towers,
        placement,
        batch,
        id=f"{lookup}-{towers}-{placement}-{batch}")
    for index, lookup in enumerate(LOOKUPS)
    for towers, placement, batch in (LAYOUTS[index % 2], LAYOUTS[3 - index % 2])
]


@pytest.mark.parametrize("lookup,towers,placement,batch", _LOOKUP_LAYOUTS)
def test_lookups_place_without_soft_placement_with_one_devices_values(
    lookup, towers, placement, batch):
  expected = _run(lookup, None, None, batch)
  actual = _run(lookup, towers, placement, batch)
  assert sorted(actual["variables"]) == sorted(expected["variables"])
  harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)


# A loop (keras_lstm) is left out, as for ROUND_ROBIN below: its body's ops
# were placed on tower 0's device when it was built, and only soft
# placement moves them to the copy its tower reads. The default run keeps a
# reference variable's lookup and a feature column's.
@pytest.mark.parametrize("lookup", [
    harness.wide("gather_resource"), "embedding_lookup_ref",
    harness.wide("keras_embedding"), "embedding_column"
])
def test_mirrored_places_without_soft_placement_with_one_devices_values(lookup):
  # 10 rows on 3 towers: shards of 4, 3 and 3.
  expected = _run(lookup, None, None, 10)
  actual = _run(lookup, 3, "mirrored", 10)
  assert sorted(actual["variables"]) == sorted(expected["variables"])
  harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)


# ROUND_ROBIN is left out: the gradient of a loop reading variables on
# several devices colocates their shapes with the loop (TensorFlow's zeros
# for the loop's resource outputs), which only soft placement can place.
@pytest.mark.parametrize("towers,batch", [harness.wide(2, 8), (4, 10)])
def test_a_loop_over_shared_variables_places_without_soft_placement(
    towers, batch):
  expected = _run("keras_lstm", None, None, batch)
  actual = _run("keras_lstm", towers, "shared", batch)
  harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)


# The canned estimators (v2, Keras optimizers) through an Estimator whose
# session has no soft placement.
IDS = tf.feature_column.categorical_column_with_identity("ids", NUM_IDS)
CANNED = {
    "linear":
        lambda config: tf.estimator.LinearClassifier(
            [IDS],
            n_classes=NUM_CLASSES,
            config=config,
            optimizer=replicate.TowerOptimizer(
                tf.keras.optimizers.legacy.Ftrl(0.1))),
    "dnn_embedding":
        lambda config: tf.estimator.DNNClassifier(
            [8], [tf.feature_column.embedding_column(IDS, 4)],
            n_classes=NUM_CLASSES,
            config=config,
            optimizer=replicate.TowerOptimizer(
                tf.keras.optimizers.legacy.Adagrad(0.05))),
}


def _input_fn(epochs=None, with_labels=True, batch=8):
  features, labels = _data(32)
  data = (features, labels) if with_labels else features
  return lambda: tf.data.Dataset.from_tensor_slices(data).repeat(epochs).batch(
      batch)


@functools.lru_cache(maxsize=None)
def _canned_run(canned, towers, placement, model_dir):
  config = tf.estimator.RunConfig(
      model_dir=model_dir,
      tf_random_seed=7,
      save_checkpoints_steps=1000,
      save_summary_steps=1000,
      log_step_count_steps=1000,
      session_config=_session_config())
  estimator = CANNED[canned](config)
  if towers:
    estimator = tf.estimator.Estimator(
        replicate.replicate_model_fn(
            estimator.model_fn,
            devices=[f"/device:CPU:{i}" for i in range(towers)],
            variable_placement=placement),
        config=config)
  estimator.train(_input_fn(), steps=3)
  metrics = estimator.evaluate(_input_fn(epochs=1, batch=10))
  predictions = [
      p["probabilities"] for p in estimator.predict(
          _input_fn(epochs=1, with_labels=False, batch=10))
  ]
  variables = {
      n: estimator.get_variable_value(n) for n in estimator.get_variable_names()
  }
  return metrics, np.array(predictions), variables


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
  """One model_dir per run, so that _canned_run's cache is hit."""
  return functools.lru_cache(maxsize=None)(
      lambda *run: str(tmp_path_factory.mktemp("_".join(map(str, run)))))


# The default run keeps the linear model (its summary's cond over variables)
# round robin; the DNN's embedding column is in the lookups' cases above.
@pytest.mark.parametrize(
    "canned,towers,placement",
    [(pytest.param if (canned, towers) == ("linear", 4) else harness.wide)(
        canned, towers, placement, id=f"{canned}-{towers}-{placement}")
     for canned in sorted(CANNED)
     for towers, placement in [(2, "shared"), (4, "round_robin")]])
def test_canned_categorical_models_place_without_soft_placement(
    canned, towers, placement, model_dirs):
  expected = _canned_run(canned, None, None, model_dirs(canned))
  actual = _canned_run(canned, towers, placement,
                       model_dirs(canned, towers, placement))
  harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)
