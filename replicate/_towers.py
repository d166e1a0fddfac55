"""Building the towers: one call of the user's model_fn per device.

Each tower builds under its own name scope (none for tower 0, `tower_i/`
after), its own device function, and a variable creator that hands later
towers the variables tower 0 created, so that one set of model variables is
shared whatever API created them (get_variable, tf.compat.v1.layers or Keras
layers, which ignore variable-scope reuse).
"""

import collections
import contextlib
import dataclasses
import re
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import tensorflow as tf
from absl import logging
# Variable-scope name counters have no public accessor.
from tensorflow.python.ops import variable_scope as variable_scope_lib  # pylint: disable=g-direct-tensorflow-import


class Tower(NamedTuple):
  """Where a model_fn call stands: returned by `replicate.current_tower()`.

  Attributes:
    index: the tower's position, 0 to `num_towers - 1`.
    num_towers: how many towers the batch is split over.
    device: the tower's device string, e.g. '/device:GPU:1'; None where the
      graph is built for serving and pins no device.
  """
  index: int
  num_towers: int
  device: Optional[str]


@dataclasses.dataclass
class Replication:
  """One call of a replicated model_fn: what every tower needs to know."""
  num_towers: int
  devices: List[str]
  loss_reduction: str
  fractions: List[Any]          # each tower's share of the batch
  sizes: List[Any]              # each tower's number of examples
  graph: tf.Graph
  root_name_scope: str = ""
  root_variable_scope: Any = None
  tower: Optional[Tower] = None
  # Per tower: variable creation key -> variable, and variable -> key.
  created: List[Dict[Any, tf.Variable]] = dataclasses.field(default_factory=list)
  keys: List[Dict[Any, Any]] = dataclasses.field(default_factory=list)
  # True while the last tower applies gradients under tower 0's scopes.
  in_root_scope: bool = False
  # Names of the ops that apply summed gradients (built in the last tower).
  apply_ops: set = dataclasses.field(default_factory=set)
  # UPDATE_OPS as they were before tower 0: each tower sees these and its own.
  update_ops_before: Optional[List[Any]] = None

  @property
  def is_last_tower(self) -> bool:
    return self.tower.index == self.num_towers - 1

  def fraction(self, index: Optional[int] = None):
    return self.fractions[self.tower.index if index is None else index]

  def size(self, index: Optional[int] = None):
    return self.sizes[self.tower.index if index is None else index]

  @contextlib.contextmanager
  def scopes(self, scopes: "Scopes"):
    """Re-enters `scopes` (recorded in tower 0) to build there, unshared.

    The last tower applies the summed gradients where tower 0 made the same
    optimizer call, so slot variables and update ops get the unreplicated
    model's names, and variables created there are not tower 0's to share.
    """
    self.in_root_scope = True
    first_op = len(self.graph.get_operations())
    try:
      with tf.compat.v1.variable_scope(scopes.variable_scope), \
          _absolute_name_scope(self.graph, scopes.name_scope):
        yield
    finally:
      self.in_root_scope = False
      self.apply_ops.update(
          op.name for op in self.graph.get_operations()[first_op:])


class Scopes(NamedTuple):
  """The name scope and variable scope some code was built under."""
  name_scope: str
  variable_scope: Any

  @classmethod
  def current(cls) -> "Scopes":
    return cls(tf.compat.v1.get_default_graph().get_name_scope(),
               tf.compat.v1.get_variable_scope())


def _absolute_name_scope(graph: tf.Graph, scope: str):
  """Enters name scope `scope` exactly ('' is the top level)."""
  return graph.name_scope(scope + "/" if scope else None)


_local = threading.local()


def current_replication() -> Optional[Replication]:
  """The replication being built on this thread, if any."""
  stack = getattr(_local, "stack", None)
  if not stack:
    return None
  replication = stack[-1]
  if replication.graph is not tf.compat.v1.get_default_graph():
    return None
  return replication


