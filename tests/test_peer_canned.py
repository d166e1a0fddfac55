"""tensorflow_estimator's own canned-estimator tests, run replicated.

tensorflow_estimator ships the bases its authors test the canned estimators
with (hand-computed losses, metrics, predictions, checkpoints, warm starts);
each takes estimator constructors. As in its own test files, every base
becomes a `tf.test.TestCase`, here with constructors from
`replicate.testing.replicated`: DNN, linear and DNNLinearCombined (DNN-only
and linear-only) classifiers and regressors, v1 and v2, on 2 and 4 towers,
in two forms: 'wrapped' (optimizers in TowerOptimizer, as README says) and
'model_fn' (only the model_fn wrapped). 'plain' runs the same bases on the
unwrapped canned estimators, the reference they all pass on.

Every class is marked `peer`. `pytest -m peer` (or REPLICATE_PEER_SUITE=full)
runs all of them; otherwise, on 2 towers, the first test of every base (in
one form, the bases taking turns) and `_DEFAULT_SAMPLE` (in both forms) run
and the rest are skipped, to keep the default suite's time.

A v1 test that hands the estimator a mock optimizer (a `NonCallableMock`
whose `minimize` the test asserts is called once) cannot be routed when only
the model_fn is wrapped: there it must fail with a ValueError naming
`TowerOptimizer`, and with nothing else.
"""

import functools
import itertools
import os
from unittest import mock

import pytest
import tensorflow as tf

# The bases take the feature-column module itself, as in their own tests.
from tensorflow.python.feature_column import feature_column_v2
from tensorflow_estimator.python.estimator.canned import dnn_testing_utils
from tensorflow_estimator.python.estimator.canned import linear_testing_utils
from tensorflow_estimator.python.estimator.canned.v1 import dnn_testing_utils_v1

from tensorflow_estimator.python.estimator.canned.v1 import linear_testing_utils_v1  # noqa: E501  # isort: skip

from replicate import testing

pytestmark = pytest.mark.peer

_TOWERS = (2, 4)
_FORMS = {"wrapped": "Wrapped", "model_fn": "ModelFn"}
_API = {"V1": tf.compat.v1.estimator, "V2": tf.estimator}
_BASES = {
    ("V1", "DNN"): dnn_testing_utils_v1,
    ("V2", "DNN"): dnn_testing_utils,
    ("V1", "Linear"): linear_testing_utils_v1,
    ("V2", "Linear"): linear_testing_utils,
}
# Base name -> the constructors its __init__ takes, in order.
_DNN_BASES = {
    "BaseDNNClassifierTrainTest": ("Classifier",),
    "BaseDNNClassifierEvaluateTest": ("Classifier",),
    "BaseDNNClassifierPredictTest": ("Classifier",),
    "BaseDNNRegressorTrainTest": ("Regressor",),
    "BaseDNNRegressorEvaluateTest": ("Regressor",),
    "BaseDNNRegressorPredictTest": ("Regressor",),
}
_LINEAR_BASES = {
    "BaseLinearClassifierTrainingTest": ("Classifier",),
    "BaseLinearClassifierEvaluationTest": ("Classifier",),
    "BaseLinearClassifierPredictTest": ("Classifier",),
    "BaseLinearRegressorTrainingTest": ("Regressor",),
    "BaseLinearRegressorEvaluationTest": ("Regressor",),
    "BaseLinearRegressorPredictTest": ("Regressor",),
}
_LINEAR_INTEGRATION = {
    "BaseLinearClassifierIntegrationTest": ("Classifier",),
    "BaseLinearRegressorIntegrationTest": ("Regressor",),
}
_WARM_START = ("Classifier", "Regressor")
# Model: (which bases, the canned class family, argument renames that make a
# DNNLinearCombined estimator with one part look like a DNN or linear one).
_MODELS = {
    "DNN": ("DNN", dict(_DNN_BASES,
                        BaseDNNWarmStartingTest=_WARM_START), "DNN", {}),
    "Linear": ("Linear",
               dict(
                   _LINEAR_BASES,
                   **_LINEAR_INTEGRATION,
                   BaseLinearWarmStartingTest=_WARM_START), "Linear", {}),
    "DNNOnlyCombined": ("DNN", _DNN_BASES, "DNNLinearCombined", {
        "hidden_units": "dnn_hidden_units",
        "feature_columns": "dnn_feature_columns",
        "optimizer": "dnn_optimizer",
        "activation_fn": "dnn_activation_fn",
        "dropout": "dnn_dropout",
    }),
    "LinearOnlyCombined": ("Linear", dict(_LINEAR_BASES, **_LINEAR_INTEGRATION),
                           "DNNLinearCombined", {
                               "feature_columns": "linear_feature_columns",
                               "optimizer": "linear_optimizer",
                               "sparse_combiner": "linear_sparse_combiner",
                           }),
}
# What the default run (no `-m peer`) keeps, on 2 towers in both forms,
# besides the first test of every base in one form and one API version,
# both taking turns (about 45 tests in all with `_PARSED_SAMPLE`):
# training with a mock optimizer (Keras `get_updates` in v2; in v1 one that
# cannot be routed), training with the default optimizer name, evaluation,
# and prediction of a DNNLinearCombined estimator.
_DEFAULT_SAMPLE = {
    ("DNN", "BaseDNNClassifierTrainTest", "test_binary_classification"),
    ("Linear", "BaseLinearRegressorTrainingTest",
     "testFromScratchWithDefaultOptimizer"),
    ("Linear", "BaseLinearRegressorEvaluationTest",
     "test_evaluation_for_simple_data"),
    ("DNNOnlyCombined", "BaseDNNRegressorPredictTest", "test_one_dim"),
}
# Kept in one form (the bases' turn): features and labels parsed from
# tf.train.Example records, of unknown ranks.
_PARSED_SAMPLE = {(model, base, "test_input_fn_from_parse_example")
                  for model in ("Linear", "LinearOnlyCombined")
                  for base in _LINEAR_INTEGRATION}
