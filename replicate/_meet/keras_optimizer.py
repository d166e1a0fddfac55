"""TowerOptimizer for Keras legacy optimizers, as the v2 canned heads use.

The v2 canned heads insist on a `tf.keras.optimizers.legacy.Optimizer`, call
`get_updates(loss, variables)` in every tower and set `iterations` to the
global step in each; this wrapper is such an optimizer, and computes and
applies gradients like the v1 TowerOptimizer.
"""

from typing import Any, Dict, Iterable, List, Optional, Tuple

import tensorflow as tf

from replicate import _tf
from replicate._meet import meetings
from replicate._meet import optimizer_calls
from replicate._meet import routing
from replicate._meet import transforms
from replicate._meet import wrapper

_KerasOptimizer = tf.keras.optimizers.legacy.Optimizer


def _innermost(
    optimizer: tf.keras.optimizers.legacy.Optimizer
) -> tf.keras.optimizers.legacy.Optimizer:
  """The optimizer inside wrappers such as Keras' LossScaleOptimizer.

  A LossScaleOptimizer does not run OptimizerV2's constructor, so it has no
  `_name` or `_iterations` of its own; its inner optimizer has them.
  """
  inner = getattr(optimizer, "inner_optimizer", None)
  while isinstance(inner, _KerasOptimizer):
    optimizer, inner = inner, getattr(inner, "inner_optimizer", None)
  return optimizer


def _colocated_gradients(optimizer: Any,
                         loss: tf.Tensor,
                         variables: Iterable[tf.Variable],
                         grad_loss: Optional[tf.Tensor] = None) -> List[Any]:
  """d loss / d variables, each gradient op on its forward op's device.

  A loss-scale optimizer's scaling is kept: the loss is scaled before and
  the gradients unscaled after, as its own `get_gradients` does.
  """
  variables = list(variables)
  scales = hasattr(optimizer, "get_scaled_loss")
  if scales:
    loss = optimizer.get_scaled_loss(loss)
  grads = tf.compat.v1.gradients(
      loss, variables, grad_ys=grad_loss, colocate_gradients_with_ops=True)
  if scales:
    grads = optimizer.get_unscaled_gradients(grads)
  return [
      g for g, _ in optimizer_calls.one_device_slices(zip(grads, variables))
  ]


