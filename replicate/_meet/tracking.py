"""Checkpoint tracking that passes through an optimizer wrapper.

A wrapper around an optimizer is a Trackable object of its own; an object-
based checkpoint (Keras' `model_to_estimator` Saver, `tf.train.Checkpoint`)
would save what the wrapper tracks (nothing) instead of the wrapped
optimizer's hyperparameters, iterations and non-slot variables, and could
not restore them. This mixin hands checkpoints the wrapped optimizer's
dependencies as the wrapper's own, so a checkpoint has the keys the
unwrapped optimizer writes and restores either way. The hooks are
Trackable's protected ones (there is no public API); Keras'
LossScaleOptimizer overrides the same ones.
"""

# pylint: disable=protected-access


class TracksWrapped:
  """Mixin: checkpoints see `_tracked_optimizer()`'s dependencies."""

  def _tracked_optimizer(self):
    raise NotImplementedError

  def _wrapped_trackable(self):
    # Trackable sets up its dependency maps lazily (TensorFlow 2.13 reads
    # them unset in `_lookup_dependency`): a restore can reach the wrapped
    # optimizer before it has tracked anything.
    optimizer = self._tracked_optimizer()
    optimizer._maybe_initialize_trackable()
    return optimizer

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    return self._wrapped_trackable()._trackable_children(save_type, **kwargs)

  def _lookup_dependency(self, name, cached_dependencies=None):
    if cached_dependencies is not None:
      return cached_dependencies.get(name)
    return self._wrapped_trackable()._lookup_dependency(name)

  @property
  def _deferred_dependencies(self):
    # A restore that meets a variable not yet created leaves it here; the
    # wrapped optimizer creates it, and looks here.
    return self._wrapped_trackable()._deferred_dependencies

  def _restore_slot_variable(self, slot_name, variable, slot_variable):
    return self._tracked_optimizer()._restore_slot_variable(
        slot_name, variable, slot_variable)

  def _create_or_restore_slot_variable(self, slot_variable_position,
                                       slot_name, variable):
    return self._tracked_optimizer()._create_or_restore_slot_variable(
        slot_variable_position, slot_name, variable)
