"""replicate.testing: the checker passes model_fns that replicate and catches
ones that do not, with a report naming the first difference.

Each check trains, evaluates and predicts with one device and with towers,
so the tests keep models tiny and ask only for the modes they need.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate import testing

R = tf.compat.v1.losses.Reduction
_ROOT = pathlib.Path(__file__).resolve().parent.parent
_NUM_FEATURES = 4
_WORDS = ["red", "green", "blue", "cyan"]


def _data(num_examples, seed=0):
  """Dense 'x', sparse bag of word ids 'ids' (0-2 ids a row), labels 0..1."""
  rng = np.random.RandomState(seed)
  x = rng.randn(num_examples, _NUM_FEATURES).astype(np.float32)
  rows, cols, values = [], [], []
  for row in range(num_examples):
    for col in range(row % 3):
      rows.append(row)
      cols.append(col)
      values.append(rng.randint(len(_WORDS)))
  ids = tf.compat.v1.SparseTensorValue(
      np.array([rows, cols], np.int64).T.reshape(-1, 2),
      np.array(values, np.int64), np.array([num_examples, 2], np.int64))
  labels = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
  return x, ids, labels


def _input_fn(num_examples=40, batch=10, epochs=None, with_ids=True):
  """Dict features (dense and sparse) in order; `epochs` None repeats."""
  x, ids, labels = _data(num_examples)

  def input_fn():
    features = {"x": x}
    if with_ids:
      features["ids"] = tf.SparseTensor(*ids)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    return dataset.repeat(epochs).batch(batch)

  return input_fn


def _logits(features):
  h = tf.keras.layers.Dense(4, activation="tanh")(features["x"])
  if "ids" in features:
    embeddings = tf.compat.v1.get_variable(
        "embeddings", [len(_WORDS), 4],
        initializer=tf.compat.v1.glorot_uniform_initializer())
    h += tf.nn.safe_embedding_lookup_sparse(
        embeddings, features["ids"], combiner="mean")
  return tf.keras.layers.Dense(2)(h)


def _model_fn(mistake=None):
  """A classifier; `mistake` makes it replicate wrongly in one way.

  'sum_loss': the loss is summed while loss_reduction says it averages
    (replicates: the sum is the whole batch's).
  'first_replica': a variable declared ONLY_FIRST_REPLICA is written with
    the batch's mean (replicates: the mean is the whole batch's).
  'tower_predictions': predictions depend on the tower's index.
  'tower_scale': the logits, and so the loss, depend on the tower's index.
  """

  def model_fn(features, labels, mode):
    logits = _logits(features)
    tower = replicate.current_tower()
    if mistake == "tower_predictions" and tower is not None:
      logits += tf.cast(tower.index, tf.float32)
    if mistake == "tower_scale" and tower is not None:
      logits *= 1.0 + tf.cast(tower.index, tf.float32)
    classes = tf.argmax(logits, axis=1)
    if mode == tf.estimator.ModeKeys.PREDICT:
      return tf.estimator.EstimatorSpec(
          mode, predictions={
              "logits": logits,
              "classes": classes
          })
    reduction = R.SUM if mistake == "sum_loss" else R.SUM_BY_NONZERO_WEIGHTS
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
        labels, logits, reduction=reduction)
    if mode == tf.estimator.ModeKeys.EVAL:
      metrics = {
          "accuracy": tf.compat.v1.metrics.accuracy(labels, classes),
          "auc": tf.compat.v1.metrics.auc(labels,
                                          tf.nn.softmax(logits)[:, 1])
      }
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, eval_metric_ops=metrics)
    optimizer = replicate.TowerOptimizer(
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    if mistake == "first_replica":
      mean = tf.compat.v1.get_variable(
          "batch_mean", [],
          initializer=tf.zeros_initializer(),
          trainable=False,
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      train_op = tf.group(train_op, mean.assign(tf.reduce_mean(features["x"])))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def test_own_model_fn_with_dict_sparse_and_uneven_batches_replicates():
  # Batches of 10 on 3 towers are uneven (4, 3, 3); 25 eval examples end
  # with a batch of 5 (2, 2, 1).
  summary = testing.assert_replicates(
      _model_fn(),
      _input_fn(batch=10),
      towers=(3,),
      steps=3,
      eval_input_fn=_input_fn(25, epochs=1),
      eval_steps=None)
  assert summary.towers == [3]
  # Two Dense layers, embeddings: 5 weights, their momentum slots, the step.
  assert summary.variables == 11
  assert summary.metrics == ["accuracy", "auc", "global_step", "loss"]
  assert summary.predictions == 25
  assert 0 <= summary.closest_to_tolerance < 1


def test_tower_dependent_loss_is_reported():
  with pytest.raises(testing.ReplicationMismatch) as caught:
    testing.assert_replicates(
        _model_fn("tower_scale"), _input_fn(), towers=(2,), modes=("train",))
  report = str(caught.value)
  assert "The model_fn does not replicate" in report
  assert ("2 towers ['/device:CPU:0', '/device:CPU:1'], train: loss at step "
          "1 is ") in report
  assert " on 2 towers, " in report and " on 1 device (|difference| " in report
  assert "> atol 1e-06 + rtol 1e-05 × " in report
  assert "replicate.current_tower()" in report


@pytest.mark.parametrize("mistake", ["sum_loss", "first_replica"])
def test_batch_values_replicate_whatever_the_declarations(mistake):
  # A summed loss under an averaging loss_reduction, a batch mean in a
  # variable declared ONLY_FIRST_REPLICA: both are whole-batch reductions,
  # one device's in every tower, whatever is declared.
  testing.assert_replicates(
      _model_fn(mistake), _input_fn(), towers=(2, 4), modes=("train",))


def test_tower_dependent_predictions_are_reported():
  with pytest.raises(testing.ReplicationMismatch) as caught:
    testing.assert_replicates(
        _model_fn("tower_predictions"),
        _input_fn(),
        towers=(2,),
        predict_input_fn=_input_fn(8, batch=8, epochs=1),
        modes=("predict",))
  report = str(caught.value)
  # Batch of 8 on 2 towers: examples 4..7 are tower 1's, logits one larger.
  assert "predict: prediction 4['logits'][0] is " in report
  assert "(|difference| 1 > atol" in report
  assert "In all 4 differ: prediction 4, prediction 5, prediction 6, " \
      "prediction 7." in report


def _batch_norm_model_fn(features, labels, mode):
  training = mode == tf.estimator.ModeKeys.TRAIN
  h = tf.compat.v1.layers.dense(features["x"], 4)
  h = tf.compat.v1.layers.batch_normalization(h, training=training)
  logits = tf.compat.v1.layers.dense(h, 2)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1))
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_batch_norm_replicates_in_every_mode():
  summary = testing.assert_replicates(
      _batch_norm_model_fn,
      _input_fn(with_ids=False),
      towers=(2,),
      steps=2,
      predict_input_fn=_input_fn(8, batch=8, epochs=1, with_ids=False))
  assert summary.metrics == ["global_step", "loss"]
  assert summary.predictions == 8


def _masked_mean_model_fn(features, labels, mode, params):
  """A hand-written masked mean; params['batch_sum'] divides by the batch's."""
  logits = tf.compat.v1.layers.dense(features["x"], 2)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  mask = tf.cast(features["x"][:, 0] > 0.3, tf.float32)
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits)
  count = tf.reduce_sum(mask)
  if params["batch_sum"]:
    count = replicate.batch_sum(count)
  loss = tf.reduce_sum(xent * mask) / tf.maximum(count, 1.0)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def test_a_masked_mean_replicates_with_or_without_batch_sum():
  # Its denominator, a sum over the batch, is the whole batch's either way.
  input_fn = _input_fn(with_ids=False)
  for batch_sum in (False, True):
    testing.assert_replicates(
        _masked_mean_model_fn,
        input_fn,
        towers=(2, 4),
        steps=2,
        modes=("train",),
        params={"batch_sum": batch_sum})


