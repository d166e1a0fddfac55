"""Batch statistics each tower keeps for itself (`sync_batch_norm=False`).

With synchronised batch norm off, a tower's batch normalization uses its
shard's statistics: fewer waits between devices, not one device's result.
Every reduction is otherwise the whole batch's (`_meet.rewiring`), so the
moments batch norm takes (`tf.nn.moments`, `tf.nn.weighted_moments`, which
Keras' and tf-slim's non-fused layers call) are marked while they are built:
their reductions stay the tower's (`_batch.row_kinds.SHARD`), and the
moving statistics written from them are combined by their aggregation
(MEAN, see `_merge.state`). Fused kernels in training stay the tower's by
their type.
"""

import functools
from typing import Any, Callable, ContextManager

import tensorflow as tf

from replicate import _context
from replicate import _tf

_NAMES = ("moments", "weighted_moments")


def _recording(original: Callable[..., Any]) -> Callable[..., Any]:

  @functools.wraps(original)
  def statistics(*args: Any, **kwargs: Any) -> Any:
    replication = _context.current_replication()
    graph = tf.compat.v1.get_default_graph()
    if (replication is None or replication.tower is None or
        graph is not replication.graph):
      return original(*args, **kwargs)
    start = graph.version
    result = original(*args, **kwargs)
    replication.per_tower_ops.update(
        op.name for op in graph.get_operations()[start:graph.version])
    return result

  return statistics


def _install() -> _tf.Patched:
  patched = []
  for name in _NAMES:
    original = getattr(_tf.NN_IMPL, name)
    patched.extend(_tf.rebind(name, original, _recording(original)))
  return patched


_PATCHES = _tf.Patches("tf.nn batch statistics kept per tower", _install)


def per_tower(replication: _context.Replication) -> ContextManager[None]:
  """Batch statistics built inside stay each tower's (see above)."""
  return _PATCHES.applied(not replication.sync_batch_norm and
                          replication.num_towers > 1)
