"""TPU-style model_fns (TPUEstimatorSpec) replicate as on one device.

A BERT-classifier-like model_fn as research code writes it for TPUs:
`tf.reshape` with params['batch_size'], `eval_metrics=(metric_fn, tensors)`
over per-example values, `scaffold_fn` restoring a checkpoint with
`init_from_checkpoint`, a `host_call` of the global step, the loss (shaped
[1]) and per-example losses. Run in `TPUEstimator(use_tpu=False)` and in a
plain Estimator (one device: the spec's own `as_estimator_spec()`), on 2
and 4 towers with batches that do and do not divide by the towers.
"""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

TPUEstimatorSpec = tf.compat.v1.estimator.tpu.TPUEstimatorSpec
ModeKeys = tf.estimator.ModeKeys
# TPUEstimator's batch sizes: 10 on 4 towers is 3+3+2+2, 6 is 2+2+1+1.
BATCH = {"train": 10, "eval": 6, "predict": 7}
STEPS = 3
CHECKPOINT_BIAS = 1.0


def _data(num_examples=40):
  rng = np.random.RandomState(0)
  x = rng.randn(num_examples, 2, 4).astype(np.float32)
  y = ((x[:, 0, 0] > 0).astype(np.int32) + (x[:, 1, 1] > 0.5).astype(np.int32))
  return x, y


# (graph, tower index, towers) of each scaffold_fn call; (mode, tower,
# batch_size) of each model_fn call.
SCAFFOLD_CALLS = []
BATCH_SIZES = []


def bert_like_model_fn(features, labels, mode, params):
  tower = replicate.current_tower()
  index = tower.index if tower else 0
  BATCH_SIZES.append((mode, index, params.get("batch_size")))
  # TPU code sizes tensors with the batch it is told it has.
  x = tf.reshape(features["x"], [params.get("batch_size", -1), 8])
  with tf.compat.v1.variable_scope("bert"):
    pooled = tf.compat.v1.layers.dense(x, 6, tf.nn.tanh, name="pooler")
  logits = tf.compat.v1.layers.dense(
      pooled,
      3,
      name="output",
      kernel_initializer=tf.constant_initializer(
          np.linspace(-1.0, 1.0, 18).reshape(6, 3)))
  tvars = tf.compat.v1.trainable_variables()

  def scaffold_fn():
    SCAFFOLD_CALLS.append((tf.compat.v1.get_default_graph(), index,
                           tower.num_towers if tower else 1))
    tf.compat.v1.train.init_from_checkpoint(
        params["init_checkpoint"],
        {v.op.name: v for v in tvars if v.op.name.startswith("bert/")})
    return tf.compat.v1.train.Scaffold()

  if mode == ModeKeys.PREDICT:
    return TPUEstimatorSpec(
        mode,
        predictions={"probabilities": tf.nn.softmax(logits)},
        scaffold_fn=scaffold_fn)
  per_example_loss = -tf.reduce_sum(
      tf.one_hot(labels, 3) * tf.nn.log_softmax(logits), axis=-1)
  loss = tf.reduce_mean(per_example_loss)
  if mode == ModeKeys.EVAL:

    def metric_fn(per_example_loss, label_ids, logits):
      predicted = tf.argmax(logits, axis=-1, output_type=tf.int32)
      return {
          "eval_accuracy": tf.compat.v1.metrics.accuracy(label_ids, predicted),
          "eval_loss": tf.compat.v1.metrics.mean(per_example_loss)
      }

    return TPUEstimatorSpec(
        mode,
        loss=loss,
        scaffold_fn=scaffold_fn,
        eval_metrics=(metric_fn, [per_example_loss, labels, logits]))

  def host_fn(global_step, loss, per_example_loss):
    record = tf.compat.v1.get_variable(
        "host_record", [3],
        trainable=False,
        initializer=tf.compat.v1.zeros_initializer())
    return [
        tf.compat.v1.assign(
            record,
            tf.stack([
                tf.cast(global_step[0], tf.float32), loss[0],
                tf.reduce_mean(per_example_loss)
            ]))
    ]

  # The step's global step, read before the step's update increments it:
  # as a TPU outfeeds it. Without the dependency the read and the update are
  # unordered on a CPU (on one device as on towers), and a CI run read 3.
  global_step = tf.compat.v1.train.get_global_step()
  step_read = tf.reshape(global_step, [1])
  optimizer = replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(0.05))
  with tf.control_dependencies([step_read]):
    train_op = optimizer.minimize(loss, global_step)
  return TPUEstimatorSpec(
      mode,
      loss=loss,
      train_op=train_op,
      scaffold_fn=scaffold_fn,
      host_call=(host_fn, [step_read,
                           tf.reshape(loss, [1]), per_example_loss]))