def test_tolerances_are_the_callers():
  testing.assert_replicates(
      _model_fn("tower_scale"),
      _input_fn(),
      towers=(2,),
      modes=("train",),
      atol=10.0)


_ADAGRAD = tf.keras.optimizers.legacy.Adagrad

_NUMERIC = tf.feature_column.numeric_column("x", shape=(_NUM_FEATURES,))


def test_v2_canned_estimator_replicates(tmp_path):
  # 3 classes: the multi-class head's metrics build much faster than the
  # binary head's (AUCs, precision, recall) and check the same merging.
  words = tf.feature_column.categorical_column_with_identity("ids", len(_WORDS))
  canned = tf.estimator.DNNLinearCombinedClassifier(
      linear_feature_columns=[_NUMERIC, words],
      dnn_feature_columns=[
          _NUMERIC, tf.feature_column.embedding_column(words, 3)
      ],
      dnn_hidden_units=[4],
      n_classes=3,
      linear_optimizer=replicate.TowerOptimizer(lambda: _ADAGRAD(0.1)),
      dnn_optimizer=replicate.TowerOptimizer(lambda: _ADAGRAD(0.05)),
      model_dir=str(tmp_path))
  summary = testing.assert_replicates(
      canned,
      _input_fn(),
      towers=(2,),
      eval_input_fn=_input_fn(25, epochs=1),
      modes=("train", "eval"))
  assert summary.metrics == ["accuracy", "average_loss", "global_step", "loss"]
  assert summary.variables > 10


