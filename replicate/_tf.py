"""Every private TensorFlow and Keras access of the library, named.

TensorFlow has no public API to rewire an op's input after it is built,
to read a function call's body, to see a graph's control-flow context or
its per-thread scope stacks, to reach Keras' name counters, a Keras
optimizer's own name, step counter and gradient computation, an
Estimator's warm-start settings, or the checkpoint dependencies of an
object wrapping an optimizer. Public TensorFlow functions the towers route
(`tf.gradients`, `GradientTape.gradient`, optimizer methods,
`embedding_lookup`, tf.nn's moments, `tf.shape`, `Graph.name_scope`) are
patched only here, through `Patches`, while towers are built. Each access
below says what it reads or changes and was checked on TensorFlow 2.13,
2.14 and 2.15 (with Keras and tensorflow_estimator of the same line);
nothing else in the library touches a private name or patches an
attribute (tests/test_layout.py checks).
"""

import contextlib
import re
import sys
import threading
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
)

from absl import logging
import tensorflow as tf

# pylint: disable=protected-access,g-direct-tensorflow-import,g-import-not-at-top
from tensorflow.core.framework import attr_value_pb2 as _attr_value_pb2
from tensorflow.python.ops import array_ops as _array_ops
from tensorflow.python.ops import gradients_util as _gradients_util
from tensorflow.python.ops import nn_impl as _nn_impl
from tensorflow.python.ops import variable_scope as _variable_scope
from tensorflow.python.ops.variables import PartitionedVariable

try:
  from keras.src import backend as _keras_backend
except ImportError:  # Keras moved or is absent.
  _keras_backend = None

__all__ = ["PartitionedVariable"]

# ------------------------------------------------------------ graph edits


def update_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
  """Makes `op` read `tensor` as its input `index` (Operation._update_input)."""
  op._update_input(index, tensor)


def add_control_input(op: tf.Operation, control: tf.Operation) -> None:
  """Makes `op` run after `control` (Operation._add_control_input)."""
  op._add_control_input(control)


def remove_control_inputs(op: tf.Operation,
                          drop: Iterable[tf.Operation]) -> None:
  """Makes `op` no longer wait for the ops in `drop`
  (Operation._remove_all_control_inputs, then _add_control_inputs)."""
  dropped = set(drop)
  kept = [c for c in op.control_inputs if c not in dropped]
  op._remove_all_control_inputs()
  op._add_control_inputs(kept)


def op_id(op: tf.Operation) -> int:
  """The position of `op` in its graph, in order of creation (Operation._id)."""
  return op._id


def control_outputs(op: tf.Operation) -> List[tf.Operation]:
  """The ops that run after `op` (Operation._control_outputs)."""
  return list(op._control_outputs)


def replace_colocation(op: tf.Operation, renamed: Dict[bytes, bytes]) -> bool:
  """Makes `op` colocated with renamed ops (its `_class` attribute, through
  Operation._set_attr); returns whether it changed."""
  if "_class" not in op.node_def.attr:
    return False
  groups = list(op.get_attr("_class"))
  changed = [renamed.get(g, g) for g in groups]
  if changed == groups:
    return False
  op._set_attr(
      "_class",
      _attr_value_pb2.AttrValue(
          list=_attr_value_pb2.AttrValue.ListValue(s=changed)))
  return True


def set_device(op: tf.Operation, device: str) -> None:
  """Places `op` on `device` after it is built (Operation._set_device)."""
  op._set_device(device)


def rewire(tensor: tf.Tensor,
           replacement: tf.Tensor,
           keep: Sequence[tf.Operation] = ()) -> int:
  """Every consumer of `tensor` but `keep` reads `replacement` instead.

  Returns how many inputs changed.
  """
  kept = set(keep)
  changed = 0
  for consumer in list(tensor.consumers()):
    if consumer in kept:
      continue
    for index, value in enumerate(consumer.inputs):
      if value is tensor:
        update_input(consumer, index, replacement)
        changed += 1
  return changed


def unknown_shapes_attr(shapes: Iterable[Any]) -> Any:
  """An AttrValue listing `shapes` (TensorShapeProtos) with unknown sizes."""
  relaxed = [
      tf.TensorShape(None) if s.unknown_rank else tf.TensorShape([None] *
                                                                 len(s.dim))
      for s in shapes
  ]
  return _attr_value_pb2.AttrValue(
      list=_attr_value_pb2.AttrValue.ListValue(
          shape=[shape.as_proto() for shape in relaxed]))


