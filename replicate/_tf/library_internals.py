"""Attributes of Keras optimizers, Estimators and tensorflow_estimator that
have no public reader: an optimizer's own name, step counter and gradient
computation, an Estimator's warm-start settings, a canned estimator's
optimizer by name; and modules whose functions the towers route.
"""

from typing import Any

# pylint: disable=protected-access,g-direct-tensorflow-import,g-import-not-at-top
from tensorflow.python.ops import nn_impl as _nn_impl
from tensorflow.python.ops.variables import PartitionedVariable

__all__ = [
    "NN_IMPL", "PartitionedVariable", "optimizer_name", "keras_iterations",
    "keras_compute_gradients", "warm_start_settings", "canned_optimizer",
    "canned_optimizer_v2"
]

# tf.nn's moments and batch normalization live here (rebound per tower).

NN_IMPL = _nn_impl


def optimizer_name(optimizer: Any) -> str:
  """A Keras legacy optimizer's own name (`_name`: its scopes use it)."""
  return optimizer._name


def keras_iterations(optimizer: Any) -> Any:
  """A Keras legacy optimizer's step counter as set, created or not
  (`_iterations`: the public `iterations` creates it); None if unset."""
  return getattr(optimizer, "_iterations", None)


def keras_compute_gradients(optimizer: Any, loss: Any, **kwargs: Any) -> Any:
  """The (gradient, variable) pairs a Keras legacy optimizer's `minimize`
  applies (`_compute_gradients`: its clipping and transformers included)."""
  return optimizer._compute_gradients(loss, **kwargs)


# ------------------------------------------------------------ estimators


def warm_start_settings(estimator: Any) -> Any:
  """What an Estimator was given as `warm_start_from` (`_warm_start_settings`:
  it keeps no public copy); None for anything else."""
  return getattr(estimator, "_warm_start_settings", None)


def canned_optimizer(name_or_optimizer: Any, learning_rate: float) -> Any:
  """tensorflow_estimator's optimizer for a canned estimator's optimizer
  name (`canned.optimizers.get_optimizer_instance`, v1)."""
  from tensorflow_estimator.python.estimator.canned import optimizers
  return optimizers.get_optimizer_instance(name_or_optimizer, learning_rate)


def canned_optimizer_v2(name_or_optimizer: Any, learning_rate: Any) -> Any:
  """As `canned_optimizer`, for the v2 canned estimators (Keras optimizers)."""
  from tensorflow_estimator.python.estimator.canned import optimizers
  return optimizers.get_optimizer_instance_v2(name_or_optimizer, learning_rate)
