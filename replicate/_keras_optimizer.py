"""TowerOptimizer for Keras legacy optimizers, as the v2 canned heads use.

The v2 canned heads insist on a `tf.keras.optimizers.legacy.Optimizer`, call
`get_updates(loss, variables)` in every tower and set `iterations` to the
global step in each; this wrapper is such an optimizer, and gathers and
applies like the v1 TowerOptimizer.
"""

import tensorflow as tf

from replicate import _gather
from replicate import _transform

_KerasOptimizer = tf.keras.optimizers.legacy.Optimizer


def _innermost(optimizer: _KerasOptimizer) -> _KerasOptimizer:
  """The optimizer inside wrappers such as Keras' LossScaleOptimizer.

  A LossScaleOptimizer does not run OptimizerV2's constructor, so it has no
  `_name` or `_iterations` of its own; its inner optimizer has them.
  """
  inner = getattr(optimizer, "inner_optimizer", None)
  while isinstance(inner, _KerasOptimizer):
    optimizer, inner = inner, getattr(inner, "inner_optimizer", None)
  return optimizer


class KerasTowerOptimizer(_KerasOptimizer):
  """TowerOptimizer for a Keras legacy optimizer (see TowerOptimizer).

  The v2 canned heads call `get_updates(loss, variables)` and set
  `iterations` to the global step in every tower; the wrapped optimizer's
  iterations advance once per step, in the last tower's apply. The wrapped
  optimizer (a LossScaleOptimizer included) gets the summed gradients, so
  its clipping and finite checks see what one device's would.

  Args:
    optimizer: a `tf.keras.optimizers.legacy.Optimizer`.
    gradient_transform: as for TowerOptimizer: None, a function
      `grads_and_vars -> grads_and_vars` or a list of them, applied to the
      summed gradients before `optimizer.apply_gradients`.
  """

  def __init__(self, optimizer: _KerasOptimizer,
               gradient_transform: _transform.GradientTransforms = None):
    super().__init__(name=_innermost(optimizer)._name)  # pylint: disable=protected-access
    self._wrapped_keras = optimizer
    self._transforms = _transform.Pipeline(gradient_transform)

  @property
  def optimizer(self) -> _KerasOptimizer:
    """The wrapped Keras optimizer."""
    return self._wrapped_keras

  @property
  def iterations(self):
    """The wrapped optimizer's iteration counter."""
    return self._wrapped_keras.iterations

  @iterations.setter
  def iterations(self, variable):
    # Every tower of a canned model_fn sets the same global step.
    if _innermost(self._wrapped_keras)._iterations is not variable:  # pylint: disable=protected-access
      self._wrapped_keras.iterations = variable

  def get_gradients(self, loss, params):
    """Gradients of the tower's loss, weighted by its share of the batch."""
    return self._wrapped_keras.get_gradients(_gather.scaled_loss(loss), params)

  def get_updates(self, loss, params):
    """The update op: this tower's gradients, summed and applied once."""
    grads = self.get_gradients(loss, params)
    return [self.apply_gradients(zip(grads, params))]

  def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
    """Keras' minimize on the scaled loss, then the gathered apply."""
    grads_and_vars = self._wrapped_keras._compute_gradients(  # pylint: disable=protected-access
        _gather.scaled_loss(loss), var_list=var_list, grad_loss=grad_loss, tape=tape)
    return self.apply_gradients(grads_and_vars, name=name)

  def apply_gradients(self, grads_and_vars, name=None, **kwargs):
    """Records the tower's gradients; the last tower applies their sum."""
    optimizer = self._wrapped_keras
    return _gather.transform_and_apply(
        grads_and_vars, self._transforms,
        lambda pairs: optimizer.apply_gradients(pairs, name=name, **kwargs))

  def get_slot(self, var, slot_name):
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.get_slot(var, slot_name)

  def get_slot_names(self):
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.get_slot_names()

  def variables(self):
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.variables()

  @property
  def weights(self):
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.weights

  def get_config(self):
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.get_config()
