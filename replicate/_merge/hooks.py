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

_SessionRunArgs = tf.compat.v1.train.SessionRunArgs


class _WholeBatchHook(tf.compat.v1.train.SessionRunHook):
  """Runs `hook`, swapping tower 0's tensors for the whole batch's."""

  def __init__(self, hook: tf.compat.v1.train.SessionRunHook,
               swaps: Dict[Any, Any]) -> None:
    self._hook = hook
    self._swaps = swaps

  # isinstance() sees the wrapped hook's class (a read-only property over
  # object's settable `__class__`, as intended).
  @property  # type: ignore[misc]
  def __class__(self) -> type:
    return self._hook.__class__

  def __getattr__(self, name: str) -> Any:
    return getattr(self._hook, name)

  # A stand-in for the hook: equal to it, and hashed alike.
  def __eq__(self, other: object) -> bool:
    return other is self or other == self._hook

  def __hash__(self) -> int:
    return hash(self._hook)

  def _swap(self, fetch: Any) -> Any:
    if isinstance(fetch, str):
      return self._swaps.get(fetch, fetch)
    if isinstance(fetch, (tf.Tensor, tf.Operation)):
      return self._swaps.get(fetch.name, fetch)
    return fetch

  def begin(self) -> None:
    self._hook.begin()

  def after_create_session(self, session: tf.compat.v1.Session,
                           coord: tf.train.Coordinator) -> None:
    self._hook.after_create_session(session, coord)

  def before_run(
      self, run_context: tf.compat.v1.train.SessionRunContext
  ) -> Optional[tf.compat.v1.train.SessionRunArgs]:
    args = self._hook.before_run(run_context)
    if args is None or args.fetches is None:
      return args
    fetches = tf.nest.map_structure(self._swap, args.fetches)
    return _SessionRunArgs(fetches, args.feed_dict, args.options)

  def after_run(self, run_context: tf.compat.v1.train.SessionRunContext,
                run_values: tf.compat.v1.train.SessionRunValues) -> None:
    self._hook.after_run(run_context, run_values)

  def end(self, session: tf.compat.v1.Session) -> None:
    self._hook.end(session)


def _name(tensor: Any) -> Optional[str]:
  return getattr(tensor, "name", None)


def whole_batch_swaps(tower_spec: Any, merged: Dict[str,
                                                    Any]) -> Dict[str, Any]:
  """Tower 0's tensor name -> the whole batch's, for loss and predictions."""
  swaps: Dict[str, Any] = {}
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
    name = _name(tower)
    if name and whole is not None and whole is not tower:
      swaps[name] = whole
  return swaps


def wrap_hooks(
    hooks: Optional[Sequence[tf.compat.v1.train.SessionRunHook]],
    swaps: Dict[str,
                Any]) -> Optional[Sequence[tf.compat.v1.train.SessionRunHook]]:
  """Each hook wrapped to fetch the whole batch's tensors (see above)."""
  if not hooks or not swaps:
    return hooks
  return [_WholeBatchHook(hook, swaps) for hook in hooks]