# ------------------------------------------------------------ graph state


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


def function_bodies(op: tf.Operation) -> Optional[List[Any]]:
  """The FuncGraphs a function-call op runs, or None where unknown.

  cond_v2 keeps its branches on the If op (`_true_graph`, `_false_graph`);
  other calls name functions of the graph's library, whose entries keep
  the graph they were traced from (`Graph._get_function(...).graph`).
  """
  if op.type in ("If", "StatelessIf") and hasattr(op, "_true_graph"):
    return [op._true_graph, op._false_graph]
  names: List[str] = []
  for attr in ("then_branch", "else_branch", "cond", "body", "f", "branches"):
    try:
      value = op.get_attr(attr)
    except ValueError:
      continue
    values = value if isinstance(value, list) else [value]
    names.extend(v.name for v in values)
  if not names:
    return None
  graph = op.graph
  bodies = []
  for name in names:
    function = graph._get_function(name)
    body = getattr(function, "graph", None)
    if body is None:
      return None
    bodies.append(body)
  return bodies


# Attributes of a node that name the functions it calls.
_CALL_ATTRIBUTES = ("then_branch", "else_branch", "cond", "body", "f",
                    "branches")


def function_on_device(graph: tf.Graph,
                       name: str,
                       suffix: str,
                       device: str,
                       copied: Optional[Dict[str, str]] = None) -> str:
  """A copy of `graph`'s function `name` (and of those it calls) whose ops
  are placed on `device`; returns the copy's name, `name` + `suffix`.

  A function body's ops keep the devices they were traced under; a call
  copied onto another device runs them there only in such a copy. Reads
  the function's definition (`Graph._get_function(name).definition`) and
  adds the copy to the graph's library through the C API
  (`TF_FunctionImportFunctionDef`, `TF_GraphCopyFunction` on
  `Graph._c_graph`).
  """
  from tensorflow.core.framework import function_pb2
  from tensorflow.python.client import pywrap_tf_session
  copied = {} if copied is None else copied
  if name in copied:
    return copied[name]
  definition = function_pb2.FunctionDef()
  definition.CopyFrom(graph._get_function(name).definition)
  new = f"{name}{suffix}"
  copied[name] = new
  definition.signature.name = new
  for node in definition.node_def:
    node.device = device
    if "_class" in node.attr:
      # Colocation with the original body's ops: the copy's are its own.
      del node.attr["_class"]
    for attribute in _CALL_ATTRIBUTES:
      if attribute not in node.attr:
        continue
      value = node.attr[attribute]
      if value.HasField("func"):
        value.func.name = function_on_device(graph, value.func.name, suffix,
                                             device, copied)
      for function in value.list.func:
        function.name = function_on_device(graph, function.name, suffix, device,
                                           copied)
  imported = pywrap_tf_session.TF_FunctionImportFunctionDef(
      definition.SerializeToString())
  try:
    pywrap_tf_session.TF_GraphCopyFunction(graph._c_graph, imported, None)
  finally:
    pywrap_tf_session.TF_DeleteFunction(imported)
  return new


def called_functions(op: tf.Operation) -> Dict[str, Any]:
  """`op`'s attributes naming functions it calls: name -> AttrValue."""
  return {
      name: value
      for name, value in op.node_def.attr.items()
      if name in _CALL_ATTRIBUTES and
      (value.HasField("func") or value.list.func)
  }


# ------------------------------------------------- name counters of a graph


class NameCounters:
  """Keras' layer-name counters and the variable scopes' default-name counts.

  Keras names layers `dense`, `dense_1`, ... and variable scopes opened
  with a default name are numbered alike, by counters kept per graph
  (keras.src.backend's uid map and OBSERVED_NAMES, the variable scope
  store's counts). Taken before the towers and put back at each tower's
  start, every tower names its layers as the unwrapped model_fn does.
  """

  def __init__(self) -> None:
    if _keras_backend is not None:
      self._uids = dict(_keras_backend.get_default_graph_uid_map())
      self._observed = set(_keras_backend.OBSERVED_NAMES)
    self._scopes = dict(
        _variable_scope.get_variable_scope_store().variable_scopes_count)

  def restore(self) -> None:
    if _keras_backend is not None:
      uids = _keras_backend.get_default_graph_uid_map()
      uids.clear()
      uids.update(self._uids)
      _keras_backend.OBSERVED_NAMES.clear()
      _keras_backend.OBSERVED_NAMES.update(self._observed)
    counts = _variable_scope.get_variable_scope_store().variable_scopes_count
    counts.clear()
    counts.update(self._scopes)


