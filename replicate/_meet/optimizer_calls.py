"""The towers' optimizer calls met: one device's gradients, one update.

`compute_gradients` (and Keras' `get_gradients`) is a meeting
(`_meet.meetings`): tower 0, the last tower to make the call, differentiates the
whole batch's loss once, each gradient op on its forward op's device, and every
tower gets that one device's gradient. Code between `compute_gradients` and
`apply_gradients` (clipping, multipliers, summaries) then computes what it would
on one device. `apply_gradients` is a meeting too: tower 0 applies its gradients
once, in its own scopes, and every tower gets that update as its own.

The whole batch's loss is tower 0's own: every batch reduction a tower
builds has the whole batch's value (`_meet.rewiring`), so a loss computed from
them is one device's in every tower. A loss with rows (a per-example loss
handed to an optimizer, which sums it) is the towers' rows together.
"""

import contextlib
import threading
from typing import (
    Any,
    Callable,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

import tensorflow as tf

from replicate import _context
from replicate import _graph
from replicate import _tf
from replicate._batch import row_kinds
from replicate._meet import all_reduce
from replicate._meet import combining
from replicate._meet import meetings as _meetings
from replicate._meet import transforms as _transforms

_COMPUTE = "TowerOptimizer.compute_gradients"
_APPLY = "TowerOptimizer.apply_gradients"
# Ops between a gather's ids and the `tf.unique` they may come from.
_SAME_IDS = frozenset(["Identity", "Cast"])


def replicated() -> Optional[_context.Replication]:
  """The current replication if a tower of several is being built."""
  replication = _context.current_replication()
  if (replication is None or
      (replication.num_towers == 1 and replication.trainers is None) or
      replication.tower is None or replication.meeting_depth):
    return None
  return replication


def in_control_flow(replication: _context.Replication) -> bool:
  """Whether ops built now sit in a tf.cond / tf.while_loop / tf.function."""
  graph = tf.compat.v1.get_default_graph()
  return graph is not replication.graph or _tf.in_v1_control_flow(graph)


@contextlib.contextmanager
def meeting_scope(replication: _context.Replication,
                  pure: bool = False) -> Iterator[None]:
  """Where tower 0 builds a meeting's optimizer work.

  Its variables (slots) belong to no tower; its ops that follow no
  variable sit on the meeting device (updates run where their variables
  are); under MIRRORED its gradients are summed between the tower devices
  (`_meet.all_reduce`). A `pure` computation (gradients) made inside a tf.cond
  or tf.while_loop of tower 0 is built outside it, where the other towers'
  losses are.
  """
  graph = tf.compat.v1.get_default_graph()
  inside = in_control_flow(replication)
  with contextlib.ExitStack() as stack:
    if pure and inside:
      stack.enter_context(_context.outside(replication, graph.get_name_scope()))
    stack.enter_context(replication.unshared_creation())
    if pure or not inside:
      # Inside a function body the ops stay where its caller places them.
      stack.enter_context(tf.device(replication.meeting_device))
      stack.enter_context(all_reduce.summed_between_towers(replication))
    yield


def whole_batch_loss(replication: _context.Replication, losses: Sequence[Any],
                     call: str) -> tf.Tensor:
  """The loss one device would hand `call`: tower 0's, or all rows of it.

  Raises:
    ValueError: the loss is computed per tower in a way that is not the
      whole batch's (e.g. from a value picked by its position in the
      shard, or by an op that mixes rows).
  """
  loss = replication.rewiring.resolve(tf.convert_to_tensor(losses[0]))
  kind = replication.rewiring.kind(loss)
  if row_kinds.shares_value(kind):
    return loss
  if isinstance(kind, row_kinds.Rows) and kind.axis == 0:
    parts = [
        tf.convert_to_tensor(replication.rewiring.counterpart(loss, i))
        for i in range(replication.num_towers)
    ]
    with _context.outside(replication, "whole_batch_loss"), \
        tf.device(replication.meeting_device):
      rows = tf.concat(combining.real_rows(parts, replication), 0)
      if replication.trainers is not None:
        rows = replication.trainers.rows_loss(rows)
      return rows
  raise ValueError(not_whole_batch(loss, kind, f"the loss handed to {call}"))


def not_whole_batch(tensor: tf.Tensor, kind: Any, what: str) -> str:
  """The error message for a value that is not the whole batch's."""
  if isinstance(kind, row_kinds.Local):
    cause = (f"op {kind.op!r} {kind.why}" if kind.op else kind.why)
  elif kind is row_kinds.SHARD:
    cause = ("it is computed from each tower's own batch statistics "
             "(sync_batch_norm=False)")
  elif isinstance(kind, row_kinds.Size):
    cause = "it is the tower's shard size"
  elif isinstance(kind, row_kinds.Rows) and kind.order:
    cause = (f"it holds rows {kind.order!r} joined along the rows, which "
             "the towers hold in another order than one device's")
  else:
    cause = f"it holds the tower's rows ({kind})"
  return (f"{what}, {tensor.name}, is computed from each tower's shard of "
          f"the batch in a way replicate cannot make the whole batch's: "
          f"{cause}. Compute it with TensorFlow ops over the whole batch's "
          "rows (reductions such as tf.reduce_sum / tf.reduce_mean, per-row "
          "ops), use replicate.batch_concat where rows must meet rows, or "
          "run the model_fn unreplicated.")


def require_gradients(grads: Iterable[Any],
                      variables: Iterable[tf.Variable]) -> None:
  """Keras' own error for a variable without a gradient, as on one device."""
  for grad, variable in zip(grads, variables):
    if grad is None:
      raise ValueError(
          f"Variable {variable} has `None` for gradient. Please make sure "
          "that all of your ops have a gradient defined (i.e. are "
          "differentiable).")


def gradient_spec(loss: Any, variables: Sequence[tf.Variable],
                  pairs: bool) -> List[Any]:
  """The structure of the gradients of `loss` one device's call returns.

  For the towers built before tower 0: None for a variable the loss does
  not read, an IndexedSlices where every read of it on the way is a
  gather (a lookup), else a dense tensor of its shape.
  """
  computed_from = ancestors([tf.convert_to_tensor(loss)])
  specs = []
  for variable in variables:
    specs.append(_variable_gradient_spec(variable, computed_from))
  if pairs:
    return list(zip(specs, variables))
  return specs


def _handle(variable: Any) -> Optional[tf.Tensor]:
  handle = getattr(variable, "handle", None)
  if isinstance(handle, tf.Tensor):
    return handle
  op = getattr(variable, "op", None)
  return op.outputs[0] if op is not None else None


def _variable_gradient_spec(
    variable: Any, ancestors: Set[tf.Operation]
) -> Union[None, _meetings.SlicesSpec, _meetings.TensorSpec]:
  handle = _handle(variable)
  if handle is None:
    return None
  readers = [op for op in _readers(handle) if op in ancestors]
  if not readers:
    return None
  if all(
      op.type in ("ResourceGather", "Gather",
                  "GatherV2") and op.inputs[0] is not None for op in readers):
    shape = variable.shape
    return _meetings.SlicesSpec(
        tf.TensorShape([None]).concatenate(shape[1:]),
        variable.dtype.base_dtype,
        shape.as_list() if shape.is_fully_defined() else None)
  return _meetings.TensorSpec(variable.shape, variable.dtype.base_dtype)


def _readers(tensor: tf.Tensor) -> List[tf.Operation]:
  """The ops reading `tensor`, through Identity ops (a ref variable's read)
  and a resource variable's reads (whose reader then reads the value)."""
  readers, pending = [], list(tensor.consumers())
  while pending:
    op = pending.pop()
    if op.type in ("Identity", "ReadVariableOp") and not (
        op.type == "Identity" and op.inputs[0].dtype == tf.resource):
      consumers = op.outputs[0].consumers()
      gathers = [
          c for c in consumers
          if c.type in ("Gather", "GatherV2") and c.inputs[0] is op.outputs[0]
      ]
      others = [c for c in consumers if c not in gathers]
      readers.extend(gathers)
      if others:
        readers.append(op)
    else:
      readers.append(op)
  return readers


def ancestors(tensors: Iterable[tf.Tensor],
              limit: int = 200000) -> Set[tf.Operation]:
  """The ops `tensors` are computed from, through meetings' stand-ins to
  what the tower brought to them."""
  replication = _context.current_replication()
  meetings = getattr(replication, "meetings", None)

  def sources(op: tf.Operation) -> List[tf.Operation]:
    found = _graph.input_ops(op)
    if meetings is not None and op.type == "Placeholder":
      found.extend(t.op for t in meetings.brought(op))
    return found

  return set(_graph.walk([t.op for t in tensors], sources, limit))


def whole_batch_gradients(loss: Any,
                          compute: Callable[[Any, bool], Any],
                          variables: Any = None,
                          pairs: bool = True,
                          call: str = _COMPUTE) -> Any:
  """`compute(loss)` on one device; in a tower, on the whole batch's loss.

  Args:
    loss: the tower's loss, as the model_fn passed it.
    compute: `compute(loss, replicated)` returns gradients (as the
      optimizer returns them); in towers, tower 0 calls it once, on the
      whole batch's loss, with `replicated` True (colocate the gradient
      ops with their forward ops).
    variables: the variables the call differentiates for, if it names
      them: every tower must name the same.
    pairs: whether `compute` returns (gradient, variable) pairs (v1) or
      gradients (Keras).
    call: the call, for errors.

  Returns:
    What `compute` returned; the same in every tower.
  """
  replication = replicated()
  if replication is None:
    return compute(loss, False)
  names = None if variables is None else [
      v.op.name for v in tf.nest.flatten(variables)
  ]
  listed = (
      tf.nest.flatten(variables)
      if variables is not None else _trainable_variables())

  def build(values: List[Any]) -> List[Any]:
    whole = whole_batch_loss(replication, [v for v in values], call)
    with meeting_scope(replication, pure=True):
      result = among_trainers(lambda: compute(whole, True), pairs)
    return [result] * len(values)

  def spec(value: Any) -> List[Any]:
    return gradient_spec(value, listed, pairs)

  return replication.meetings.meet(call, loss, build, spec, signature=names)


class _Depth(threading.local):
  """How deep this thread is inside `among_trainers`."""

  def __init__(self) -> None:
    super().__init__()
    self.value = 0


_depth = _Depth()


def among_trainers(compute: Callable[[], Any], pairs: bool) -> Any:
  """`compute()`: gradients of the whole batch's loss (`pairs`: as
  (gradient, variable) pairs); on a cluster of trainers only, one device's
  on the global batch, all-reduced among the trainers by the outermost
  such call (one inside it, e.g. an override's `super()` call, leaves
  them to it: each gradient is all-reduced once, after what the outer
  call does to it)."""
  _depth.value += 1
  try:
    result = compute()
  finally:
    _depth.value -= 1
  replication = _context.current_replication()
  if _depth.value or replication is None or replication.trainers is None:
    return result
  trainers = replication.trainers
  if pairs:
    result = list(result)
    grads = trainers.gradients([g for g, _ in result])
    return [(g, v) for g, (_, v) in zip(grads, result)]
  return trainers.gradients(list(result))


def _trainable_variables() -> List[tf.Variable]:
  return (tf.compat.v1.trainable_variables() + tf.compat.v1.get_collection(
      tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))


def one_device_slices(
    grads_and_vars: Iterable[Tuple[Any, tf.Variable]]
) -> List[Tuple[Any, tf.Variable]]:
  """Sparse gradients with each row once, as a lookup of unique ids gives.

  A lookup that takes unique ids (`embedding_lookup_sparse`, feature
  columns) gives one device one row per id of the whole batch; each tower
  looks up its shard's unique ids, so the whole batch's gradient has a row
  per tower for ids several shards share. Those are summed into one, in
  order of first appearance, as one device's `unique` orders them.
  Lookups of ids as given keep every row, as on one device.
  """
  return [(_transforms.merge_duplicate_rows(grad)
           if isinstance(grad, tf.IndexedSlices) and
           _looks_up_unique_ids(variable) else grad, variable)
          for grad, variable in grads_and_vars]


def _looks_up_unique_ids(variable: Any) -> bool:
  handle = _handle(variable)
  if handle is None:
    return False
  gathers = [
      op for op in _readers(handle)
      if op.type in ("ResourceGather", "Gather", "GatherV2")
  ]
  return bool(gathers) and all(
      _source_type(op.inputs[1]) == "Unique" for op in gathers)


def _source_type(tensor: tf.Tensor) -> str:
  return _graph.look_through(tensor, _SAME_IDS).op.type


def transform_and_apply(grads_and_vars: Iterable[Tuple[Any, tf.Variable]],
                        transforms: "_transforms.Pipeline",
                        apply_fn: Callable[[Any], Any],
                        call: str = _APPLY) -> Any:
  """An apply_gradients call: the transforms, then `apply_fn`, once.

  Outside replication (or on one device) the transforms run on this
  device's gradients. In towers, tower 0 applies its gradients (one
  device's, see `whole_batch_gradients`) once, in its own scopes, and every
  tower gets that update.

  Raises:
    ValueError: a gradient handed to it is not the whole batch's (taken by
      hand from the tower's rows in a way that is not a batch reduction).
  """
  replication = replicated()
  if replication is None:
    return apply_fn(transforms(transforms.prepare(grads_and_vars)))
  grads_and_vars = list(grads_and_vars)
  names = [v.op.name for g, v in grads_and_vars if g is not None]

  def build(values: List[Any]) -> List[Any]:
    pairs = [
        (_resolved(replication, grad), variable) for grad, variable in values[0]
    ]
    for grad, variable in pairs:
      if grad is None:
        continue
      for part in _components(grad):
        kind = replication.rewiring.kind(part)
        if not row_kinds.shares_value(kind):
          raise ValueError(
              not_whole_batch(
                  part, kind, f"the gradient of {variable.op.name} handed to "
                  f"{call}"))
    with meeting_scope(replication):
      result = apply_fn(transforms(transforms.prepare(pairs)))
    replication.apply_calls += 1
    return [result] * len(values)

  return replication.meetings.meet(
      call, grads_and_vars, build, lambda value: _meetings.OP, signature=names)


def _resolved(replication: _context.Replication, grad: Any) -> Any:
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(
        replication.rewiring.resolve(grad.values),
        replication.rewiring.resolve(grad.indices), grad.dense_shape)
  return replication.rewiring.resolve(grad)


def _components(grad: Any) -> List[tf.Tensor]:
  return [grad.values, grad.indices] if isinstance(
      grad, tf.IndexedSlices) else [grad]


def unrecorded(replication: _context.Replication, windows: Sequence[Tuple[int,
                                                                          int]],
               ys: Sequence[tf.Tensor], xs: Sequence[Any]) -> List[tf.Tensor]:
  """Where a tape differentiates: the values it did not record, to stop at.

  A tape differentiates what it recorded: values computed before it (a
  loss term built before Keras' `minimize(loss_fn)` records `loss_fn`, a
  read of a variable) are constants to it. The towers differentiate with
  `tf.gradients`, which follows every op: the model's ops of the towers
  outside every tape's `windows` (graph positions [start, end) it recorded,
  in each tower) stop it. The library's ops (the whole batch's values) pass
  what they read on.
  """
  if not windows:
    return []
  operations = replication.graph.get_operations()
  recorded = {op for start, end in windows for op in operations[start:end]}
  recorded.update(op for start, end in replication.library_ranges
                  for op in operations[start:end])
  if replication.library_open:
    recorded.update(operations[min(replication.library_open):])
  model = set(op for ops in replication.tower_ops for op in ops) or set(
      op for index in replication.ranges for op in replication.model_ops(index))
  sources = {x.op for x in xs if isinstance(x, tf.Tensor)}
  stops: List[tf.Tensor] = []
  for op in _graph.walk([y.op for y in ys], _graph.input_ops):
    if op in model and op not in recorded and op not in sources:
      stops.extend(
          t for t in op.outputs if t.dtype.is_floating or t.dtype.is_complex)
  return stops


_ORIGINAL_ENTER = tf.GradientTape.__enter__
_ORIGINAL_EXIT = tf.GradientTape.__exit__


def tape_windows(tape: Any, graph: tf.Graph) -> List[Tuple[int, int]]:
  """The graph positions of the ops `tape` recorded: [start, end) while it
  was entered (one still open ends now)."""
  found = _context.graph_store(graph, "tape windows").get(id(tape), [])
  return [(start, graph.version if end is None else end) for start, end in found
         ]


def entered_tape(self: tf.GradientTape) -> Any:
  """GradientTape.__enter__, noting where in the graph it starts recording."""
  graph = tf.compat.v1.get_default_graph()
  if replicated() is not None:
    store = _context.graph_store(graph, "tape windows")
    store.setdefault(id(self), []).append([graph.version, None])
  return _ORIGINAL_ENTER(self)


def exited_tape(self: tf.GradientTape, *args: Any) -> Any:
  """GradientTape.__exit__, noting where it stops recording."""
  graph = tf.compat.v1.get_default_graph()
  windows = _context.graph_store(graph, "tape windows").get(id(self))
  if windows and windows[-1][1] is None:
    windows[-1][1] = graph.version
  return _ORIGINAL_EXIT(self, *args)
