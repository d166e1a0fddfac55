"""The ops a training, evaluation or prediction step can run.

A graph holds ops no step runs: a Keras functional model builds its layers
once on its `tf.keras.Input` placeholder (with the learning phase as a
tensor `training`, so batch norm's updates sit inside a tf.cond) before the
model_fn calls it on the features. Such ops are left alone; what the step
fetches is what the Estimator runs: the EstimatorSpec's tensors and ops
(loss, train_op, predictions, metrics, export outputs, TPU `eval_metrics`
and `host_call`), the tensors its hooks and scaffold hold, and the graph's
collections (summaries, update ops, ...), with everything they depend on.
"""

from typing import Any, Iterable, List, Set

import tensorflow as tf

from replicate import _graph

# How deep inside a spec's objects (hooks, export outputs, scaffold) tensors
# are looked for: an attribute of an attribute of the spec's field.
_OBJECT_DEPTH = 3


def _ops_in(value: Any, depth: int, seen: Set[int],
            found: List[tf.Operation]) -> None:
  """Appends the ops of the tensors and ops in `value` (a nest or object)."""
  if id(value) in seen or value is None or isinstance(
      value, (str, bytes, int, float, bool, tf.Graph, tf.Variable)):
    return
  seen.add(id(value))
  if isinstance(value, tf.Operation):
    found.append(value)
  elif tf.is_tensor(value):  # composites (sparse, ragged) included
    found.extend(t.op for t in tf.nest.flatten(value, expand_composites=True))
  elif isinstance(value, dict):
    for item in value.values():
      _ops_in(item, depth, seen, found)
  elif isinstance(value, (list, tuple, set, frozenset)):
    for item in value:
      _ops_in(item, depth, seen, found)
  elif depth > 0 and hasattr(value, "__dict__") and not callable(value):
    for item in vars(value).values():
      _ops_in(item, depth - 1, seen, found)


def _roots(graph: tf.Graph, specs: Iterable[Any]) -> List[tf.Operation]:
  """The ops the Estimator fetches: the specs' and the collections'."""
  found: List[tf.Operation] = []
  seen: Set[int] = set()
  for spec in specs:
    for field in spec._fields:
      _ops_in(getattr(spec, field), _OBJECT_DEPTH, seen, found)
  for key in graph.get_all_collection_keys():
    _ops_in(graph.get_collection(key), 0, seen, found)
  return found


def run_by_the_step(
    graph: tf.Graph, specs: Iterable[Any],
    extra: Iterable[Any] = ()) -> Set[str]:
  """Names of the ops that what the step fetches depends on (see above).

  `extra`: more tensors (nests) the step fetches.
  """
  pending = _roots(graph, specs)
  found: List[tf.Operation] = []
  seen: Set[int] = set()
  _ops_in(list(extra), 0, seen, found)
  pending.extend(found)
  return {op.name for op in _graph.walk(pending, _graph.input_and_control_ops)}