# ------------------------------------------ graph state a model_fn reads
# A model_fn call reads its graph's collections (`Graph._collections`), the
# variable store `get_variable` looks in (the `_VariableStore` kept in the
# graph's collection `__variable_store`, its `_vars` and `_partitioned_vars`)
# and the names in use (`Graph._names_in_use`, lowercased name -> count).
# `_towers.views` gives each tower's call one device's view of them.


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
  rewire(variable.op.outputs[0], shared.op.outputs[0], keep)


# --------------------------------------------------------- shape functions


def install_unfolded_shapes() -> List[Any]:
  """Makes `tf.shape` / `tf.size` of a static tensor build Shape / Size ops.

  TensorFlow folds them into constants (array_ops.shape_internal and
  size_internal with `optimize=True`), where a shard's size would pass
  for a number that is the same in every tower. Returns what to restore:
  (module, name, original) triples.
  """
  shape_internal = _array_ops.shape_internal
  size_internal = _array_ops.size_internal

  def shape(  # pylint: disable=redefined-builtin
      input: Any,
      name: Optional[str] = None,
      optimize: bool = True,
      out_type: Optional[tf.DType] = None) -> tf.Tensor:
    del optimize
    if out_type is None:
      return shape_internal(input, name, optimize=False)
    return shape_internal(input, name, optimize=False, out_type=out_type)

  def size(  # pylint: disable=redefined-builtin
      input: Any,
      name: Optional[str] = None,
      optimize: bool = True,
      out_type: tf.DType = tf.int32) -> tf.Tensor:
    del optimize
    return size_internal(input, name, optimize=False, out_type=out_type)

  _array_ops.shape_internal = shape
  _array_ops.size_internal = size
  return [(_array_ops, "shape_internal", shape_internal),
          (_array_ops, "size_internal", size_internal)]


class _TowerRoots(threading.local):
  """The name scope a tower built before tower 0 puts absolute scopes in,
  and the name segment (`tower_i`) its names carry that one device's
  names do not."""
  graph: Optional[tf.Graph] = None
  root: Optional[str] = None
  segment: Optional[str] = None
  # Called before the tower's call reads a collection.
  before_read: Optional[Callable[[], None]] = None
  bypass = 0


_roots = _TowerRoots()
_GRAPH_NAME_SCOPE = tf.Graph.name_scope


def _rooted_name_scope(self: tf.Graph, name: Optional[str]) -> Any:
  """Graph.name_scope, with the top level of the graph a tower's scope.

  The tower's own segment as a name re-enters the current scope: that is
  what entering the tower's variable scope object again opens (one
  device's top-level variable scope opens none).
  """
  root = _roots.root
  if self is _roots.graph and root and not _roots.bypass:
    if not name:
      name = root + "/"
    elif name == _roots.segment:
      current = tf.Graph.get_name_scope(self)
      name = current + "/" if current else None
    elif name.endswith("/") and not (name == root + "/" or
                                     name.startswith(root + "/")):
      name = root + "/" + name
  return _GRAPH_NAME_SCOPE(self, name)


def without_segment(name: str, segment: str) -> str:
  """`name` without its path components equal to `segment` (`tower_1`), nor
  empty ones (a variable scope '' inside a tower's adds one); a trailing
  '/' (an absolute name scope) is kept."""
  parts = [part for part in name.split("/") if part and part != segment]
  return "/".join(parts) + ("/" if parts and name.endswith("/") else "")


_GRAPH_GET_COLLECTION = tf.Graph.get_collection


def _towerless_get_collection(self: tf.Graph,
                              name: Any,
                              scope: Optional[str] = None) -> List[Any]:
  """Graph.get_collection, a scope matched as one device's names match it.

  In a tower built before tower 0, ops are named `tower_i/...` and the
  variables it shares are not; a scope is matched against names without
  the tower's segment, and the scope itself (from the tower's variable or
  name scope) is taken without it too, so that both match as on one device.
  """
  if self is not _roots.graph:
    return _GRAPH_GET_COLLECTION(self, name, scope)
  if _roots.before_read is not None:
    _roots.before_read()
  segment = _roots.segment
  if scope is None or not segment:
    return _GRAPH_GET_COLLECTION(self, name, scope)
  regex = re.compile(without_segment(scope, segment))
  found = []
  for item in _GRAPH_GET_COLLECTION(self, name):
    item_name = getattr(item, "name", None)
    if isinstance(item_name, str) and regex.match(
        without_segment(item_name, segment)):
      found.append(item)
  return found