def _plain_model_fn(features, labels, mode, params):
  """One device in a plain Estimator: converted as TPUEstimator does."""
  return bert_like_model_fn(features, labels, mode, params).as_estimator_spec()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """The 'pre-trained' pooler that scaffold_fn restores."""
  path = str(tmp_path_factory.mktemp("init") / "init.ckpt")
  with tf.Graph().as_default():
    with tf.compat.v1.variable_scope("bert/pooler"):
      tf.compat.v1.get_variable(
          "kernel",
          initializer=np.linspace(-0.5, 0.5, 48).reshape(8,
                                                         6).astype(np.float32))
      tf.compat.v1.get_variable(
          "bias", initializer=np.full(6, CHECKPOINT_BIAS, np.float32))
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      tf.compat.v1.train.Saver().save(session, path)
  return path


def _input_fn(mode, static):
  x, y = _data()

  def input_fn(params):
    data = {"x": x} if mode == "predict" else ({"x": x}, y)
    dataset = tf.data.Dataset.from_tensor_slices(data)
    if mode == "train":
      dataset = dataset.repeat()
    # Static: TPUEstimator's batch; dynamic: a plain Estimator's, whose
    # last eval and predict batches (4 and 5 of 40) are smaller still.
    return dataset.batch(
        params.get("batch_size", BATCH[mode]), drop_remainder=static)

  return input_fn


def _estimator(kind, num_towers, model_dir, checkpoint):
  params = {"init_checkpoint": checkpoint}
  model_fn = bert_like_model_fn
  if num_towers:
    model_fn = replicate.replicate_model_fn(
        model_fn, devices=harness.devices(harness.VIRTUAL_CPUS, num_towers))
  session_config = harness.estimator_config(model_dir, 1).session_config
  if kind == "tpu_estimator":
    return tf.compat.v1.estimator.tpu.TPUEstimator(
        use_tpu=False,
        model_fn=model_fn,
        params=params,
        export_to_tpu=False,
        config=tf.compat.v1.estimator.tpu.RunConfig(
            model_dir=model_dir, session_config=session_config),
        train_batch_size=BATCH["train"],
        eval_batch_size=BATCH["eval"],
        predict_batch_size=BATCH["predict"])
  return tf.estimator.Estimator(
      model_fn if num_towers else _plain_model_fn,
      params=params,
      config=harness.estimator_config(model_dir, 1))


Run = collections.namedtuple("Run", "estimator metrics predictions")


@functools.lru_cache(maxsize=None)
def _run(kind, num_towers, model_dir, checkpoint):
  estimator = _estimator(kind, num_towers, model_dir, checkpoint)
  static = kind == "tpu_estimator"
  estimator.train(_input_fn("train", static), steps=STEPS)
  metrics = estimator.evaluate(_input_fn("eval", static))
  predictions = list(estimator.predict(_input_fn("predict", static)))
  return Run(estimator, metrics, predictions)


@pytest.fixture(scope="module")
def run(tmp_path_factory, checkpoint):

  def run_one(kind, num_towers):
    model_dir = str(tmp_path_factory.getbasetemp() / f"{kind}_{num_towers}")
    return _run(kind, num_towers, model_dir, checkpoint)

  return run_one


KINDS = ["tpu_estimator", "estimator"]


# The default run: 4 towers, which the tests below reuse (2 towers build
# the eval_metrics tests' graphs).
@pytest.mark.parametrize("kind,num_towers", [(kind, 4) for kind in KINDS] +
                         [harness.wide(kind, 2) for kind in KINDS])
