"""An optimizer wrapper's checkpoint dependencies: the wrapped optimizer's.

An optimizer wrapper is a Trackable of its own; an object-based checkpoint
(Keras' model_to_estimator Saver, tf.train.Checkpoint) would save what the
wrapper tracks (nothing). `TracksWrapped` hands checkpoints the wrapped
optimizer's dependencies as the wrapper's own, through Trackable's
protected hooks (no public API; Keras' LossScaleOptimizer overrides the
same).
"""

from typing import Any, Dict, Optional


class TracksWrapped:
  """Mixin: checkpoints see `_tracked_optimizer()`'s dependencies."""

  def _tracked_optimizer(self) -> Any:
    raise NotImplementedError

  def _wrapped_trackable(self) -> Any:
    # Trackable sets up its dependency maps lazily (TensorFlow 2.13 reads
    # them unset in `_lookup_dependency`): a restore can reach the wrapped
    # optimizer before it has tracked anything.
    optimizer = self._tracked_optimizer()
    optimizer._maybe_initialize_trackable()
    return optimizer

  def _trackable_children(self,
                          save_type: str = "checkpoint",
                          **kwargs: Any) -> Dict[str, Any]:
    return self._wrapped_trackable()._trackable_children(save_type, **kwargs)

  def _lookup_dependency(
      self,
      name: str,
      cached_dependencies: Optional[Dict[str, Any]] = None) -> Any:
    if cached_dependencies is not None:
      return cached_dependencies.get(name)
    return self._wrapped_trackable()._lookup_dependency(name)

  @property
  def _deferred_dependencies(self) -> Any:
    # A restore that meets a variable not yet created leaves it here; the
    # wrapped optimizer creates it, and looks here.
    return self._wrapped_trackable()._deferred_dependencies

  def _restore_slot_variable(self, slot_name: str, variable: Any,
                             slot_variable: Any) -> Any:
    return self._tracked_optimizer()._restore_slot_variable(
        slot_name, variable, slot_variable)

  def _create_or_restore_slot_variable(self, slot_variable_position: Any,
                                       slot_name: str, variable: Any) -> Any:
    return self._tracked_optimizer()._create_or_restore_slot_variable(
        slot_variable_position, slot_name, variable)