def install_tower_roots() -> List[Any]:
  """Graph.name_scope sends absolute scopes of a tower into the tower's, and
  Graph.get_collection matches scopes without the tower's name segment.

  Model code resets the name scope (`tf.name_scope('')`, an absolute
  `'training/'`: the canned heads do, for Keras' names); in a tower built
  before tower 0 that would take the top-level names tower 0 (the unwrapped
  model's names) needs, so there they go under the tower's scope. Returns
  what to restore.
  """
  return [
      patch(tf.Graph, "name_scope", _rooted_name_scope),
      patch(tf.Graph, "get_collection", _towerless_get_collection),
      patch(tf.Graph, "get_collection_ref", _read_collection_ref),
  ]


_GRAPH_GET_COLLECTION_REF = tf.Graph.get_collection_ref


def _read_collection_ref(self: tf.Graph, name: Any) -> List[Any]:
  """Graph.get_collection_ref, after the tower's `before_read`."""
  if self is _roots.graph and _roots.before_read is not None:
    _roots.before_read()
  return _GRAPH_GET_COLLECTION_REF(self, name)


@contextlib.contextmanager
def tower_root(graph: tf.Graph, root: Optional[str], segment: Optional[str],
               before_read: Callable[[], None]) -> Iterator[None]:
  """Inside, `graph`'s absolute name scopes go under `root`, scoped
  collection reads ignore the name segment `segment`, and `before_read()`
  runs before a collection is read (see above)."""
  before = (_roots.graph, _roots.root, _roots.segment, _roots.before_read)
  (_roots.graph, _roots.root, _roots.segment,
   _roots.before_read) = graph, root, segment, before_read
  try:
    yield
  finally:
    (_roots.graph, _roots.root, _roots.segment, _roots.before_read) = before


@contextlib.contextmanager
def top_level_name_scopes() -> Iterator[None]:
  """Inside, absolute name scopes are the graph's own again."""
  _roots.bypass += 1
  try:
    yield
  finally:
    _roots.bypass -= 1


NN_IMPL = _nn_impl

# ------------------------------------------------------------ optimizers


def optimizer_name(optimizer: Any) -> str:
  """A Keras legacy optimizer's own name (`_name`: its scopes use it)."""
  return optimizer._name


def keras_iterations(optimizer: Any) -> Any:
  """A Keras legacy optimizer's step counter as set, created or not
  (`_iterations`: the public `iterations` creates it); None if unset."""
  return getattr(optimizer, "_iterations", None)


def keras_compute_gradients(optimizer: Any, loss: Any, **kwargs: Any) -> Any:
  """The (gradient, variable) pairs a Keras legacy optimizer's `minimize`
  applies (`_compute_gradients`: its clipping and transformers included)."""
  return optimizer._compute_gradients(loss, **kwargs)


# ------------------------------------------------------------ estimators


def warm_start_settings(estimator: Any) -> Any:
  """What an Estimator was given as `warm_start_from` (`_warm_start_settings`:
  it keeps no public copy); None for anything else."""
  return getattr(estimator, "_warm_start_settings", None)


def canned_optimizer(name_or_optimizer: Any, learning_rate: float) -> Any:
  """tensorflow_estimator's optimizer for a canned estimator's optimizer
  name (`canned.optimizers.get_optimizer_instance`, v1)."""
  from tensorflow_estimator.python.estimator.canned import optimizers
  return optimizers.get_optimizer_instance(name_or_optimizer, learning_rate)


def canned_optimizer_v2(name_or_optimizer: Any, learning_rate: Any) -> Any:
  """As `canned_optimizer`, for the v2 canned estimators (Keras optimizers)."""
  from tensorflow_estimator.python.estimator.canned import optimizers
  return optimizers.get_optimizer_instance_v2(name_or_optimizer, learning_rate)


# ------------------------------------------------------------ patches
# Public TensorFlow functions and methods (tf.gradients, GradientTape.gradient,
# optimizer methods, embedding_lookup, tf.nn's moments, tf.shape, name_scope)
# are routed while the towers are built. Several model_fns may build at once
# (threads, nested graphs), so each set of patches is installed by the first
# to enter and restored by the last to leave.

