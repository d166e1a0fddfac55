"""Where a replicated model_fn stands while its towers are built.

`Replication` is what every tower of one call needs to know (devices, each
tower's share of the batch, tower 0's scopes and variables); the current
one, and the current `Tower`, are kept per thread and per graph.
"""

import contextlib
import dataclasses
import threading
from typing import Any, Dict, List, NamedTuple, Optional

import tensorflow as tf


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
  loss_reduction: str
  fractions: List[Any]          # each tower's share of the batch
  sizes: List[Any]              # each tower's number of examples
  graph: tf.Graph
  # Per tower: False where it computes on a phantom row (see _split); bools,
  # or bool tensors where the batch size is dynamic. Empty: every tower.
  valid: List[Any] = dataclasses.field(default_factory=list)
  root_name_scope: str = ""
  root_variable_scope: Any = None
  tower: Optional[Tower] = None
  # Per tower: variable creation key -> variable.
  created: List[Dict[Any, tf.Variable]] = dataclasses.field(default_factory=list)
  # True while variables are created for no tower (gradient apply, sinks).
  unshared: bool = False
  # Names of the ops that apply the whole batch's gradients (tower 0's).
  apply_ops: set = dataclasses.field(default_factory=set)
  # Where inputs are split and results merged; None with one tower.
  hub: Optional[str] = None
  # Each tower's device.
  devices: List[str] = dataclasses.field(default_factory=list)
  # Whether batch normalization in training uses the whole batch's statistics.
  sync_batch_norm: bool = True
  # Per-tower collections as they were before tower 0 (each tower sees these
  # and its own additions).
  collections_before: Dict[str, List[Any]] = dataclasses.field(
      default_factory=dict)
  # The combined loss built for each tuple of tower losses (see _loss).
  combined_losses: Dict[Any, Any] = dataclasses.field(default_factory=dict)
  # The whole batch's gradients handed to the towers (tensor refs).
  whole_batch_gradients: set = dataclasses.field(default_factory=set)
  # How many TowerOptimizer.apply_gradients calls tower 0 made.
  apply_calls: int = 0
  # Per tower: the (features, labels) shard of the batch it was given.
  inputs: List[Any] = dataclasses.field(default_factory=list)
  # Per tower: the ops its model_fn call built.
  tower_ops: List[List[tf.Operation]] = dataclasses.field(default_factory=list)
  # Names of the ops that split the batch, and of every tower's ops.
  split_op_names: set = dataclasses.field(default_factory=set)
  tower_op_names: set = dataclasses.field(default_factory=set)
  # Tensor ref of a tower's rows of a whole-batch result -> (the result,
  # the tower's index); see _host_relu.
  host_rows: Dict[Any, Any] = dataclasses.field(default_factory=dict)
  # Ref of a variable's copy shared by the towers (and of a reference
  # variable itself) -> the variable's own read (see
  # _sharing.read_once_per_step).
  shared_copies: Dict[Any, Any] = dataclasses.field(default_factory=dict)

  @contextlib.contextmanager
  def unshared_creation(self):
    """Variables created inside belong to no tower (never shared)."""
    self.unshared = True
    try:
      yield
    finally:
      self.unshared = False

  def fraction(self, index: Optional[int] = None):
    return self.fractions[self.tower.index if index is None else index]

  def size(self, index: Optional[int] = None):
    return self.sizes[self.tower.index if index is None else index]

  def is_valid(self, index: Optional[int] = None):
    """Whether the tower holds real examples: True, False or a bool tensor.

    A tower that does not (a non-empty batch smaller than the number of
    towers) computes on a phantom row, which nothing of it may leak into.
    """
    index = self.tower.index if index is None else index
    return self.valid[index] if self.valid else True

  @property
  def validity(self) -> List[Any]:
    """Every tower's `is_valid`, in tower order."""
    return [self.is_valid(index) for index in range(self.num_towers)]

  @contextlib.contextmanager
  def scopes(self, scopes: "Scopes"):
    """Builds in `scopes` on the hub, unshared, recorded as apply ops.

    Tower 0 applies the gradients where it made the optimizer call, so slot
    variables and update ops get the unreplicated model's names, and
    variables created there are not tower 0's to share.
    """
    first_op = len(self.graph.get_operations())
    # On the consolidation device, so that e.g. learning-rate tensors are
    # not sent there from a tower every step; per-variable updates stay
    # with their variables (TensorFlow colocates them).
    try:
      with self.unshared_creation(), \
          tf.compat.v1.variable_scope(scopes.variable_scope), \
          absolute_name_scope(self.graph, scopes.name_scope), \
          self.graph.device(self.hub):
        yield
    finally:
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


