"""What both optimizer wrappers share: forwarding to the optimizer they wrap.

`TowerOptimizer` (v1) and `KerasTowerOptimizer` (Keras legacy) differ in
how they compute gradients and in the API they present; both route their
own calls, forward slots and variables to the wrapped optimizer, show it to
checkpoints in their place, and apply tower 0's transformed gradients once.
"""

from typing import Any, Callable, Iterable, List, Optional, Tuple

import tensorflow as tf

from replicate import _tf
from replicate._meet import optimizer_calls
from replicate._meet import routing
from replicate._meet import transforms


class WrapsOptimizer(_tf.TracksWrapped):
  """Mixin of both wrappers: `_wrapped_optimizer()` is what they forward to.

  It goes before the optimizer base class, whose methods it replaces.
  """

  # Its calls do their own meeting (see `routing.ROUTES_ITSELF`).
  _replicate_routes_itself = True
  _transforms: transforms.Pipeline

  def _wrapped_optimizer(self) -> Any:
    raise NotImplementedError

  def _tracked_optimizer(self) -> Any:
    """What checkpoints see in this wrapper's place (`_tf.TracksWrapped`)."""
    return self._wrapped_optimizer()

  def _apply_once(self, grads_and_vars: Iterable[Tuple[Any, tf.Variable]],
                  apply: Callable[[List[Tuple[Any, tf.Variable]]], Any]) -> Any:
    """Meets the other towers; `apply` runs once on tower 0's transformed
    gradients, unrouted."""

    def direct(pairs: List[Tuple[Any, tf.Variable]]) -> Any:
      with routing.direct():
        return apply(pairs)

    return optimizer_calls.transform_and_apply(grads_and_vars, self._transforms,
                                               direct)

  def get_slot(self, *args: Any, **kwargs: Any) -> Optional[tf.Variable]:
    """Forwards to the wrapped optimizer."""
    return self._wrapped_optimizer().get_slot(*args, **kwargs)

  def get_slot_names(self, *args: Any, **kwargs: Any) -> List[str]:
    """Forwards to the wrapped optimizer."""
    return self._wrapped_optimizer().get_slot_names(*args, **kwargs)

  def variables(self) -> List[tf.Variable]:
    """Forwards to the wrapped optimizer."""
    return self._wrapped_optimizer().variables()
