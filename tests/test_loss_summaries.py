"""Summaries of the loss are the whole batch's, as on one device.

Canned heads write their own `loss` summary (v1 heads also
`average_loss`), and so does a user's `tf.compat.v1.summary.scalar('loss',
loss)`; replicated, TensorBoard must show the whole batch's value, not tower
0's share. Each estimator trains a few steps with a summary every step on
an uneven static batch (5 rows over 2 and 4 towers); every scalar tag
written per step is compared with one device's, and so is what evaluate
gives (a dynamic eval set). A summary of something else stays
tower 0's (documented).
"""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

STEPS, BATCH = 3, 5
COLUMNS = [tf.feature_column.numeric_column("x", shape=(2,))]
SGD = tf.keras.optimizers.legacy.SGD


def _data():
  rng = np.random.RandomState(3)
  x = rng.randn(BATCH, 2).astype(np.float32)
  # Per-row losses far apart, so a shard's loss is far from the batch's.
  y = np.array([[0.], [4.], [-1.], [9.], [2.]], np.float32)
  return {"x": x}, y


def _input_fn(classes=False):
  features, labels = _data()
  if classes:
    labels = (labels > 1.5).astype(np.int64)
  # A static batch: shapes fold into constants (the dynamic eval set below
  # checks the other way).
  return lambda: tf.data.Dataset.from_tensor_slices(
      (features, labels)).repeat().batch(
          BATCH, drop_remainder=True)


def _config(model_dir, num_towers):
  return tf.estimator.RunConfig(
      model_dir=str(model_dir),
      tf_random_seed=11,
      save_summary_steps=1,
      save_checkpoints_steps=1000,
      log_step_count_steps=1000,
      session_config=replicate.testing.session_config(max(num_towers, 1)))


def _custom_model_fn(features, labels, mode):
  predictions = tf.compat.v1.layers.dense(
      features["x"], 1, kernel_initializer=tf.constant_initializer([0.5, -1.]))
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  tf.compat.v1.summary.scalar("loss", loss)
  # Not a summary of the loss: stays tower 0's.
  tf.compat.v1.summary.scalar("largest_x", tf.reduce_max(features["x"]))
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.05))
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


CASES = {
    "v2_linear_regressor": (lambda config: tf.estimator.LinearRegressor(
        COLUMNS, optimizer=replicate.TowerOptimizer(SGD(0.05)), config=config),
                            False),
    "v2_dnn_classifier": (lambda config: tf.estimator.DNNClassifier(
        [4],
        COLUMNS,
        optimizer=replicate.TowerOptimizer(SGD(0.05)),
        config=config), True),
    "v2_baseline_sum": (lambda config: tf.estimator.BaselineClassifier(
        optimizer=replicate.TowerOptimizer(SGD(0.05)),
        loss_reduction=tf.keras.losses.Reduction.SUM,
        config=config), True),
    "v1_linear_regressor":
        (lambda config: (tf.compat.v1.estimator.LinearRegressor(
            COLUMNS,
            optimizer=replicate.TowerOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.05)),
            config=config)), False),
    "custom":
        (lambda config: tf.estimator.Estimator(_custom_model_fn, config=config),
         False),
}

# Summaries of other tensors than per-batch scalars stay tower 0's: the
# custom model_fn's, and the DNN's activation summaries (tf.nn.zero_fraction
# of tower 0's activations).
TOWER_0_TAGS = frozenset([
    "largest_x", "dnn/hiddenlayer_0/fraction_of_zero_values",
    "dnn/logits/fraction_of_zero_values"
])

# The linear models' summaries of their variables read them in a race with
# the step's update, on one device too: not comparable step by step.
RACING_TAGS = frozenset([
    "bias", "fraction_of_zero_weights", "linear/bias",
    "linear/fraction_of_zero_weights"
])


def _scalars(model_dir):
  """{tag: [value per step]} of every scalar summary train wrote."""
  values = {}
  for path in glob.glob(os.path.join(model_dir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.HasField("simple_value"):
          values.setdefault(value.tag, {})[event.step] = value.simple_value
  return {
      tag: [steps[s] for s in sorted(steps)] for tag, steps in values.items()
  }


def _eval_input_fn(classes):
  """The 5 rows once, in batches of 3 and 2 (phantom rows on 4 towers)."""
  features, labels = _data()
  if classes:
    labels = (labels > 1.5).astype(np.int64)
  return lambda: tf.data.Dataset.from_tensor_slices((features, labels)).batch(3)


def _train(case, num_towers, model_dir, with_eval=False):
  """The scalar summaries train wrote; with_eval: and what evaluate gives."""
  build, classes = CASES[case]
  estimator = build(_config(model_dir, num_towers))
  if num_towers:
    estimator = tf.estimator.Estimator(
        replicate.replicate_model_fn(
            estimator.model_fn,
            devices=[f"/device:CPU:{i}" for i in range(num_towers)]),
        config=_config(model_dir, num_towers))
  estimator.train(_input_fn(classes), steps=STEPS)
  summaries = _scalars(model_dir)
  if not with_eval:
    return summaries
  return summaries, estimator.evaluate(_eval_input_fn(classes))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  return {
      case: _train(case, 0, tmp_path_factory.mktemp(case), True)
      for case in CASES
  }


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
  """(case, towers) -> _train's result, each trained once for the module."""
  runs = {}

  def run(case, num_towers):
    if (case, num_towers) not in runs:
      runs[case, num_towers] = _train(case, num_towers,
                                      tmp_path_factory.mktemp(case), True)
    return runs[case, num_towers]

  return run


# Every case on 4 towers (phantom rows in evaluation); on 2 as well the
# custom model_fn, the v1 head and the summing v2 head. The default run
# takes each case once: the v1 head and the summing v2 head on 2 towers,
# the others on 4.
_ON_2 = ("v1_linear_regressor", "v2_baseline_sum")


@pytest.mark.parametrize(
    "case,num_towers", [(c, 2 if c in _ON_2 else 4) for c in sorted(CASES)] +
    [harness.wide(c, 4) for c in sorted(CASES) if c in _ON_2] +
    [harness.wide("custom", 2)])
def test_loss_summaries_are_one_devices(one_device, replicated, case,
                                        num_towers):
  expected, expected_eval = one_device[case]
  actual, actual_eval = replicated(case, num_towers)
  # What evaluate writes (the Estimator's `loss`, the heads' `average_loss`
  # and other metrics) is one device's too.
  assert set(actual_eval) == set(expected_eval)
  for key in expected_eval:
    np.testing.assert_allclose(
        actual_eval[key], expected_eval[key], rtol=1e-5, atol=1e-6, err_msg=key)
  loss_tags = {t for t in expected if t.startswith(("loss", "average_loss"))}
  assert loss_tags, expected
  assert set(actual) == set(expected)
  for tag in expected:
    if tag in TOWER_0_TAGS or tag in RACING_TAGS:
      continue
    np.testing.assert_allclose(
        actual[tag], expected[tag], rtol=1e-5, atol=1e-6, err_msg=tag)


@pytest.mark.parametrize("num_towers", [harness.wide(2), 4])
def test_other_summaries_stay_tower_0s(one_device, replicated, num_towers):
  x = _data()[0]["x"]
  shard = -(-BATCH // num_towers)  # tower 0 holds the larger shards
  actual = replicated("custom", num_towers)[0]["largest_x"]
  np.testing.assert_allclose(actual, [x[:shard].max()] * STEPS)
  assert one_device["custom"][0]["largest_x"] == [x.max()] * STEPS