def test_v2_canned_estimator_with_an_optimizer_instance_is_explained(tmp_path):
  canned = tf.estimator.LinearClassifier([_NUMERIC],
                                         n_classes=3,
                                         optimizer=replicate.TowerOptimizer(
                                             _ADAGRAD(0.1)),
                                         model_dir=str(tmp_path))
  with pytest.raises(
      ValueError,
      match="a canned estimator's optimizer must "
      "be a function for assert_replicates"):
    testing.assert_replicates(
        canned.model_fn, _input_fn(), towers=(2,), modes=("train",))


def test_v1_canned_estimator_replicates(tmp_path):
  canned = tf.compat.v1.estimator.DNNClassifier(
      hidden_units=[4],
      n_classes=3,  # the multi-class head builds faster
      feature_columns=[_NUMERIC],
      optimizer=replicate.TowerOptimizer(
          tf.compat.v1.train.AdagradOptimizer(0.1)),
      model_dir=str(tmp_path))
  testing.assert_replicates(
      canned.model_fn,
      _input_fn(with_ids=False),
      towers=(2,),
      modes=("train", "eval"))


def test_session_config_merges_the_callers():
  base = tf.compat.v1.ConfigProto(
      inter_op_parallelism_threads=3, device_count={"GPU": 0})
  config = testing.session_config(4, base)
  assert dict(config.device_count) == {"CPU": 4, "GPU": 0}
  assert config.inter_op_parallelism_threads == 3
  assert not config.allow_soft_placement  # the caller's choice is kept
  assert dict(base.device_count) == {"GPU": 0}  # the caller's is not changed
  assert testing.session_config(2).allow_soft_placement  # Estimator's default
  with pytest.raises(
      ValueError,
      match=r"base sets device_count=\{'CPU': 2\} "
      "but 4 CPU devices are needed"):
    testing.session_config(4, tf.compat.v1.ConfigProto(device_count={"CPU": 2}))


def _fake_gpus(monkeypatch, visible, splits):
  """Three physical GPUs as tf.config would list them, `visible` of them
  visible and `splits` their logical configurations."""
  gpus = [
      tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU")
      for i in range(3)
  ]
  monkeypatch.setattr(
      tf.config,
      "list_physical_devices",
      lambda kind=None: gpus if kind == "GPU" else [])
  monkeypatch.setattr(
      tf.config,
      "get_visible_devices",
      lambda kind=None: [gpus[i] for i in visible])
  monkeypatch.setattr(tf.config, "get_logical_device_configuration",
                      lambda gpu: splits.get(int(gpu.name[-1])))


