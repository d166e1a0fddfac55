"""`replicated`: a canned estimator built replicated on N virtual CPUs.

For canned-model integration tests: the constructor is called as the test
would call it, with its optimizers wrapped and its model_fn replicated.
"""

import functools
import inspect
import math
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import tensorflow as tf

from replicate import _core
from replicate import _tf
from replicate._meet import keras_optimizer
from replicate._meet import tower_optimizer
from replicate.testing._configs import check_count
from replicate.testing._configs import cpu_names
from replicate.testing._configs import merged_session_config

# A canned estimator class, or a function building one.
_EstimatorFn = Callable[..., tf.compat.v1.estimator.Estimator]

# The canned estimators' constructor arguments that take an optimizer.
_OPTIMIZER_ARGUMENTS = ("optimizer", "dnn_optimizer", "linear_optimizer")

_V1 = tf.compat.v1.estimator

_V2 = tf.estimator

_DNN = (_V2.DNNClassifier, _V2.DNNRegressor, _V2.DNNEstimator,
        _V1.DNNClassifier, _V1.DNNRegressor, _V1.DNNEstimator)

_LINEAR = (_V2.LinearClassifier, _V2.LinearRegressor, _V2.LinearEstimator,
           _V1.LinearClassifier, _V1.LinearRegressor, _V1.LinearEstimator)

_COMBINED = (_V2.DNNLinearCombinedClassifier, _V2.DNNLinearCombinedRegressor,
             _V2.DNNLinearCombinedEstimator, _V1.DNNLinearCombinedClassifier,
             _V1.DNNLinearCombinedRegressor, _V1.DNNLinearCombinedEstimator)


def replicated(
    estimator_fn: Callable[..., tf.compat.v1.estimator.Estimator],
    num_towers: int = 2,
    wrap_optimizers: bool = False,
) -> Callable[..., tf.compat.v1.estimator.Estimator]:
  """A canned estimator's constructor, building it replicated on N virtual CPUs.

      make = replicate.testing.replicated(tf.estimator.DNNClassifier, 4)
      est = make(hidden_units=[8], feature_columns=columns, model_dir=tmp)
      est.train(input_fn, steps=10)  # 4 towers, one device's result

  The returned function takes `estimator_fn`'s arguments, builds the canned
  estimator with them and returns an Estimator of the same API version
  (`tf.estimator.Estimator` for a v2 canned estimator, the
  `tf.compat.v1.estimator` one for v1) whose model_fn is
  `replicate_model_fn(canned.model_fn)` on '/device:CPU:0' ..
  '/device:CPU:<N-1>'. It keeps the canned estimator's model_dir, params,
  warm start and config; its session config gets N CPU devices (the rest of
  it kept), so no `virtual_cpus` call is needed.

  Only the model_fn is wrapped by default: the canned estimator builds and
  uses its optimizer as on one device (optimizers are routed through the
  towers). With `wrap_optimizers`, the arguments named `optimizer`,
  `dnn_optimizer` and `linear_optimizer` (given, or `estimator_fn`'s
  defaults) are wrapped in `replicate.TowerOptimizer`: an optimizer or a
  function as it is, a name (or None for a linear model) as the optimizer
  the canned estimator builds from it, same class and learning rate, built
  anew in each graph (what a mock optimizer set on the instance needs).

  Args:
    estimator_fn: a canned estimator class (`tf.estimator.DNNClassifier`,
      `tf.compat.v1.estimator.LinearRegressor`, ...) or a function building
      one from those classes' argument names.
    num_towers: how many towers, one virtual CPU device each; at least 1.
    wrap_optimizers: wrap the optimizer arguments in `TowerOptimizer`.

  Returns:
    A function with `estimator_fn`'s signature returning the replicated
    Estimator.

  Raises:
    ValueError: `num_towers` is less than 1. When the returned function is
      called: `estimator_fn` returned no Estimator, or its session config
      sets another CPU count; when training starts: an optimizer is a name
      for an estimator other than the DNN, linear and DNNLinearCombined ones
      (pass an optimizer or a function returning one instead).
  """
  check_count(num_towers)
  devices = cpu_names(num_towers)

  @functools.wraps(estimator_fn)
  def build(*args: Any, **kwargs: Any) -> tf.compat.v1.estimator.Estimator:
    # The canned estimator, once built: names resolve by its type.
    built: List[tf.compat.v1.estimator.Estimator] = []
    if wrap_optimizers:
      args, kwargs = _with_tower_optimizers(estimator_fn, args, kwargs, built)
    canned = estimator_fn(*args, **kwargs)
    if not isinstance(canned, tf.compat.v1.estimator.Estimator):
      raise TypeError(
          f"replicated: {estimator_fn!r} returned {canned!r}, not an "
          "Estimator; pass a canned estimator class or a function "
          "returning one.")
    built.append(canned)
    config = canned.config.replace(
        session_config=merged_session_config(num_towers,
                                             canned.config.session_config))
    estimator_class = (
        tf.estimator.Estimator if isinstance(canned, tf.estimator.Estimator)
        else tf.compat.v1.estimator.Estimator)
    return estimator_class(
        _core.replicate_model_fn(canned.model_fn, devices=devices),
        model_dir=canned.model_dir,
        config=config,
        params=canned.params,
        # Estimator keeps warm_start_from only here; no public accessor.
        warm_start_from=_tf.warm_start_settings(canned))

  return build