def current_tower() -> Optional[Tower]:
  """The tower being built, inside a replicated model_fn; None outside one.

  A model_fn can use it to do some work in one tower only, e.g. write
  summaries where `replicate.current_tower().index == 0`.

  Returns:
    A `Tower` with `index`, `num_towers` and `device`, or None.
  """
  replication = current_replication()
  return replication.tower if replication is not None else None


@contextlib.contextmanager
def replication_scope(replication: Replication):
  """Makes `replication` current for the duration of the model_fn calls."""
  if current_replication() is not None:
    raise ValueError(
        "replicate_model_fn was called inside another replicated model_fn; "
        "wrap a model_fn once, not a model_fn that is already replicated.")
  replication.root_name_scope = replication.graph.get_name_scope()
  replication.root_variable_scope = tf.compat.v1.get_variable_scope()
  stack = _local.__dict__.setdefault("stack", [])
  stack.append(replication)
  try:
    yield replication
  finally:
    stack.pop()


class NameCounters:
  """Per-graph name counters, restored before every tower.

  Keras names layers `dense`, `dense_1`, ... and variable scopes opened
  with a default name are numbered the same way, by counters kept per
  graph. Restored before each tower, every tower names its layers as tower 0
  did, so tower i finds tower 0's variables and Keras layers line up.
  """

  def __init__(self):
    try:
      from keras.src import backend  # pylint: disable=g-import-not-at-top
    except ImportError:  # Keras moved or is absent: no counters to restore.
      backend = None
    self._keras = backend
    if backend is not None:
      self._uids = dict(backend.get_default_graph_uid_map())
      self._observed = set(backend.OBSERVED_NAMES)
    self._scope_counts = dict(_variable_scope_counts())

  def restore(self):
    if self._keras is not None:
      uids = self._keras.get_default_graph_uid_map()
      uids.clear()
      uids.update(self._uids)
      self._keras.OBSERVED_NAMES.clear()
      self._keras.OBSERVED_NAMES.update(self._observed)
    counts = _variable_scope_counts()
    counts.clear()
    counts.update(self._scope_counts)


def _variable_scope_counts() -> dict:
  """The graph's count of variable scopes opened under each name."""
  store = variable_scope_lib.get_variable_scope_store()
  return store.variable_scopes_count


def _is_model_state(kwargs) -> bool:
  """Whether a variable being created would be saved in checkpoints."""
  collections_ = kwargs.get("collections")
  if collections_ is None:
    return True
  return tf.compat.v1.GraphKeys.GLOBAL_VARIABLES in collections_


def _without_root(name: str, root: str) -> str:
  """`name` with the tower's root scope removed wherever it occurs.

  Keras layers built inside a Keras model also carry the scope they were
  declared in (`tower_1/dnn/tower_1/hiddenlayer_0/kernel`), not only the
  one they are called in.
  """
  if not root:
    return name
  return re.sub(r"(^|/)" + re.escape(root), r"\1", name)


def _variable_creator(replication: Replication, index: int, name_root: str):
  """Returns a creator giving towers after the first tower 0's variables.

  Variables are matched by the name they are asked for (relative to the
  tower's root scope) and how many times that name was asked for before,
  so TensorFlow's own uniquifying of names cannot pair the wrong ones.
  Only checkpointed (global) variables are shared: metric and other local
  variables stay per tower.
  """
  counts = collections.Counter()
  created, keys = replication.created[index], replication.keys[index]
  global_refs = None

  def creator(next_creator, **kwargs):
    nonlocal global_refs
    if replication.in_root_scope:
      return next_creator(**kwargs)
    scope = tf.compat.v1.get_default_graph().get_name_scope()
    name = kwargs.get("name") or "Variable"
    full = f"{scope}/{name}" if scope else name
    relative = _without_root(full, name_root)
    counts[relative] += 1
    key = (relative, counts[relative])
    if index > 0:
      original = replication.created[0].get(key)
      if global_refs is None:
        global_refs = {v.ref() for v in tf.compat.v1.global_variables()}
      if original is not None and original.ref() in global_refs:
        return original
      if _is_model_state(kwargs):
        raise ValueError(
            f"Tower {index} creates variable {full!r} that tower 0 did not "
            f"create (tower 0 created {len(replication.created[0])} "
            "variables); every tower must build the same model, so make the "
            "model_fn create the same variables in every call.")
    variable = next_creator(**kwargs)
    created[key] = variable
    keys[variable.ref()] = key
    return variable

  return creator


