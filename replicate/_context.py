"""Where a replicated model_fn stands while its towers are built.

`Replication` is what every tower of one call needs to know (devices, each
tower's share of the batch, tower 0's scopes and variables); the current
one, and the current `Tower`, are kept per thread and per graph.
"""

import contextlib
import dataclasses
import threading
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Set,
    cast,
)

import tensorflow as tf

from replicate import _tf


class Meets(Protocol):
  """What the stages use of `_meet.meetings.Meetings` (a later stage's
  class, named here by its methods)."""

  def meet(self,
           kind: str,
           value: Any,
           build: Callable[[List[Any]], List[Any]],
           spec: Callable[[Any], Any],
           signature: Any = None) -> Any:
    ...

  def check_complete(self) -> None:
    ...

  def standin_kinds(self, index: int) -> Dict[Any, Any]:
    ...


class Rewires(Protocol):
  """What the stages use of `_meet.rewiring.Rewiring`."""

  def kind(self, tensor: Any, index: int = 0) -> Any:
    ...

  def resolve(self, tensor: Any) -> Any:
    ...

  def reads_whole_batch(self, op: tf.Operation) -> bool:
    ...

  def counterpart(self, tensor0: tf.Tensor, index: int) -> tf.Tensor:
    ...

  def declare(self, tensor: tf.Tensor, kind: Any, index: int = 0) -> None:
    ...

  def pair(self, tensor0: tf.Tensor, index: int, tensor: tf.Tensor) -> None:
    ...

  def whole_size(self, tensor0: tf.Tensor) -> tf.Tensor:
    ...

  def replacements(self) -> Dict[str, tf.Tensor]:
    ...

  def advance(self) -> None:
    ...

  def finish(self, specs: Sequence[Any] = ()) -> None:
    ...


class Views(Protocol):
  """What the stages use of `_towers.views.GraphViews`."""

  def enter(self, prefix: str, home: str, creating: bool) -> None:
    ...

  def leave(self, index: int) -> None:
    ...

  def merge(self) -> None:
    ...

  def lengths(self) -> Dict[Any, int]:
    ...

  def record_created(self, variable: Any, lengths: Dict[Any, int]) -> None:
    ...

  def obtained(self, variable: Any) -> None:
    ...

  def read(self, key: Any = None) -> None:
    ...

  def share_imported(self) -> None:
    ...

  def unseen_variables(self) -> List[Any]:
    ...


@dataclasses.dataclass(frozen=True)
class Tower:
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

  def __iter__(self) -> Iterator[Any]:
    """Unpacks as `index, num_towers, device = tower`."""
    return iter((self.index, self.num_towers, self.device))


