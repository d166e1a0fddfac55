"""replicate.testing.replicated: a canned constructor built replicated.

Trained with its optimizers wrapped (a name or the default resolved as the
canned estimator resolves it), the replicated canned estimator ends where
the plain one does from the same checkpoint: same optimizer slots, same
learning rate. The Estimator it returns keeps the canned one's model_dir,
config (plus N CPUs), warm start and API version.
"""

import inspect
import os

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate import testing
from tests import harness

_V1 = tf.compat.v1.estimator
_V2 = tf.estimator
_STEPS = 2
_ROWS = 6  # uneven on 4 towers


def _columns():
  return [
      tf.feature_column.numeric_column("x", shape=(2,)),
      tf.feature_column.numeric_column("z")
  ]


def _input_fn():
  rng = np.random.RandomState(0)
  x = rng.randn(_ROWS, 2).astype(np.float32)
  z = rng.randn(_ROWS, 1).astype(np.float32)
  labels = (x[:, :1] + z > 0).astype(np.int64)
  return {"x": x, "z": z}, labels


def _arguments(cls):
  """Arguments building `cls` on both columns with its default optimizers."""
  name = cls.__name__
  if "Combined" in name:
    return dict(
        linear_feature_columns=_columns()[1:],
        dnn_feature_columns=_columns()[:1],
        dnn_hidden_units=[3])
  if "DNN" in name:
    return dict(hidden_units=[3], feature_columns=_columns())
  return dict(feature_columns=_columns())


def _variables(model_dir):
  reader = tf.train.load_checkpoint(model_dir)
  return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()}


def _config(model_dir):
  return tf.estimator.RunConfig(
      model_dir=model_dir,
      tf_random_seed=1,
      save_summary_steps=None,
      log_step_count_steps=None)


# Each estimator on one tower count (2 or 4, both for each API version and
# each kind of model), to keep the file fast; 6 rows split 2+2+1+1 on 4.
# The default run keeps the DNNs of both versions (their default learning
# rates differ) and v2's linear and combined models (v1's have the same
# rates, their optimizers built as v1's DNN's).
@pytest.mark.parametrize(
    "cls, num_towers", [
        (_V2.DNNClassifier, 2),
        (_V2.LinearRegressor, 4),
        (_V2.DNNLinearCombinedClassifier, 2),
        (_V1.DNNRegressor, 4),
        harness.wide(_V1.LinearClassifier, 2),
        harness.wide(_V1.DNNLinearCombinedRegressor, 4),
    ],
    ids=lambda p: (f"{p.__module__.rsplit('.', 1)[-1]}.{p.__name__}"
                   if isinstance(p, type) else f"{p}towers"))
def test_default_optimizers_train_as_the_canned_estimator(
    cls, num_towers, tmp_path):
  plain_dir, towers_dir = str(tmp_path / "plain"), str(tmp_path / "towers")
  cls(config=_config(plain_dir), **_arguments(cls)).train(
      _input_fn, steps=_STEPS)
  # Start the towers from the plain run's initial checkpoint.
  tf.io.gfile.makedirs(towers_dir)
  for path in tf.io.gfile.glob(os.path.join(plain_dir, "model.ckpt-0.*")):
    tf.io.gfile.copy(path, os.path.join(towers_dir, os.path.basename(path)))
  tf.compat.v1.train.update_checkpoint_state(
      towers_dir, os.path.join(towers_dir, "model.ckpt-0"))

  make = testing.replicated(cls, num_towers=num_towers)
  make(
      config=_config(towers_dir), **_arguments(cls)).train(
          _input_fn, steps=_STEPS)

  expected, actual = _variables(plain_dir), _variables(towers_dir)
  # Slot names tell the optimizer class; values its learning rate.
  assert sorted(actual) == sorted(expected)
  for name, value in expected.items():
    # float32 sums over towers in another order.
    np.testing.assert_allclose(
        actual[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_an_optimizer_given_is_wrapped_as_it_is(tmp_path):
  given = tf.keras.optimizers.legacy.SGD(0.5)
  made = []
  make = testing.replicated(
      lambda **kw: made.append(kw) or _V2.LinearRegressor(**kw),
      wrap_optimizers=True)
  make(feature_columns=_columns(), optimizer=given, model_dir=str(tmp_path))
  wrapped = made[0]["optimizer"]
  assert isinstance(wrapped, tf.keras.optimizers.legacy.Optimizer)
  assert wrapped is not given and wrapped.optimizer is given


@pytest.mark.parametrize("wrap_optimizers", [True, False])
def test_only_the_model_fn_is_wrapped_when_asked(wrap_optimizers, tmp_path):
  made = []
  make = testing.replicated(
      lambda optimizer="Ftrl", **kw: made.append(optimizer) or _V2.
      LinearRegressor(optimizer=optimizer, **kw),
      wrap_optimizers=wrap_optimizers)
  make(feature_columns=_columns(), model_dir=str(tmp_path))
  assert isinstance(made[0], replicate.TowerOptimizer) == wrap_optimizers
  assert wrap_optimizers or made[0] == "Ftrl"


@pytest.mark.parametrize("cls, estimator_class", [
    (_V2.DNNRegressor, tf.estimator.Estimator),
    (_V1.DNNRegressor, tf.compat.v1.estimator.Estimator),
])
def test_keeps_the_canned_estimators_settings(cls, estimator_class, tmp_path):
  user_session = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=3)
  config = tf.estimator.RunConfig(tf_random_seed=7, session_config=user_session)
  warm = tf.estimator.WarmStartSettings(str(tmp_path / "old"), "dnn/.*")
  make = testing.replicated(cls, num_towers=4)
  assert inspect.signature(make) == inspect.signature(cls)

  est = make(
      hidden_units=[2],
      feature_columns=_columns(),
      model_dir=str(tmp_path / "new"),
      config=config,
      warm_start_from=warm)

  assert type(est) is estimator_class  # pylint: disable=unidiomatic-typecheck
  assert est.model_dir == str(tmp_path / "new")
  assert est.config.tf_random_seed == 7
  assert est.config.session_config.device_count["CPU"] == 4
  assert est.config.session_config.inter_op_parallelism_threads == 3
  settings = est._warm_start_settings  # pylint: disable=protected-access
  assert settings.ckpt_to_initialize_from == warm.ckpt_to_initialize_from
  assert est._warm_start_settings.vars_to_warm_start == "dnn/.*"  # pylint: disable=protected-access
  assert user_session.device_count.get("CPU") is None  # not modified


def test_refuses_what_it_cannot_build():
  with pytest.raises(ValueError, match="at least 1"):
    testing.replicated(_V2.DNNRegressor, num_towers=0)
  with pytest.raises(TypeError, match="not an Estimator"):
    testing.replicated(lambda: "a model", num_towers=2)()