def in_v1_control_flow(graph: tf.Graph) -> bool:
  """Whether ops built now in `graph` sit in a v1 tf.cond / tf.while_loop.

  (v2 control flow and tf.function build in graphs of their own.)
  """
  # Private: Graph._get_control_flow_context is the only way to see it.
  return graph._get_control_flow_context() is not None  # pylint: disable=protected-access


def absolute_name_scope(graph: tf.Graph, scope: str):
  """Enters name scope `scope` exactly ('' is the top level)."""
  return graph.name_scope(scope + "/" if scope else None)


_local = threading.local()


def graph_store(graph: tf.Graph, name: str) -> Dict[Any, Any]:
  """A dict of ours that lives exactly as long as `graph`.

  The graph holds it. A module-level map keyed weakly by graph would not
  do: its values (functions over the graph's tensors, optimizers holding
  its variables) reach the graph and would keep every graph alive.
  """
  with _store_lock:  # towers build on threads of their own
    store = getattr(graph, "_replicate_store", None)
    if store is None:
      store = {}
      graph._replicate_store = store  # pylint: disable=protected-access
    return store.setdefault(name, {})


_store_lock = threading.Lock()


def current_replication() -> Optional[Replication]:
  """The replication being built on this thread, if any."""
  stack = getattr(_local, "stack", None)
  if not stack:
    return None
  replication = stack[-1]
  if replication.graph is not tf.compat.v1.get_default_graph():
    return None
  return replication


def replication_on_thread() -> Optional[Replication]:
  """The replication this thread builds, whatever graph is the default."""
  stack = getattr(_local, "stack", None)
  return stack[-1] if stack else None


def current_tower() -> Optional[Tower]:
  """The tower being built, inside a replicated model_fn; None outside one.

  A model_fn can use it to do some work in one tower only, e.g. write
  summaries where `replicate.current_tower().index == 0`.

  Returns:
    A `Tower` with `index`, `num_towers` and `device`, or None.
  """
  replication = current_replication()
  return replication.tower if replication is not None else None


_PER_TOWER_COLLECTIONS = (tf.compat.v1.GraphKeys.UPDATE_OPS,
                          tf.compat.v1.GraphKeys.LOSSES)


@contextlib.contextmanager
def replication_scope(replication: Replication):
  """Makes `replication` current on this thread; records the root scopes."""
  if current_replication() is not None:
    raise ValueError(
        "replicate_model_fn was called inside another replicated model_fn; "
        "wrap a model_fn once, not a model_fn that is already replicated.")
  replication.root_name_scope = replication.graph.get_name_scope()
  replication.root_variable_scope = tf.compat.v1.get_variable_scope()
  replication.collections_before = {
      key: replication.graph.get_collection(key)
      for key in _PER_TOWER_COLLECTIONS}
  with on_tower_thread(replication):
    yield replication


@contextlib.contextmanager
def on_tower_thread(replication: Replication):
  """Makes `replication` current on this thread (a tower's)."""
  stack = _local.__dict__.setdefault("stack", [])
  stack.append(replication)
  try:
    yield replication
  finally:
    stack.pop()