def _with_tower_optimizers(
    estimator_fn: _EstimatorFn, args: Tuple[Any, ...], kwargs: Dict[str, Any],
    built: List[tf.compat.v1.estimator.Estimator]
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
  """(args, kwargs) with every optimizer argument in a TowerOptimizer.

  Optimizer arguments are `estimator_fn`'s parameters of those names (given
  or default) and, for a function taking `**kwargs`, those keywords.
  """
  bound = inspect.signature(estimator_fn).bind(*args, **kwargs)
  bound.apply_defaults()
  arguments = [bound.arguments]
  for name, parameter in bound.signature.parameters.items():
    if parameter.kind is inspect.Parameter.VAR_KEYWORD:
      arguments.append(bound.arguments.get(name, {}))
  columns = [
      a.get(n)
      for a in arguments
      for n in ("feature_columns", "linear_feature_columns")
  ]
  num_columns = len(list(next((c for c in columns if c), ())))
  for given in arguments:
    for name in _OPTIMIZER_ARGUMENTS:
      if name in given:
        given[name] = _tower_optimizer(given[name], name, num_columns, built)
  return bound.args, bound.kwargs


def _tower_optimizer(
    value: Any, argument: str, num_columns: int,
    built: List[tf.compat.v1.estimator.Estimator]
) -> Union[tower_optimizer.TowerOptimizer, keras_optimizer.KerasTowerOptimizer,
           None]:
  """`value` (an optimizer argument) in a TowerOptimizer."""
  if isinstance(
      value,
      (tower_optimizer.TowerOptimizer, keras_optimizer.KerasTowerOptimizer)):
    return value
  if isinstance(value, str) or (value is None and argument == "optimizer"):
    value = functools.partial(_canned_optimizer, built, argument, value,
                              num_columns)
  elif value is None:
    return value
  return tower_optimizer.TowerOptimizer(value)


def _canned_optimizer(built: List[tf.compat.v1.estimator.Estimator],
                      argument: str, name: Optional[str],
                      num_columns: int) -> Any:
  """The optimizer `built[0]` (a canned estimator) builds from `name`.

  The learning rates are tensorflow_estimator's (2.13 to 2.15): DNN 0.05 (v1)
  or Keras' default (v2), linear 0.2, DNNLinearCombined 0.001 for the DNN and
  min(0.005, 1/sqrt(columns)) for the linear part; a linear model's None is
  Ftrl at min(0.2, 1/sqrt(columns)).
  """
  canned = built[0]
  v2 = isinstance(canned, tf.estimator.Estimator)
  columns = max(num_columns, 1)
  if isinstance(canned, _DNN):
    rate = None if v2 else 0.05
  elif isinstance(canned, _LINEAR):
    rate = 0.2
    if name is None:
      name, rate = "Ftrl", min(0.2, 1.0 / math.sqrt(columns))
  elif isinstance(canned, _COMBINED):
    rate = (0.001 if argument == "dnn_optimizer" else min(
        0.005, 1.0 / math.sqrt(columns)))
  else:
    raise ValueError(
        f"replicated: {argument}={name!r} for {type(canned).__name__}: "
        "which optimizer it builds from a name is not known here; pass an "
        "optimizer, or a function returning one.")
  if v2:
    return _tf.canned_optimizer_v2(name, rate)
  assert rate is not None  # None only for a v2 DNN: Keras' default
  return _tf.canned_optimizer(name, rate)