# (owner, attribute name, original value), as an install function sets them.
Patched = List[Tuple[Any, str, Any]]

# Per thread: the function summing a variable's gradient terms, or None.
_gradient_sums = threading.local()


@contextlib.contextmanager
def gradient_terms_summed_by(
    sum_terms: Callable[[tf.Operation, List[Any]], Optional[Any]]
) -> Iterator[None]:
  """Inside, `tf.gradients` asks `sum_terms(op, terms)` for the gradient of
  an op's only output with several terms, before adding them itself; a
  None answer leaves the terms to TensorFlow. Needs `GRADIENT_TERMS`
  applied."""
  before = getattr(_gradient_sums, "current", None)
  _gradient_sums.current = sum_terms
  try:
    yield
  finally:
    _gradient_sums.current = before


def install_gradient_terms() -> Patched:
  """Routes gradients_util._AggregatedGrads, where `tf.gradients` adds the
  terms of each op's output gradient (an AddN colocated with the op)."""
  original = _gradients_util._AggregatedGrads

  def aggregated(grads: Dict[Any, Any], op: tf.Operation, *args: Any,
                 **kwargs: Any) -> Any:
    sum_terms = getattr(_gradient_sums, "current", None)
    loop_state = args[1] if len(args) > 1 else kwargs.get("loop_state")
    terms = grads.get(op)
    if (sum_terms is not None and not loop_state and terms is not None and
        len(terms) == 1 and isinstance(terms[0], list) and terms[0]):
      summed = sum_terms(op, list(terms[0]))
      if summed is not None:
        terms[0] = summed
        return terms
    return original(grads, op, *args, **kwargs)

  return [patch(_gradients_util, "_AggregatedGrads", aggregated)]


def patch(owner: Any, name: str, value: Any) -> Tuple[Any, str, Any]:
  """Sets `owner.name` to `value`; returns what `Patches` restores."""
  original = owner.__dict__.get(name)
  setattr(owner, name, value)
  return (owner, name, original)


def rebind(name: str, original: Any, routed: Any) -> Patched:
  """Binds `routed` wherever a TensorFlow module binds `original` as `name`.

  TensorFlow exports one function under several modules (e.g. `tf.nn.relu`,
  `tf.compat.v1.nn.relu`, `gen_nn_ops.relu`); model code may call any of
  them. Returns what `Patches` restores.
  """
  patched = []
  for module_name, module in list(sys.modules.items()):
    if (module is not None and module_name.startswith("tensorflow") and
        getattr(module, "__dict__", {}).get(name) is original):
      patched.append((module, name, original))
      setattr(module, name, routed)
  return patched


class Patches:
  """One set of patches, installed while any builder is inside `applied()`.

  Args:
    what: what the patches route, for the log line.
    install: sets the patched attributes and returns what they were.
  """

  _every: List["Patches"] = []

  def __init__(self, what: str, install: Callable[[], Patched]):
    self._what = what
    self._install = install
    self._lock = threading.Lock()
    self._count = 0
    self._originals: Patched = []
    Patches._every.append(self)

  @classmethod
  def every(cls) -> List["Patches"]:
    """Every set of patches made so far (the modules make theirs on
    import)."""
    return list(cls._every)

  @property
  def installed(self) -> bool:
    """Whether a builder is inside `applied()` now."""
    return self._count > 0

  @property
  def what(self) -> str:
    return self._what

  @contextlib.contextmanager
  def applied(self, needed: bool = True) -> Iterator[None]:
    """Installed inside (by the first builder to enter), unless not needed."""
    if not needed:
      yield
      return
    with self._lock:
      if not self._count:
        self._originals = self._install()
        logging.info("replicate: %s routed (%d attributes)", self._what,
                     len(self._originals))
      self._count += 1
    try:
      yield
    finally:
      with self._lock:
        self._count -= 1
        if not self._count:
          for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
          self._originals = []


# ------------------------------------------------------------ checkpoints
# An optimizer wrapper is a Trackable of its own; an object-based checkpoint
# (Keras' model_to_estimator Saver, tf.train.Checkpoint) would save what the
# wrapper tracks (nothing). `TracksWrapped` hands checkpoints the wrapped
# optimizer's dependencies as the wrapper's own, through Trackable's
# protected hooks (no public API; Keras' LossScaleOptimizer overrides the same).


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