def test_session_config_keeps_a_logical_gpu_split(monkeypatch):
  # GPU 0 hidden, GPU 1 split in two (priorities given), GPU 2 whole: the
  # session's GPU options say what TensorFlow's eager context says.
  logical = tf.config.LogicalDeviceConfiguration
  _fake_gpus(
      monkeypatch,
      visible=[1, 2],
      splits={
          1: [
              logical(1024, experimental_priority=0),
              logical(2048, experimental_priority=-1)
          ]
      })
  gpu_options = testing.session_config(4).gpu_options
  assert gpu_options.visible_device_list == "1,2"
  assert [(list(d.memory_limit_mb), list(d.priority), list(d.device_ordinal))
          for d in gpu_options.experimental.virtual_devices] == [([1024, 2048],
                                                                  [0, -1], []),
                                                                 ([], [], [])]
  assert testing.run_config(2).session_config.gpu_options == gpu_options
  # The caller's own GPU choice is kept as it is.
  base = tf.compat.v1.ConfigProto()
  base.gpu_options.visible_device_list = "2"
  assert testing.session_config(4, base).gpu_options == base.gpu_options
  # Nor is it added to a session without GPUs.
  hidden = testing.session_config(
      4, tf.compat.v1.ConfigProto(device_count={"GPU": 0}))
  assert not hidden.gpu_options.experimental.virtual_devices


def test_session_config_leaves_unsplit_gpus_alone(monkeypatch):
  _fake_gpus(monkeypatch, visible=[0, 1, 2], splits={})
  assert testing.session_config(4).gpu_options == (
      tf.compat.v1.ConfigProto().gpu_options)


def test_run_config_takes_run_config_arguments():
  config = testing.run_config(
      3,
      tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1),
      model_dir="/tmp/unused",
      tf_random_seed=5,
      save_summary_steps=7)
  assert config.tf_random_seed == 5 and config.save_summary_steps == 7
  assert config.session_config.device_count["CPU"] == 3
  assert config.session_config.intra_op_parallelism_threads == 1


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="pass a number of devices of at least"):
    testing.assert_replicates(_model_fn(), _input_fn(), towers=(0,))
  with pytest.raises(ValueError, match=r"modes=\['fit'\]: pass one or more"):
    testing.assert_replicates(_model_fn(), _input_fn(), modes=("fit",))
  with pytest.raises(TypeError, match="devices='2' is of type str"):
    testing.assert_replicates(_model_fn(), _input_fn(), towers=("2",))
  with pytest.raises(TypeError, match="model_fn=3 is neither a model_fn"):
    testing.assert_replicates(3, _input_fn())
  with pytest.raises(TypeError, match="2.0 devices is of type float"):
    testing.run_config(2.0)


_VIRTUAL_CPUS_SCRIPT = """
import tensorflow as tf
from replicate import testing
first = testing.virtual_cpus(3)
again = testing.virtual_cpus(3)
names = [d.name for d in tf.config.list_logical_devices("CPU")]
print(first == again == names, names)
print(testing.virtual_cpus(3) == names)  # also once devices are initialised
try:
  testing.virtual_cpus(2)
except RuntimeError as e:
  print("RuntimeError:", e)
"""


def test_virtual_cpus_is_idempotent_and_names_the_fix():
  # A fresh process: this one's devices may be initialised already.
  env = dict(os.environ, PYTHONPATH=str(_ROOT), TF_CPP_MIN_LOG_LEVEL="2")
  result = subprocess.run([sys.executable, "-c", _VIRTUAL_CPUS_SCRIPT],
                          cwd=_ROOT,
                          env=env,
                          capture_output=True,
                          text=True,
                          timeout=120)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert lines[0] == ("True ['/device:CPU:0', '/device:CPU:1', "
                      "'/device:CPU:2']")
  assert lines[1] == "True"
  assert lines[2].startswith(
      "RuntimeError: virtual_cpus(2): TensorFlow's devices are already "
      "initialised with 3 CPU device(s)")
  assert "call replicate.testing.virtual_cpus(2) before anything" in lines[2]