_FULL_ENV = "REPLICATE_PEER_SUITE"


def _unroutable(value) -> bool:
  """A v1 optimizer mock: its own `minimize` is an attribute of the mock."""
  return (isinstance(value, mock.NonCallableMock) and
          isinstance(value, tf.compat.v1.train.Optimizer))


def _constructor(test, version, model, role, form, towers):
  """The estimator constructor `test`'s base is handed for `role`."""
  _, _, family, renames = _MODELS[model]
  canned = getattr(_API[version], family + role)
  if form != "plain":
    canned = testing.replicated(
        canned, num_towers=towers, wrap_optimizers=form == "wrapped")

  def build(**kwargs):
    if form == "model_fn" and any(map(_unroutable, kwargs.values())):
      test.unroutable_optimizer_given = True
    return canned(**{renames.get(k, k): v for k, v in kwargs.items()})

  return build


def _refused_only_by_name(method):
  """Passes a test with an unroutable mock only on the TowerOptimizer error."""

  @functools.wraps(method)
  def run(self):
    try:
      method(self)
    except ValueError as e:
      if not (self.unroutable_optimizer_given and "TowerOptimizer" in str(e)):
        raise
      return
    if self.unroutable_optimizer_given:
      self.fail("The mock optimizer's own `minimize` is not routed with only "
                "the model_fn wrapped, yet no ValueError naming "
                "TowerOptimizer was raised.")

  return run


def _test_case(version,
               model,
               base_name,
               form,
               towers,
               sampled_form=None,
               first_sampled=False):
  bases_kind, roles_by_base, _, _ = _MODELS[model]
  base = getattr(_BASES[(version, bases_kind)], base_name)
  roles = roles_by_base[base_name]

  def __init__(self, methodName="runTest"):  # pylint: disable=invalid-name
    tf.test.TestCase.__init__(self, methodName)
    self.unroutable_optimizer_given = False
    constructors = [
        _constructor(self, version, model, role, form, towers) for role in roles
    ]
    base.__init__(self, *constructors, feature_column_v2)

  # tf.test.TestCase's `test_session` is a session helper, not a test; the
  # bases never call it, and a non-callable is not collected.
  # The bases call unittest's `assertEquals`, which Python 3.12 removed.
  namespace = {
      "__init__": __init__,
      "peer": (model, base_name, form, towers, sampled_form, first_sampled),
      "test_session": None,
      "assertEquals": tf.test.TestCase.assertEqual
  }
  if form == "model_fn":
    for name in dir(base):
      if name.startswith("test"):
        namespace[name] = _refused_only_by_name(getattr(base, name))
  where = "Plain" if form == "plain" else f"{_FORMS[form]}{towers}Towers"
  short = base_name[len("Base"):-len("Test")]
  if model.endswith("Combined"):
    short = model[:-len("Combined")] + short[len(bases_kind):]
  name = f"{short}{version}{where}Test"
  return name, type(name, (base, tf.test.TestCase), namespace)


def _all_test_cases():
  forms = itertools.cycle(_FORMS)  # the form of each base's default run
  for version in _API:
    for index, (model, (_, roles_by_base, _, _)) in enumerate(_MODELS.items()):
      for turn, base_name in enumerate(roles_by_base, index):
        yield _test_case(version, model, base_name, "plain", None)
        sampled_form = next(forms)
        # A base's first test in one of the API versions, by turns.
        first_sampled = list(_API)[turn % len(_API)] == version
        for form in _FORMS:
          for towers in _TOWERS:
            yield _test_case(version, model, base_name, form, towers,
                             sampled_form, first_sampled)


globals().update(_all_test_cases())


def _full_run(config) -> bool:
  return ("peer" in (config.getoption("markexpr") or "") or
          os.environ.get(_FULL_ENV) == "full")


@pytest.fixture(autouse=True)
def _default_sample(request):
  """Skips what the default run leaves to `-m peer`."""
  if _full_run(request.config):
    return
  model, base_name, form, towers, sampled_form, first_sampled = (
      request.cls.peer)
  name = request.function.__name__
  sampled = (model, base_name, name) in _DEFAULT_SAMPLE or (
      form == sampled_form and
      (first_sampled and name == _first_test(request.cls) or
       (model, base_name, name) in _PARSED_SAMPLE))
  if form == "plain" or towers != _TOWERS[0] or not sampled:
    pytest.skip(f"peer suite: run with `-m peer` or {_FULL_ENV}=full")


@functools.lru_cache(maxsize=None)
def _first_test(test_case) -> str:
  """The first test of a class by name: every base runs once by default."""
  return min(
      name for name in dir(test_case)
      if name.startswith("test") and callable(getattr(test_case, name)))
