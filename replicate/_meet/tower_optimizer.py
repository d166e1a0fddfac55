"""TowerOptimizer: one device's gradients in every tower, one update.

`compute_gradients` hands every tower the gradients of the whole batch's
loss and `apply_gradients` applies tower 0's once, in the scopes tower 0
made the call in, so that slot variables are named as without replication
(see `_meet.optimizer_calls`). Keras legacy optimizers (which the v2 canned
estimators require) get the Keras flavour in `_meet.keras_optimizer`.
"""

from typing import (
    Any,
    Callable,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import tensorflow as tf

from replicate import _context
from replicate._meet import optimizer_calls
from replicate._meet import routing
from replicate._meet import transforms
from replicate._meet import wrapper
from replicate._meet.keras_optimizer import KerasTowerOptimizer

_Optimizer = tf.compat.v1.train.Optimizer
_GATE_OP = tf.compat.v1.train.Optimizer.GATE_OP
_KerasOptimizer = tf.keras.optimizers.legacy.Optimizer


class _PerGraph:
  """An optimizer given directly, or built once per graph by a function."""

  _fixed: Any
  _fn: Optional[Callable[[], Any]]

  def __init__(self, optimizer_or_fn: Any, expected_types: Tuple[type, ...],
               what: str) -> None:
    if isinstance(optimizer_or_fn, expected_types):
      self._fixed, self._fn = optimizer_or_fn, None
    elif callable(optimizer_or_fn):
      self._fixed, self._fn = None, optimizer_or_fn
    else:
      raise TypeError(
          f"TowerOptimizer got {optimizer_or_fn!r} of type "
          f"{type(optimizer_or_fn).__name__}; pass {what} or a function of no "
          "arguments that returns one.")
    self._types, self._what = expected_types, what

  @property
  def is_lazy(self) -> bool:
    return self._fixed is None

  def get(self) -> Any:
    if self._fixed is not None:
      return self._fixed
    # Held by the graph: the optimizer holds the graph's variables.
    built = _context.graph_store(tf.compat.v1.get_default_graph(),
                                 "optimizers built by TowerOptimizer")
    if self not in built:
      assert self._fn is not None  # _fixed is None: a function was given
      optimizer = self._fn()
      if not isinstance(optimizer, self._types):
        raise TypeError(
            f"The optimizer function given to TowerOptimizer returned "
            f"{optimizer!r} of type {type(optimizer).__name__}; it must "
            f"return {self._what}.")
      built[self] = optimizer
    return built[self]


class _EitherFlavour(type):
  """`isinstance(x, TowerOptimizer)` holds for the Keras flavour too."""

  def __instancecheck__(cls, instance: Any) -> bool:
    return super().__instancecheck__(instance) or (
        cls is TowerOptimizer and isinstance(instance, KerasTowerOptimizer))

  def __subclasscheck__(cls, subclass: type) -> bool:
    return super().__subclasscheck__(subclass) or (
        cls is TowerOptimizer and issubclass(subclass, KerasTowerOptimizer))


class TowerOptimizer(
    wrapper.WrapsOptimizer,
    tf.compat.v1.train.Optimizer,
    metaclass=_EitherFlavour):
  """Wraps an optimizer: its own calls, once per step, on the whole batch.

  `replicate_model_fn` routes plain optimizers itself (see `_meet.routing`); the
  wrapper is for `gradient_transform`, for optimizers whose methods cannot
  be routed (a mock whose `minimize` is an instance attribute, a class
  defined while the towers are built), and to make the routing explicit:

      opt = replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(1e-3))
      train_op = opt.minimize(loss, tf.compat.v1.train.get_global_step())

  Inside `replicate_model_fn` with several towers, `minimize` calls the
  wrapped optimizer's own `minimize` once, by tower 0, with the whole
  batch's loss (the towers' losses combined; gradients colocated with their
  forward ops where it takes `colocate_gradients_with_ops`), so overrides,
  subclasses and mocks see what they see on one device, as often; every
  tower gets that update. `compute_gradients` returns, in every tower, one
  device's gradients of the whole batch's loss, so clipping or scaling them
  before `apply_gradients` gives one device's result; `apply_gradients`
  applies tower 0's once. Outside, or with one tower, every call passes
  unchanged to the wrapped optimizer's own method. Gradients the model_fn
  takes with `tf.gradients` of its scalar loss are the whole batch's too
  (see `_meet.own_gradients`); ones taken per tower (`grad_ys`, a non-scalar
  `ys`) are summed over the towers under Reduction.SUM and refused under
  an averaging reduction.

  A Keras legacy optimizer (`tf.keras.optimizers.legacy.*`, what the v2
  canned estimators take) gives a Keras optimizer that does the same through
  `get_updates` / `minimize` (the wrapped one's own, once, on the whole
  batch) and `get_gradients` / `apply_gradients`; it round-trips through
  `get_config` / `from_config` in memory (`model_to_estimator`); its own
  `clipnorm`, `clipvalue`, `global_clipnorm` and `gradient_transformers` see
  the whole batch's gradients. A loss-scale optimizer (Keras'
  `LossScaleOptimizer` or v1's `MixedPrecisionLossScaleOptimizer`) skips a
  step where the whole batch's gradients are not finite, as one device
  would; a dynamic loss scale creates variables when it is built, so for an
  Estimator pass a function: `TowerOptimizer(lambda: LossScaleOptimizer(
  tf.keras.optimizers.legacy.Adam()))`.

  To transform the gradients right before they are applied (clip them,
  scale some, add noise, log their norm) where the model_fn has no place
  between `compute_gradients` and `apply_gradients` (a canned estimator,
  `minimize`), pass `gradient_transform`: a function from the list of
  (gradient, variable) pairs to the pairs to apply. `minimize` and
  `get_updates` then call the wrapped optimizer's gradient and apply methods
  with the transform between them, not its own `minimize` / `get_updates`.
  It runs once per step on the whole batch's gradients, and on one device
  (or outside `replicate_model_fn`) on that device's, so both give the same
  result.

      opt = replicate.TowerOptimizer(
          tf.compat.v1.train.AdagradOptimizer(0.1),
          gradient_transform=replicate.TowerOptimizer.clip_by_global_norm(5.0))

  Args:
    optimizer_or_optimizer_fn: a `tf.compat.v1.train.Optimizer` or a
      `tf.keras.optimizers.legacy.Optimizer`, or a function of no arguments
      returning one; the function is called once per graph, when the
      optimizer is first needed.
    gradient_transform: None, a function `grads_and_vars -> grads_and_vars`
      or a list of them (applied in order). It gets only variables with a
      gradient; an `IndexedSlices` gradient has each index once. It runs
      where tower 0 applies, before the wrapped optimizer's own processing
      (e.g. Keras clipping, a loss-scale optimizer's finite check).

  Raises:
    TypeError: the argument is neither an optimizer nor callable, or
      `gradient_transform` is neither a function nor a list of them.
  """

  def __new__(cls,
              optimizer_or_optimizer_fn: Any = None,
              *args: Any,
              **kwargs: Any) -> Any:
    if cls is TowerOptimizer and isinstance(optimizer_or_optimizer_fn,
                                            _KerasOptimizer):
      return KerasTowerOptimizer(optimizer_or_optimizer_fn, *args, **kwargs)
    return super().__new__(cls)

  def __init__(
      self,
      optimizer_or_optimizer_fn: Union[tf.compat.v1.train.Optimizer,
                                       tf.keras.optimizers.legacy.Optimizer,
                                       Callable[[], Any]],
      gradient_transform: transforms.GradientTransforms = None) -> None:
    self._wrapped = _PerGraph(
        optimizer_or_optimizer_fn, (_Optimizer, _KerasOptimizer),
        "a tf.compat.v1.train.Optimizer or tf.keras.optimizers.legacy."
        "Optimizer")
    self._gradient_transform = gradient_transform
    self._transforms = transforms.Pipeline(gradient_transform)
    # Not lazy: an optimizer was given, not a function.
    name = ("TowerOptimizer" if self._wrapped.is_lazy else
            optimizer_or_optimizer_fn.get_name())  # type: ignore[union-attr]
    super().__init__(use_locking=False, name=name)

  @staticmethod
  def clip_by_global_norm(clip_norm: float) -> transforms.GradientTransform:
    """A `gradient_transform` that clips the gradients' global norm.

    All gradients are scaled by `clip_norm / max(global_norm, clip_norm)`
    (`tf.clip_by_global_norm`), the norm taken over the summed gradients:

        opt = replicate.TowerOptimizer(
            tf.compat.v1.train.AdamOptimizer(1e-3),
            gradient_transform=replicate.TowerOptimizer.clip_by_global_norm(1.0))

    Args:
      clip_norm: the largest global norm to apply, a positive float.

    Returns:
      A function from (gradient, variable) pairs to the clipped pairs.

    Raises:
      TypeError: `clip_norm` is not a number or a tensor.
      ValueError: `clip_norm` is not positive.
    """
    return transforms.clip_by_global_norm(clip_norm)

  def __call__(self) -> Union["TowerOptimizer", KerasTowerOptimizer]:
    """Builds the optimizer now, as canned estimators do with callables.

    Returns this TowerOptimizer for a v1 optimizer, or a Keras TowerOptimizer
    wrapping what the function returned for a Keras one.
    """
    optimizer = self._wrapped.get()
    if isinstance(optimizer, _KerasOptimizer):
      return KerasTowerOptimizer(optimizer, self._gradient_transform)
    return self

  @property
  def optimizer(self) -> tf.compat.v1.train.Optimizer:
    """The wrapped optimizer (for a function, the one built for this graph)."""
    optimizer = self._wrapped.get()
    if isinstance(optimizer, _KerasOptimizer):
      raise ValueError(
          f"TowerOptimizer's function returned Keras optimizer {optimizer!r} "
          "where a tf.compat.v1.train.Optimizer is used; pass the Keras "
          "optimizer itself, or call the TowerOptimizer to get its Keras "
          "wrapper.")
    return optimizer

  def minimize(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
    """The wrapped optimizer's own `minimize`, once, on the whole batch's loss.

    Outside replication (or on one device) the call passes unchanged. In
    towers, tower 0 calls the wrapped `minimize` once with the whole batch's
    loss (gradients colocated with their forward ops where it takes
    `colocate_gradients_with_ops`), in its own scopes; every tower gets that
    update. With a `gradient_transform` the wrapped optimizer's
    `compute_gradients` and `apply_gradients` are called instead, with the
    transform between them.
    """
    if self._transforms.active:
      return super().minimize(loss, *args, **kwargs)
    optimizer = self.optimizer
    if optimizer_calls.replicated() is None:
      with routing.direct():
        return optimizer.minimize(loss, *args, **kwargs)
    var_list = routing.argument(args, kwargs, "var_list", 1)
    return routing.once(
        "TowerOptimizer.minimize",
        loss,
        var_list,
        lambda whole: routing.call_with_loss(
            optimizer.minimize, (loss,) + args,
            kwargs,
            whole,
            colocate_gradients_with_ops=True),
        split=routing.v1_minimize_steps(optimizer, (loss,) + args, kwargs))

  def compute_gradients(
      self,
      loss: Any,
      var_list: Optional[Sequence[tf.Variable]] = None,
      gate_gradients: int = _GATE_OP,
      aggregation_method: Any = None,
      colocate_gradients_with_ops: bool = False,
      grad_loss: Optional[tf.Tensor] = None) -> List[Tuple[Any, tf.Variable]]:
    """One device's gradients of the whole batch's loss, in every tower.

    In a replicated tower the towers' losses are combined into the whole
    batch's and differentiated once, each gradient op on its forward op's
    device; outside, the wrapped optimizer's `compute_gradients`.
    """
    optimizer = self.optimizer

    def compute(whole_loss: tf.Tensor,
                replicated: bool) -> List[Tuple[Any, tf.Variable]]:
      with routing.direct():
        grads_and_vars = optimizer.compute_gradients(
            whole_loss,
            var_list=var_list,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=(replicated or
                                         colocate_gradients_with_ops),
            grad_loss=grad_loss)
      if replicated:
        return optimizer_calls.one_device_slices(grads_and_vars)
      return grads_and_vars

    return optimizer_calls.whole_batch_gradients(loss, compute, var_list)

  def apply_gradients(self,
                      grads_and_vars: Iterable[Tuple[Any, tf.Variable]],
                      global_step: Optional[tf.Variable] = None,
                      name: Optional[str] = None) -> Any:
    """Meets the other towers; tower 0's gradients are applied once."""
    optimizer = self.optimizer
    return self._apply_once(
        grads_and_vars,
        lambda pairs: optimizer.apply_gradients(pairs, global_step, name))

  def _wrapped_optimizer(self) -> Any:
    return self.optimizer

  def _tracked_optimizer(self) -> Any:
    """What checkpoints see in this wrapper's place (`_tf.TracksWrapped`):
    the optimizer built for this graph, of either flavour."""
    return self._wrapped.get()