@dataclasses.dataclass
class Replication:
  """One call of a replicated model_fn: what every tower needs to know."""
  num_towers: int
  fractions: List[Any]  # each tower's share of the batch
  sizes: List[Any]  # each tower's number of examples
  graph: tf.Graph
  # Per tower: False where it computes on a phantom row (see _prepare.split);
  # bools, or bool tensors where the batch size is dynamic. Empty: every tower.
  valid: List[Any] = dataclasses.field(default_factory=list)
  root_name_scope: str = ""
  tower: Optional[Tower] = None
  # Per tower: variable creation key -> variable.
  created: List[Dict[Any,
                     tf.Variable]] = dataclasses.field(default_factory=list)
  # The tower that creates the variables: the first one built.
  creator: int = 0
  # True while variables are created for no tower (gradient apply, sinks).
  unshared: bool = False
  # Where inputs are split and results merged; None with one tower.
  consolidation_device: Optional[str] = None
  # Each tower's device, as given, and as placed on the consolidation
  # device's task.
  devices: List[str] = dataclasses.field(default_factory=list)
  placed: List[str] = dataclasses.field(default_factory=list)
  # Whether batch normalization in training uses the whole batch's statistics.
  sync_batch_norm: bool = True
  # What each tower's call sees of the graph (`_towers.views.GraphViews`).
  views: "Views" = dataclasses.field(default=cast(Any, None))
  # Per tower: the (features, labels) shard of the batch it was given.
  inputs: List[Any] = dataclasses.field(default_factory=list)
  # Per tower: the ops its model_fn call built (set once the towers are).
  tower_ops: List[List[tf.Operation]] = dataclasses.field(default_factory=list)
  # Names of the ops that split the batch, and of every tower's ops.
  split_op_names: Set[str] = dataclasses.field(default_factory=set)
  tower_op_names: Set[str] = dataclasses.field(default_factory=set)
  # Ref of a variable's copy shared by the towers (and of a reference
  # variable itself) -> the variable's own read (see
  # `_towers.sharing.read_once_per_step`).
  shared_copies: Dict[Any, Any] = dataclasses.field(default_factory=dict)
  # Per tower: [first, end) of the graph versions its model_fn call built.
  ranges: Dict[int,
               List[Optional[int]]] = dataclasses.field(default_factory=dict)
  # [first, end) graph versions of ops the library built (not the model's),
  # and where the ranges still being built began.
  library_ranges: List[List[int]] = dataclasses.field(default_factory=list)
  library_open: List[int] = dataclasses.field(default_factory=list)
  # Names of ops whose statistics stay the tower's (sync_batch_norm=False).
  per_tower_ops: Set[str] = dataclasses.field(default_factory=set)
  # The meetings and the whole-batch rewiring of this call (set by _core).
  meetings: "Meets" = dataclasses.field(default=cast(Any, None))
  rewiring: "Rewires" = dataclasses.field(default=cast(Any, None))
  # How many optimizer updates tower 0's meetings applied.
  apply_calls: int = 0
  # How deep tower 0 is in building meetings (calls inside pass through).
  meeting_depth: int = 0
  # MIRRORED in training: each tower device keeps copies of the trained
  # variables, and the towers meet on tower 0's device, not the
  # consolidation device.
  mirrored: bool = False
  # Gradients summed between the tower devices (`_meet.all_reduce`), in the
  # order they were built.
  mirrored_gradients: List[Any] = dataclasses.field(default_factory=list)
  # True while a meeting's gradients are being summed between the towers.
  summing: bool = False
  # On a cluster of trainers only (no ps): the trainers among which
  # reductions and gradients are all-reduced (`_meet.trainers.Trainers`).
  trainers: Any = None
  # Graph positions [start, end) of what Keras' minimize(loss_fn) recorded
  # (`loss_fn`'s ops, or the user's tape's), in every tower so far.
  recorded: List[Any] = dataclasses.field(default_factory=list)

  @property
  def meeting_device(self) -> Optional[str]:
    """Where meetings combine the towers' values: tower 0's device when the
    variables are mirrored (no round trip through the host), else the
    consolidation device."""
    if self.mirrored and self.placed:
      return self.placed[0]
    return self.consolidation_device

  @contextlib.contextmanager
  def unshared_creation(self) -> Iterator[None]:
    """Variables created inside belong to no tower (never shared)."""
    before = self.unshared
    self.unshared = True
    try:
      yield
    finally:
      self.unshared = before

  @contextlib.contextmanager
  def library(self) -> Iterator[None]:
    """Ops built inside are the library's, not the model's."""
    start = self.graph.version
    self.library_open.append(start)
    try:
      yield
    finally:
      self.library_open.pop()
      end = self.graph.version
      if end > start:
        if self.library_ranges and self.library_ranges[-1][1] == start:
          self.library_ranges[-1][1] = end
        else:
          self.library_ranges.append([start, end])

  def model_ops(self, index: int, since: int = 0) -> List[tf.Operation]:
    """The ops tower `index`'s model_fn built (so far), library's left out."""
    start, stop = self.ranges[index]
    assert start is not None  # _towers.build records [graph.version, None]
    first = max(start, since)
    end: int = self.graph.version if stop is None else stop
    if end <= first:
      return []
    ops = self.graph.get_operations()[first:end]
    holes = [(max(a, first), min(b, end))
             for a, b in self.library_ranges
             if b > first and a < end]
    if not holes:
      return ops
    kept, position = [], first
    for a, b in holes:
      kept.extend(ops[position - first:a - first])
      position = b
    kept.extend(ops[position - first:])
    return kept

  def tower_prefix(self, index: int) -> str:
    """The name prefix of tower `index`'s ops."""
    root = self.root_name_scope + "/" if self.root_name_scope else ""
    return root + (f"tower_{index}/" if index else "")

  def is_per_tower(self, op: tf.Operation) -> bool:
    """Whether `op`'s statistics stay the tower's (sync_batch_norm=False)."""
    if op.name in self.per_tower_ops:
      return True
    return (not self.sync_batch_norm and op.type
            in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"))

  # index=None: the current tower's, so only while a tower is built (`tower`
  # is set then; outside, None has no index). Hence the ignores below.
  def fraction(self, index: Optional[int] = None) -> Any:
    return self.fractions[self.tower.index  # type: ignore[union-attr]
                          if index is None else index]

  def size(self, index: Optional[int] = None) -> Any:
    return self.sizes[self.tower.index  # type: ignore[union-attr]
                      if index is None else index]

  def is_valid(self, index: Optional[int] = None) -> Any:
    """Whether the tower holds real examples: True, False or a bool tensor.

    A tower that does not (a non-empty batch smaller than the number of
    towers) computes on a phantom row, which nothing of it may leak into.
    """
    index = (
        self.tower.index  # type: ignore[union-attr]
        if index is None else index)
    return self.valid[index] if self.valid else True

  @property
  def validity(self) -> List[Any]:
    """Every tower's `is_valid`, in tower order."""
    return [self.is_valid(index) for index in range(self.num_towers)]


def absolute_name_scope(graph: tf.Graph, scope: str) -> ContextManager[Any]:
  """Enters name scope `scope` exactly ('' is the top level)."""
  return graph.name_scope(scope + "/" if scope else None)


@contextlib.contextmanager
def outside(replication: Replication, name_scope: str = "") -> Iterator[None]:
  """Builds in the replication's graph as if outside every tower.

  Outside any tf.cond / tf.while_loop / tf.function body, control
  dependency, device or colocation scope, in name scope `name_scope`: for
  what the library adds between the towers (whole-batch values, stand-ins'
  placeholders), whichever tower's code is being built.
  """
  graph = replication.graph
  with graph.as_default(), graph.control_dependencies(None), \
      graph.device(None), graph.colocate_with(None, ignore_existing=True), \
      absolute_name_scope(graph, name_scope):
    yield


def graph_store(graph: tf.Graph, name: str) -> Dict[Any, Any]:
  """A dict of ours that lives exactly as long as `graph` (held by it).

  A module-level map keyed weakly by graph would not do: its values
  (functions over the graph's tensors, optimizers holding its variables)
  reach the graph and would keep every graph alive.
  """
  return _tf.graph_store(graph, name)


_local = threading.local()


def current_replication() -> Optional[Replication]:
  """The replication being built on this thread, if any."""
  stack = getattr(_local, "stack", None)
  if not stack:
    return None
  replication = stack[-1]
  graph = tf.compat.v1.get_default_graph()
  while graph is not None and graph is not replication.graph:
    graph = getattr(graph, "outer_graph", None)
  return replication if graph is not None else None


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


@contextlib.contextmanager
def replication_scope(replication: Replication) -> Iterator[Replication]:
  """Makes `replication` current on this thread; records the root name
  scope."""
  if current_replication() is not None:
    raise ValueError(
        "replicate_model_fn was called inside another replicated model_fn; "
        "wrap a model_fn once, not a model_fn that is already replicated.")
  replication.root_name_scope = replication.graph.get_name_scope()
  with _current(replication):
    yield replication


@contextlib.contextmanager
def _current(replication: Replication) -> Iterator[Replication]:
  """Makes `replication` current on this thread."""
  stack = _local.__dict__.setdefault("stack", [])
  stack.append(replication)
  try:
    yield replication
  finally:
    stack.pop()
