"""The Estimator a model_fn was taken from, and what it does outside it.

`canned.model_fn` (any Estimator's `model_fn` property) closes over its
Estimator. Some of what that Estimator does to one device's training is not
in the model_fn: its warm start (a canned estimator's `warm_start_from`,
`model_to_estimator`'s start from the Keras model's weights) runs in
`Estimator.train` after the model_fn. An Estimator built around the
replicated model_fn would start from fresh initial values instead.
"""

import inspect
from typing import Any, Callable, Optional

from absl import logging
import tensorflow as tf

from replicate import _tf

_ESTIMATORS = (tf.estimator.Estimator, tf.compat.v1.estimator.Estimator)


def estimator_of(
    model_fn: Callable[..., Any]) -> Optional[tf.compat.v1.estimator.Estimator]:
  """The Estimator whose `model_fn` property returned `model_fn`, or None."""
  try:
    estimator = inspect.getclosurevars(model_fn).nonlocals.get("self")
  except (TypeError, ValueError):
    return None
  return estimator if isinstance(estimator, _ESTIMATORS) else None


def warm_starter(model_fn: Callable[..., Any]) -> Optional[Callable[[], None]]:
  """Warm-starts the built graph as `model_fn`'s Estimator trains, or None.

  The returned function, called in a TRAIN graph once its variables exist,
  sets their initializers from the Estimator's warm-start checkpoint, as
  `Estimator.train` does after its model_fn (an Estimator around the
  replicated model_fn with the same `warm_start_from` sets them again, to
  the same values).
  """
  estimator = estimator_of(model_fn)
  settings = _tf.warm_start_settings(estimator)
  if settings is None:
    return None

  def warm_start() -> None:
    logging.info("replicate: warm-starting as %s does on one device: %s",
                 type(estimator).__name__, settings)
    tf.compat.v1.train.warm_start(*settings)

  return warm_start