def _collection(graph: tf.Graph, key: str) -> List[Any]:
  return graph.get_collection_ref(key)


@contextlib.contextmanager
def _own_collections(replication: Replication, index: int):
  """Keeps the towers' update ops and summaries apart.

  Each tower sees in UPDATE_OPS the ops from before tower 0 and its own, as
  the unwrapped model_fn would. Summaries of towers after the first are
  dropped: TensorBoard shows tower 0's, under the unwrapped model's names.
  """
  graph = replication.graph
  updates = _collection(graph, tf.compat.v1.GraphKeys.UPDATE_OPS)
  if replication.update_ops_before is None:
    replication.update_ops_before = list(updates)
  updates[:] = replication.update_ops_before
  summaries = _collection(graph, tf.compat.v1.GraphKeys.SUMMARIES)
  summaries_before = list(summaries)
  yield
  if index > 0:
    summaries[:] = summaries_before


_STATE_WRITES = frozenset(
    ["AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"])


def _discard_state_writes(replication: Replication, index: int, ops):
  """Redirects tower `index`'s writes to shared model variables.

  Only tower 0 changes model state outside the optimizer: a batch-norm
  layer in tower i > 0 still computes its update, but writes it to a
  private local variable that is never saved or read. So moving statistics
  get one update per step, from tower 0's shard, deterministically, however
  the model_fn ties update ops to its train_op. Reads are left alone.
  """
  global_refs = {v.ref() for v in tf.compat.v1.global_variables()}
  handles = {v.handle.op.name: v for v in replication.created[0].values()
             if v.ref() in global_refs and hasattr(v, "handle")}
  for op in ops:
    if (op.type not in _STATE_WRITES or op.name in replication.apply_ops or
        op.inputs[0].op.name not in handles):
      continue
    variable = handles[op.inputs[0].op.name]
    replication.in_root_scope = True
    try:
      with tf.compat.v1.colocate_with(variable.handle.op, ignore_existing=True), \
          tf.name_scope("discarded_update"):
        sink = tf.compat.v1.Variable(
            lambda v=variable: tf.zeros(v.shape, v.dtype), trainable=False,
            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
            use_resource=True, name="sink")
    finally:
      replication.in_root_scope = False
    # Operations have no public way to change an input once built.
    op._update_input(0, sink.handle)  # pylint: disable=protected-access
    logging.info("replicate: tower %d's write %s to %s is discarded", index,
                 op.name, variable.op.name)


@contextlib.contextmanager
def tower_scope(replication: Replication, index: int,
                device_function: Optional[Callable[[tf.Operation], str]],
                device: Optional[str], name_counters: "NameCounters"):
  """Builds tower `index`: its name scope, reuse, devices and variables."""
  replication.created.append({})
  replication.keys.append({})
  replication.tower = Tower(index, replication.num_towers, device)
  name_counters.restore()
  with contextlib.ExitStack() as stack:
    stack.enter_context(_own_collections(replication, index))
    graph = replication.graph
    if index > 0:
      stack.enter_context(tf.compat.v1.variable_scope(
          replication.root_variable_scope, reuse=True))
      stack.enter_context(
          _absolute_name_scope(graph, replication.root_name_scope))
      name_root = stack.enter_context(graph.name_scope(f"tower_{index}"))
    else:
      name_root = (replication.root_name_scope + "/"
                   if replication.root_name_scope else "")
    if device_function is not None:
      stack.enter_context(tf.compat.v1.device(device_function))
    stack.enter_context(tf.compat.v1.variable_creator_scope(
        _variable_creator(replication, index, name_root)))
    logging.info("replicate: building tower %d of %d on %s", index,
                 replication.num_towers, device or "no pinned device")
    first_op = len(graph.get_operations())
    yield replication.tower
    if index > 0:
      _discard_state_writes(replication, index,
                            graph.get_operations()[first_op:])