class KerasTowerOptimizer(wrapper.WrapsOptimizer,
                          tf.keras.optimizers.legacy.Optimizer):
  """TowerOptimizer for a Keras legacy optimizer (see TowerOptimizer).

  The v2 canned heads call `get_updates(loss, variables)` and set
  `iterations` to the global step in every tower; the wrapped optimizer's
  iterations advance once per step, in tower 0's apply. The wrapped
  optimizer (a LossScaleOptimizer included) gets the whole batch's
  gradients, so its clipping and finite checks see what one device's would.

  Args:
    optimizer: a `tf.keras.optimizers.legacy.Optimizer`.
    gradient_transform: as for TowerOptimizer: None, a function
      `grads_and_vars -> grads_and_vars` or a list of them, applied to the
      summed gradients before `optimizer.apply_gradients`.
  """

  def __init__(
      self,
      optimizer: tf.keras.optimizers.legacy.Optimizer,
      gradient_transform: transforms.GradientTransforms = None) -> None:
    super().__init__(name=_tf.optimizer_name(_innermost(optimizer)))
    self._wrapped_keras = optimizer
    self._gradient_transform = gradient_transform
    self._transforms = transforms.Pipeline(gradient_transform)

  @property
  def optimizer(self) -> tf.keras.optimizers.legacy.Optimizer:
    """The wrapped Keras optimizer."""
    return self._wrapped_keras

  @property
  def iterations(self) -> tf.Variable:
    """The wrapped optimizer's iteration counter."""
    return self._wrapped_keras.iterations

  @iterations.setter
  def iterations(self, variable: tf.Variable) -> None:
    # Every tower of a canned model_fn sets the same global step.
    if _tf.keras_iterations(_innermost(self._wrapped_keras)) is not variable:
      self._wrapped_keras.iterations = variable

  def get_gradients(self, loss: tf.Tensor, params: Any) -> List[Any]:
    """One device's gradients of the whole batch's loss, in every tower."""
    optimizer = self._wrapped_keras
    params = tf.nest.flatten(params)

    def compute(whole_loss: tf.Tensor, replicated: bool) -> List[Any]:
      if not replicated:
        with routing.direct():
          return optimizer.get_gradients(whole_loss, params)
      grads = _colocated_gradients(optimizer, whole_loss, params)
      optimizer_calls.require_gradients(grads, params)
      return grads

    return optimizer_calls.whole_batch_gradients(
        loss, compute, params, pairs=False, call="TowerOptimizer.get_gradients")

  def get_updates(self, loss: tf.Tensor, params: Any) -> List[Any]:
    """The wrapped optimizer's own `get_updates`, once, on the whole batch.

    Outside replication (or on one device) the call passes unchanged. In
    towers, tower 0 calls the wrapped `get_updates` once with the whole
    batch's loss (its base `get_gradients` colocated with the forward ops);
    every tower gets those updates. With a `gradient_transform`, the
    whole batch's gradients are transformed and applied instead.
    """
    optimizer = self._wrapped_keras
    if not self._transforms.active:
      if optimizer_calls.replicated() is None:
        with routing.direct():
          return optimizer.get_updates(loss, params)
      return routing.once(
          "TowerOptimizer.get_updates",
          loss,
          params,
          lambda whole: optimizer.get_updates(whole, params),
          spec=[meetings.OP])
    grads = self.get_gradients(loss, params)
    return [self.apply_gradients(zip(grads, tf.nest.flatten(params)))]

  def minimize(self,
               loss: Any,
               var_list: Any,
               grad_loss: Optional[tf.Tensor] = None,
               name: Optional[str] = None,
               tape: Any = None) -> Any:
    """Keras' minimize: the wrapped optimizer's own, once, on the whole batch.

    Both of Keras' forms work: a tensor `loss` (in towers its `tape` is not
    needed: the graph has the whole batch's loss) and callables for `loss`
    and `var_list`. With a `gradient_transform`, the whole batch's gradients
    are transformed and applied instead.
    """
    optimizer = self._wrapped_keras
    if optimizer_calls.replicated() is None:
      if not self._transforms.active:
        with routing.direct():
          return optimizer.minimize(
              loss, var_list, grad_loss=grad_loss, name=name, tape=tape)
      with routing.direct():
        grads_and_vars = _tf.keras_compute_gradients(
            optimizer, loss, var_list=var_list, grad_loss=grad_loss, tape=tape)
      return self.apply_gradients(grads_and_vars, name=name)
    loss = routing.recorded_loss(loss, tape)
    if callable(var_list):
      var_list = var_list()
    var_list = tf.nest.flatten(var_list)
    replication = optimizer_calls.replicated()
    assert replication is not None  # checked above
    if not self._transforms.active:
      return routing.once(
          "TowerOptimizer.minimize", loss, var_list,
          lambda whole: optimizer.minimize(
              whole,
              var_list,
              grad_loss=grad_loss,
              name=name,
              tape=routing.GraphTape(replication.recorded)))
    grads = optimizer_calls.whole_batch_gradients(
        loss,
        lambda whole_loss, _: _colocated_gradients(optimizer, whole_loss,
                                                   var_list, grad_loss),
        var_list,
        pairs=False,
        call="TowerOptimizer.get_gradients")
    return self.apply_gradients(zip(grads, var_list), name=name)

  def apply_gradients(self,
                      grads_and_vars: Iterable[Tuple[Any, tf.Variable]],
                      name: Optional[str] = None,
                      **kwargs: Any) -> Any:
    """Meets the other towers; tower 0's gradients are applied once."""
    optimizer = self._wrapped_keras
    return self._apply_once(
        grads_and_vars,
        lambda pairs: optimizer.apply_gradients(pairs, name=name, **kwargs))

  def _wrapped_optimizer(self) -> Any:
    return self._wrapped_keras

  @property
  def weights(self) -> List[tf.Variable]:
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.weights

  def get_config(self) -> Dict[str, Any]:
    """The wrapped optimizer (class and config) and the gradient transform.

    Keras clones an optimizer with `from_config(get_config())` (e.g.
    `model_to_estimator`); this config round-trips in memory. It holds a
    class and, where given, the transform functions, so it is not
    serialisable to JSON: `gradient_transform` is Python code.
    """
    optimizer = self._wrapped_keras
    return {
        "optimizer_class": type(optimizer),
        "optimizer_config": optimizer.get_config(),
        "gradient_transform": self._gradient_transform
    }

  @classmethod
  def from_config(
      cls,
      config: Dict[str, Any],
      custom_objects: Optional[Dict[str, Any]] = None) -> "KerasTowerOptimizer":
    """A new KerasTowerOptimizer around a clone of the wrapped optimizer."""
    optimizer_class = config["optimizer_class"]
    try:
      optimizer = optimizer_class.from_config(
          config["optimizer_config"], custom_objects=custom_objects)
    except TypeError:  # a from_config without custom_objects
      optimizer = optimizer_class.from_config(config["optimizer_config"])
    return cls(optimizer, config.get("gradient_transform"))