def test_trains_evaluates_predicts_as_one_device(run, kind, num_towers):
  expected, actual = run(kind, 0), run(kind, num_towers)
  names = expected.estimator.get_variable_names()
  assert sorted(actual.estimator.get_variable_names()) == sorted(names)
  assert "host_record" in names and "bert/pooler/kernel/Adam" in names
  for name in names:
    np.testing.assert_allclose(
        actual.estimator.get_variable_value(name),
        expected.estimator.get_variable_value(name),
        rtol=1e-5,
        atol=1e-6,
        err_msg=name)
  assert sorted(actual.metrics) == sorted(expected.metrics) == [
      "eval_accuracy", "eval_loss", "global_step", "loss"
  ]
  for key, value in expected.metrics.items():
    np.testing.assert_allclose(
        actual.metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  assert len(actual.predictions) == len(expected.predictions)
  np.testing.assert_allclose([p["probabilities"] for p in actual.predictions],
                             [p["probabilities"] for p in expected.predictions],
                             rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_host_call_gets_the_whole_batch_and_scaffold_restores(run, kind):
  estimator = run(kind, 4).estimator
  step, loss, mean_loss = estimator.get_variable_value("host_record")
  assert step == STEPS - 1  # the global step the last step started from
  # The loss shaped [1] is the whole batch's, as the per-example mean is.
  np.testing.assert_allclose(loss, mean_loss, rtol=1e-5)
  # Restored from the checkpoint (zeros otherwise), then 3 Adam steps of
  # 0.05, each moving a variable by less than 0.05 * 3.2.
  bias = estimator.get_variable_value("bert/pooler/bias")
  assert np.all(np.abs(bias - CHECKPOINT_BIAS) < 0.5)


def test_scaffold_fn_is_tower_0s_called_once_per_graph(run):
  run("tpu_estimator", 4)
  run("estimator", 4)
  # Every graph this module built so far, one device's and the towers'.
  graphs = collections.Counter(graph for graph, _, _ in SCAFFOLD_CALLS)
  assert set(graphs.values()) == {1}
  assert {index for _, index, _ in SCAFFOLD_CALLS} == {0}
  assert 4 in {towers for _, _, towers in SCAFFOLD_CALLS}


def test_tpu_estimator_gives_each_tower_its_shards_batch_size(
    tmp_path, checkpoint):
  del BATCH_SIZES[:]
  estimator = _estimator("tpu_estimator", 4, str(tmp_path), checkpoint)
  estimator.train(_input_fn("train", True), steps=1)
  estimator.evaluate(_input_fn("eval", True))
  list(estimator.predict(_input_fn("predict", True)))
  # Towers are built 1, ..., N-1, then 0.
  order = [1, 2, 3, 0]
  assert BATCH_SIZES == [
      (ModeKeys.TRAIN, i, [3, 3, 2, 2][i]) for i in order
  ] + [(ModeKeys.EVAL, i, [2, 2, 1, 1][i]) for i in order
      ] + [(ModeKeys.PREDICT, i, [2, 2, 2, 1][i]) for i in order]


def _build(mode, eval_metrics, num_towers=2, graph=None):
  """Builds one replicated EVAL graph of a spec with these eval_metrics."""

  def model_fn(features, labels, mode, params):
    del params
    logits = tf.compat.v1.layers.dense(features["x"], 3, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    return TPUEstimatorSpec(
        mode, loss=loss, eval_metrics=eval_metrics(logits, labels))

  with (graph or tf.Graph()).as_default():
    tf.compat.v1.train.create_global_step()
    x, y = _data(8)
    return replicate.replicate_model_fn(
        model_fn, devices=harness.devices(harness.VIRTUAL_CPUS, num_towers))({
            "x": tf.constant(x.reshape(8, 8))
        }, tf.constant(y), mode, {})


def test_a_per_batch_value_in_eval_metrics_is_one_devices():
  # A value of the whole batch (its maximum) handed to metric_fn is one
  # device's: a batch reduction has the whole batch's value in every tower.
  def eval_metrics(logits, labels):
    del labels
    return (lambda top: {
        "top": tf.compat.v1.metrics.mean(top)
    }, [tf.reshape(tf.reduce_max(logits), [1])])

  values = []
  for towers in (1, 2, 4):
    with tf.Graph().as_default() as graph:
      spec = _build(ModeKeys.EVAL, eval_metrics, towers, graph)
      value, update = spec.eval_metric_ops["top"]
      with tf.compat.v1.Session(config=harness.session_config()) as session:
        session.run([
            tf.compat.v1.global_variables_initializer(),
            tf.compat.v1.local_variables_initializer()
        ])
        harness.set_trainable_weights(session)
        session.run(update)
        values.append(session.run(value))
  np.testing.assert_allclose(values[1:], [values[0]] * 2, rtol=1e-6)


def test_towers_with_different_eval_metrics_are_refused():

  def eval_metrics(logits, labels):
    keys = ["a", "b"] if replicate.current_tower().index == 0 else ["a"]
    return (lambda **t: {
        k: tf.compat.v1.metrics.mean(v) for k, v in t.items()
    }, {
        k: tf.cast(labels, tf.float32) for k in keys
    })

  with pytest.raises(
      ValueError,
      match=r"Tower 1 returned eval_metrics "
      r"\['a'\] but tower 0 returned \['a', 'b'\]"):
    _build(ModeKeys.EVAL, eval_metrics)


@pytest.mark.parametrize("kind", KINDS)
def test_export_serves_one_devices_predictions(run, kind, tmp_path):
  expected, actual = run(kind, 0), run(kind, 4)
  receiver = tf.estimator.export.build_raw_serving_input_receiver_fn(
      {"x": tf.zeros([1, 2, 4])})
  export_dir = actual.estimator.export_saved_model(str(tmp_path), receiver)
  serve = tf.saved_model.load(export_dir).signatures["serving_default"]
  x, _ = _data()
  served = serve(x=tf.constant(x[:len(expected.predictions)]))
  served = served["probabilities"]
  np.testing.assert_allclose(
      served.numpy(), [p["probabilities"] for p in expected.predictions],
      rtol=1e-5,
      atol=1e-6)  # other batch sizes: other summation orders
