"""What a graph holds that a model_fn call reads or builds under: its
control-flow context and control dependencies, its collections, names in
use and variable store, Keras' and the variable scopes' name counters, and
a dict of ours kept on the graph.

A model_fn call reads its graph's collections (`Graph._collections`), the
variable store `get_variable` looks in (the `_VariableStore` kept in the
graph's collection `__variable_store`, its `_vars` and `_partitioned_vars`)
and the names in use (`Graph._names_in_use`, lowercased name -> count).
`_towers.views` gives each tower's call one device's view of them.
"""

import functools
import importlib
from typing import Any, Dict, List, Optional, Tuple

import tensorflow as tf

# pylint: disable=protected-access,g-direct-tensorflow-import,g-import-not-at-top
from tensorflow.python.ops import variable_scope as _variable_scope

from replicate._tf import estimator_compat
from replicate._tf import graph_edits


@functools.lru_cache(maxsize=None)
def _keras_backend() -> Optional[Any]:
  """The private backend of the Keras 2 behind tf.keras (keras.src.backend
  up to TensorFlow 2.15, tf_keras.src.backend from 2.16), None if absent.
  Looked up at first use, after `estimator_compat` has chosen Keras 2."""
  try:
    return importlib.import_module(estimator_compat.keras_2_package() +
                                   ".src.backend")
  except ImportError:  # Keras moved or is absent.
    return None


def in_v1_control_flow(graph: tf.Graph) -> bool:
  """Whether ops built now in `graph` sit in a v1 tf.cond / tf.while_loop
  (Graph._get_control_flow_context)."""
  return graph._get_control_flow_context() is not None


def op_in_v1_control_flow(op: tf.Operation) -> bool:
  """Whether `op` sits in a v1 tf.cond / tf.while_loop
  (Operation._get_control_flow_context)."""
  return op._get_control_flow_context() is not None


def active_control_inputs(graph: tf.Graph) -> bool:
  """Whether ops built now get control inputs, in `graph` or an outer one
  (Graph._current_control_dependencies)."""
  while graph is not None:
    if graph._current_control_dependencies():
      return True
    graph = getattr(graph, "outer_graph", None)
  return False


def graph_store(graph: tf.Graph, name: str) -> Dict[Any, Any]:
  """A dict of ours held by `graph` (an attribute set on the graph)."""
  store = getattr(graph, "_replicate_store", None)
  if store is None:
    store = {}
    graph._replicate_store = store
  return store.setdefault(name, {})


class NameCounters:
  """Keras' layer-name counters and the variable scopes' default-name counts.

  Keras names layers `dense`, `dense_1`, ... and variable scopes opened
  with a default name are numbered alike, by counters kept per graph
  (the Keras 2 backend's uid map and OBSERVED_NAMES, the variable scope
  store's counts). Taken before the towers and put back at each tower's
  start, every tower names its layers as the unwrapped model_fn does.
  """

  def __init__(self) -> None:
    backend = _keras_backend()
    if backend is not None:
      self._uids = dict(backend.get_default_graph_uid_map())
      self._observed = set(backend.OBSERVED_NAMES)
    self._scopes = dict(
        _variable_scope.get_variable_scope_store().variable_scopes_count)

  def restore(self) -> None:
    backend = _keras_backend()
    if backend is not None:
      uids = backend.get_default_graph_uid_map()
      uids.clear()
      uids.update(self._uids)
      backend.OBSERVED_NAMES.clear()
      backend.OBSERVED_NAMES.update(self._observed)
    counts = _variable_scope.get_variable_scope_store().variable_scopes_count
    counts.clear()
    counts.update(self._scopes)


def collections(graph: tf.Graph) -> Dict[Any, List[Any]]:
  """`graph`'s collections, key -> list (Graph._collections, the dict)."""
  return graph._collections


def set_collections(graph: tf.Graph, value: Dict[Any, List[Any]]) -> None:
  """Makes `value` `graph`'s collections (Graph._collections)."""
  graph._collections = value


def names_in_use(graph: tf.Graph) -> Dict[str, int]:
  """`graph`'s names in use, lowercased (Graph._names_in_use, the dict)."""
  return graph._names_in_use


def variable_store(graph: tf.Graph) -> Any:
  """The store `get_variable` keeps `graph`'s variables in, made if absent
  (variable_scope._get_default_variable_store)."""
  with graph.as_default():
    return _variable_scope._get_default_variable_store()


def store_contents(store: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """A variable store's variables and partitioned variables by name
  (_VariableStore._vars and _partitioned_vars, the dicts)."""
  return store._vars, store._partitioned_vars


def set_store_contents(store: Any, contents: Tuple[Dict[str, Any],
                                                   Dict[str, Any]]) -> None:
  """Makes `contents` (as `store_contents` returns) the store's."""
  store._vars, store._partitioned_vars = contents


def share_variable(variable: Any, shared: Any) -> None:
  """Makes every op using `variable` (but its own initialization) use
  `shared` instead: its handle's, or a reference variable's ref tensor's,
  consumers read `shared`'s."""
  own = variable.op.name + "/"
  keep = [
      op for op in variable.op.outputs[0].consumers() if op.name.startswith(own)
  ]
  graph_edits.rewire(variable.op.outputs[0], shared.op.outputs[0], keep)
