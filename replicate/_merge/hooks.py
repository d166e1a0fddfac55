"""Tower 0's hooks, fetching the whole batch's loss and predictions.

A hook built in the model_fn holds tower 0's tensors: its shard's loss and
predictions. Each hook is wrapped so that whatever it asks the session for
(`before_run`'s fetches) gets the whole batch's loss and predictions in
place of tower 0's, through the public `SessionRunHook` interface only;
every other tensor is fetched as asked. The wrapper reports the wrapped
hook's class, so `isinstance` checks (e.g. Estimator's look for a
`CheckpointSaverHook`) still see it.
"""

from typing import Any, Dict, Optional, Sequence

import tensorflow as tf

_SessionRunHook = tf.compat.v1.train.SessionRunHook
_SessionRunArgs = tf.compat.v1.train.SessionRunArgs


class _WholeBatchHook(_SessionRunHook):
  """Runs `hook`, swapping tower 0's tensors for the whole batch's."""

  def __init__(self, hook: _SessionRunHook, swaps: Dict[Any, Any]):
    self._hook = hook
    self._swaps = swaps

  @property
  def __class__(self):  # isinstance() sees the wrapped hook's class.
    return self._hook.__class__

  def __getattr__(self, name):
    return getattr(self._hook, name)

  # A stand-in for the hook: equal to it, and hashed alike.
  def __eq__(self, other):
    return other is self or other == self._hook

  def __hash__(self):
    return hash(self._hook)

  def _swap(self, fetch):
    if isinstance(fetch, str):
      return self._swaps.get(fetch, fetch)
    if isinstance(fetch, (tf.Tensor, tf.Operation)):
      return self._swaps.get(fetch.name, fetch)
    return fetch

  def begin(self):
    self._hook.begin()

  def after_create_session(self, session, coord):
    self._hook.after_create_session(session, coord)

  def before_run(self, run_context):
    args = self._hook.before_run(run_context)
    if args is None or args.fetches is None:
      return args
    fetches = tf.nest.map_structure(self._swap, args.fetches)
    return _SessionRunArgs(fetches, args.feed_dict, args.options)

  def after_run(self, run_context, run_values):
    self._hook.after_run(run_context, run_values)

  def end(self, session):
    self._hook.end(session)


def _name(tensor) -> Optional[str]:
  return getattr(tensor, "name", None)


def whole_batch_swaps(tower_spec, merged: Dict[str, Any]) -> Dict[str, Any]:
  """Tower 0's tensor name -> the whole batch's, for loss and predictions."""
  swaps = {}
  pairs = [(tower_spec.loss, merged.get("loss"))]
  tower_predictions = tower_spec.predictions
  merged_predictions = merged.get("predictions")
  if isinstance(tower_predictions, dict) and isinstance(merged_predictions,
                                                        dict):
    pairs += [(tower_predictions[k], merged_predictions.get(k))
              for k in tower_predictions]
  elif tower_predictions is not None:
    pairs.append((tower_predictions, merged_predictions))
  for tower, whole in pairs:
    if _name(tower) and whole is not None and whole is not tower:
      swaps[_name(tower)] = whole
  return swaps


def wrap_hooks(hooks: Optional[Sequence[_SessionRunHook]], swaps: Dict[str,
                                                                       Any]):
  """Each hook wrapped to fetch the whole batch's tensors (see above)."""
  if not hooks or not swaps:
    return hooks
  return [_WholeBatchHook(hook, swaps) for hook in hooks]
