"""Model-state writes: one write per step, as on one device.

A model_fn changes model state outside the optimizer: batch-norm moving
statistics, EMA shadows, counters, the global step, the local variables
that hold eval metrics' state. Every tower builds such a write; this module
makes the towers' writes to one variable the one write of one device:

- a value the towers share with one device (every batch reduction is the
  whole batch's, see `_meet.rewiring`: a metric's totals, a moving mean, a
  counter) is written once, by tower 0;
- rows written into a variable (a scatter of the rows' indices and values)
  are every tower's rows, in batch order, written once;
- a value that stays each tower's (statistics asked for per tower,
  `sync_batch_norm=False`, or computed by ops replicate cannot split) is
  combined by the variable's declared `tf.VariableAggregation`: MEAN
  weighted by shard (with the variance between the shards added to a
  moving variance), SUM, ONLY_FIRST_REPLICA; NONE takes a running maximum
  or minimum over the towers, else a ValueError asks for an aggregation.

A tower that computed on a phantom row (see _prepare.split) adds nothing. Tower
0's write op carries the value; later towers' writes go to a throwaway variable
(dense) or write no rows (scatter) and run after tower 0's, so whatever a tower
ordered after its write sees the new state; tower 0's waits for every tower's
written value, so whatever a tower ordered before its write sees the state
before it. Initializers (`init_from_checkpoint` included) are never touched, and
a trainable variable updated by an optimizer the towers could not share is an
error.
"""

import collections
import enum
import functools
from typing import (
    AbstractSet,
    Any,
    Counter,
    DefaultDict,
    Dict,
    Iterable,
    List,
    NamedTuple,
    NoReturn,
    Optional,
    Sequence,
    Set,
    Tuple,
    cast,
)

from absl import logging
import numpy as np
import tensorflow as tf

from replicate import _graph
from replicate import _tf
from replicate._batch import row_kinds
from replicate._batch import step_ops
from replicate._batch import sums
from replicate._context import Replication
from replicate._merge.variance import add_between_shard_variance

_Aggregation = tf.VariableAggregation


class _Kind(enum.Enum):
  VALUE = "assign"
  ADD = "assign_add"
  SUB = "assign_sub"
  SCATTER_ADD = "scatter_add"  # rows added (or subtracted): linear
  SCATTER = "scatter"  # rows replaced or combined otherwise
  SLICE = "strided_slice_assign"


_KINDS = {
    "AssignVariableOp": _Kind.VALUE,
    "Assign": _Kind.VALUE,
    "AssignAddVariableOp": _Kind.ADD,
    "AssignAdd": _Kind.ADD,
    "AssignSubVariableOp": _Kind.SUB,
    "AssignSub": _Kind.SUB,
    "ResourceStridedSliceAssign": _Kind.SLICE,
    "StridedSliceAssign": _Kind.SLICE,
}
for _name in ("Add", "Sub", "NdAdd", "NdSub"):
  _KINDS["ResourceScatter" + _name] = _KINDS["Scatter" + _name] = (
      _Kind.SCATTER_ADD)
for _name in ("Update", "Mul", "Div", "Min", "Max", "NdUpdate", "NdMin",
              "NdMax"):
  _KINDS["ResourceScatter" + _name] = _KINDS["Scatter" + _name] = _Kind.SCATTER
del _name

# Ops through which a write's variable input is passed on unchanged.
_FORWARDING = frozenset(["Identity", "RefIdentity"])
_RESTORES = frozenset(["RestoreV2", "Restore", "RestoreSlice"])
_TRAINING_OP_PREFIXES = ("Apply", "ResourceApply", "SparseApply",
                         "ResourceSparseApply")
# Ops that read a resource variable's value from its handle.
_READS = frozenset(["ReadVariableOp"])
# Elementwise extrema by the reduction over towers that gives one device's
# result, the batch reduction each must take for that, the ops that keep
# its order on the way, and the scatters that write an extremum.
_EXTREMA = {"Maximum": tf.maximum, "Minimum": tf.minimum}
_BATCH_EXTREMA = {"Maximum": "Max", "Minimum": "Min"}
_MONOTONE = frozenset(["Identity", "Cast"])
_SCATTER_EXTREMA = frozenset(
    f"{prefix}Scatter{nd}{kind}" for prefix in ("", "Resource")
    for nd in ("", "Nd") for kind in ("Max", "Min"))


class _Write(NamedTuple):
  op: tf.Operation
  kind: _Kind
  variable: tf.Variable


def combine_state_writes(replication: Replication,
                         specs: Sequence[Any]) -> None:
  """Makes the towers' writes to each model variable one write per step.

  Raises:
    ValueError: an optimizer outside TowerOptimizer updates a variable; the
      towers write a variable a different number of times or in different
      ways; a NONE-aggregation variable gets a value computed from the
      tower's inputs; or the write has no combined form for its aggregation.
  """
  variables = _state_variables(replication)
  skip = _initializer_ops(variables.values())
  writes = [
      _tower_writes(ops, variables, skip) for ops in replication.tower_ops
  ]
  sinks = _Sinks()
  order = _Order(replication.graph, replication.tower_ops, writes)
  _order_reads_before_updates(replication, order, specs)
  for key in sorted({k for tower in writes for k in tower}):
    group = [tower.get(key) for tower in writes]
    _combine(replication, group, sinks, order)
  # After the writes are combined: what the step runs then is final.
  _check_writes_in_functions(replication, variables, skip, specs)


def _order_reads_before_updates(replication: Replication, order: "_Order",
                                specs: Sequence[Any]) -> None:
  """Every tower's reads of a variable run before the optimizer updates it.

  A model_fn may read a variable for a value the step fetches apart from
  the gradients' forward pass (Keras' `minimize(loss_fn)` builds the loss
  again inside its tape; a metric of the weights): nothing orders such a
  read against the update. On one device the read is ready when the step
  starts and runs first; a tower's read is one of many ready ops, on
  another device, and under load could run after the update, reporting
  the next step's weights. The update waits for every read that it does
  not itself precede, in every tower, so the step sees the weights as one
  device's program order has them.
  """
  # The updates are built by the optimizer's meeting, outside the towers'
  # own ops: every op since the first tower began.
  first = min(
      start for start, _ in replication.ranges.values() if start is not None)
  updates = [
      op for op in replication.graph.get_operations()[first:]
      if op.type.startswith(_TRAINING_OP_PREFIXES) and op.inputs
  ]
  if not updates:
    return
  after = order.after_all(updates)
  in_towers = {op for ops in replication.tower_ops for op in ops}
  # Reads the step runs anyway: not an imported graph's unfed ops (a TF1 Hub
  # module's own graph beside its applied copy).
  run = _run_by_the_step(replication, specs)
  for update in updates:
    reads = [
        op for op in order.readers(_source(update.inputs[0]))
        if op in in_towers and op not in after and op.name in run and
        not op.type.startswith(_TRAINING_OP_PREFIXES) and
        not _tf.op_in_v1_control_flow(op)
    ]
    known = set(update.control_inputs)
    for read in reads:
      if read not in known:
        _tf.add_control_input(update, read)
  logging.vlog(1, "replicate: %d optimizer updates wait for their reads",
               len(updates))


def _run_by_the_step(replication: Replication,
                     specs: Sequence[Any]) -> Set[str]:
  """Names of the ops the step runs: tower 0's spec's, its values' whole
  batch's (every tower's partials), the other towers' predictions."""
  return step_ops.run_by_the_step(
      replication.graph, specs[:1], [s.predictions for s in specs[1:]] +
      list(replication.rewiring.replacements().values()))


def _state_variables(replication: Replication) -> Dict[str, tf.Variable]:
  """Model and metric variables by the name of the op writes take as input.

  Global and local variables, and those tower 0 created in no collection
  (a Keras metric's, until an EstimatorSpec adds them to LOCAL_VARIABLES):
  every tower writes the same one, since towers share them (`_towers.sharing`).
  """
  variables = {}
  created = (
      replication.created[replication.creator].values()
      if replication.created else ())
  for variable in (*tf.compat.v1.global_variables(),
                   *tf.compat.v1.local_variables(), *created):
    handle = getattr(variable, "handle", None)
    op = handle.op if isinstance(handle, tf.Tensor) else variable.op
    variables[op.name] = variable
  return variables


def _initializer_ops(variables: Iterable[tf.Variable]) -> Set[str]:
  names = set()
  for variable in variables:
    initializer = variable.initializer
    names.add(getattr(initializer, "op", initializer).name)
  return names


def _source(tensor: tf.Tensor) -> tf.Operation:
  op = tensor.op
  while op.type in _FORWARDING and op.inputs:
    op = op.inputs[0].op
  return op


def _is_initializer(op: tf.Operation) -> bool:
  """A write of a checkpoint's value (`init_from_checkpoint`)."""
  return any(_source(t).type in _RESTORES for t in op.inputs[1:])


def _check_writes_in_functions(replication: Replication,
                               variables: Dict[str, tf.Variable],
                               skip: AbstractSet[str],
                               specs: Sequence[Any]) -> None:
  """Refuses writes inside tf.cond / tf.while_loop bodies that differ.

  A function call's writes cannot be combined with another tower's (its
  ops are in its body, not in the graph). Tower 0's are the model's where
  the body sees no rows (a gradient accumulator zeroed or applied every k
  steps, say: the values are the whole batch's); the other towers' are
  never run unless something the step runs reads them.
  """
  run = None  # names of the ops the step runs, found on first need
  rewiring = replication.rewiring
  for index, ops in enumerate(replication.tower_ops):
    for op, variable in _function_writes(ops, variables, skip).values():
      if index == 0:
        kinds = [rewiring.kind(t) for t in op.inputs]
        if all(row_kinds.shares_value(k) for k in kinds):
          continue
      if run is None:
        run = _run_by_the_step(replication, specs)
      if op.name not in run:
        if index == 0:
          logging.info(
              "replicate: %s %s writes %s inside a function no step "
              "runs; left alone", op.type, op.name, variable.op.name)
        continue
      raise ValueError(
          f"{op.type} op {op.name!r} writes variable {variable.op.name!r} "
          "inside a tf.cond, tf.while_loop or tf.function that reads the "
          "tower's rows, where the towers' writes cannot be combined; write "
          "it outside (e.g. give Keras layers a Python bool `training=mode "
          "== tf.estimator.ModeKeys.TRAIN`, not a tensor).")


def _call_writes(op: tf.Operation, tensor: tf.Tensor) -> bool:
  """Whether function call `op` may write the resource `tensor` (an input
  TensorFlow does not mark read-only)."""
  try:
    read_only = set(op.get_attr("_read_only_resource_inputs"))
  except ValueError:
    return False
  return tensor.dtype == tf.resource and any(
      t is tensor and i not in read_only for i, t in enumerate(op.inputs))


def _function_writes(
    ops: Iterable[tf.Operation], variables: Dict[str, tf.Variable],
    skip: AbstractSet[str]
) -> Dict[Tuple[str, int], Tuple[tf.Operation, tf.Variable]]:
  """(variable name, n) -> (op, variable): the n-th function call writing it.

  A call writes the resource inputs TensorFlow does not mark read-only.
  """
  counts: Counter[str] = collections.Counter()
  writes = {}
  for op in ops:
    if op.name in skip:
      continue
    try:
      read_only = set(op.get_attr("_read_only_resource_inputs"))
    except ValueError:
      continue
    for position, tensor in enumerate(op.inputs):
      variable = variables.get(_source(tensor).name)
      if (variable is None or tensor.dtype != tf.resource or
          position in read_only):
        continue
      name = variable.op.name
      writes[(name, counts[name])] = (op, variable)
      counts[name] += 1
  return writes


def _tower_writes(ops: Iterable[tf.Operation], variables: Dict[str,
                                                               tf.Variable],
                  skip: AbstractSet[str]) -> Dict[Tuple[str, int], _Write]:
  """(variable name, n) -> the tower's n-th write to that variable."""
  counts: Counter[str] = collections.Counter()
  writes = {}
  for op in ops:
    if op.name in skip or not op.inputs:
      continue
    variable = variables.get(_source(op.inputs[0]).name)
    if variable is None:
      continue
    if op.type.startswith(_TRAINING_OP_PREFIXES):
      raise ValueError(
          f"{op.type} op {op.name!r} updates variable {variable.op.name!r} "
          "outside replicate.TowerOptimizer, so every tower would apply its "
          "own update; wrap the optimizer in replicate.TowerOptimizer (every "
          "optimizer of the model_fn).")
    kind = _KINDS.get(op.type)
    if kind is None or _is_initializer(op):
      continue
    name = variable.op.name
    writes[(name, counts[name])] = _Write(op, kind, variable)
    counts[name] += 1
  return writes


def _aggregation(variable: Any) -> tf.VariableAggregation:
  value = int(getattr(variable, "aggregation", _Aggregation.NONE).value)
  return _Aggregation(value)


def _written_kind(replication: Replication, write: _Write) -> Any:
  """The kind (`_batch.rows`) of what tower 0's write writes."""
  kinds = [replication.rewiring.kind(t) for t in write.op.inputs[1:]]
  for kind in kinds:
    if isinstance(kind, row_kinds.Local) or kind is row_kinds.SHARD:
      return kind
  for kind in kinds:
    if isinstance(kind, row_kinds.Rows):
      return kind
  return row_kinds.WHOLE


def _combine(replication: Replication, group: List[Optional[_Write]],
             sinks: "_Sinks", order: "_Order") -> None:
  """One write for one (variable, occurrence) across the towers."""
  present = [w for w in group if w is not None]
  first = present[0]
  name = first.variable.op.name
  aggregation = _aggregation(first.variable)
  if len({w.kind for w in present}) > 1:
    raise ValueError(
        f"The towers write variable {name!r} in different ways "
        f"({[w.op.type if w else None for w in group]}); every tower must "
        "make the same writes.")
  if group[0] is None:
    raise ValueError(
        f"Variable {name!r} is written by towers "
        f"{[i for i, w in enumerate(group) if w]} but not by tower 0, whose "
        "writes are the model's; write it in every tower or in tower 0.")
  kind = _written_kind(replication, group[0])
  if row_kinds.shares_value(kind):
    _check_written_alike(group)
    how = "tower 0's (the whole batch's value)"
  elif isinstance(kind, row_kinds.Rows):
    if first.kind not in (_Kind.SCATTER_ADD, _Kind.SCATTER):
      raise ValueError(
          f"Variable {name!r} is assigned a value with a row per example "
          f"({first.op.name}); a variable cannot hold the batch's rows "
          "across towers: write a reduction of them, or scatter rows.")
    missing = [i for i, w in enumerate(group) if w is None]
    if missing:
      raise ValueError(
          f"Variable {name!r} is scattered rows of the batch by tower 0 but "
          f"not by towers {missing}; every tower must make the same writes "
          "(look for Python code that depends on replicate.current_tower()).")
    with tf.name_scope("combined_writes"), tf.device(first.variable.device):
      _set_rows(
          first,
          *_concatenated_rows(replication, cast(List[_Write], group), None))
    how = "every tower's rows"
  else:
    how = _combine_by_aggregation(replication, group, present, aggregation)
  for write in group[1:]:
    if write is not None:
      _follow(
          write,
          group[0],
          sinks,
          order,
          values=not row_kinds.shares_value(kind))
  logging.info("replicate: %d writes to %s (%s) made one: %s", len(present),
               name, first.kind.value, how)


def _check_written_alike(group: List[Optional[_Write]]) -> None:
  """A value one device computes once must be computed alike in every tower.

  Where a tower's write differs from tower 0's in a constant (a shard's
  size taken from a static shape as a Python number, say), the towers do
  not agree on it and tower 0's is not one device's.
  """
  first = group[0]
  assert first is not None  # `_combine` refuses a group without tower 0
  for index, write in enumerate(group[1:], start=1):
    if write is None:
      continue
    for a, b in zip(first.op.inputs[1:], write.op.inputs[1:]):
      difference = _difference(a, b, [_ALIKE_BUDGET])
      if difference is not None:
        name = first.variable.op.name
        raise ValueError(
            f"Towers 0 and {index} write {name!r} ({first.op.name}, "
            f"{write.op.name}) with values that should be one device's but "
            f"differ: {difference}. A number taken from a tensor's static "
            "shape (x.shape[0], a Python int) is the tower's shard size; "
            "use tf.shape(x)[0] (the whole batch's size wherever it is a "
            "value), or declare the variable's aggregation.")


_READS_SHAPE = frozenset(["Shape", "ShapeN", "Size", "Rank"])


def _skip_identities(tensor: tf.Tensor) -> tf.Tensor:
  while tensor.op.type in ("Identity", "Snapshot") and tensor.op.inputs:
    tensor = tensor.op.inputs[0]
  return tensor


def _difference(a: tf.Tensor, b: tf.Tensor, budget: List[int]) -> Optional[str]:
  """How tower values `a` and `b` are computed differently, or None.

  None also where looking further would cost more than `budget[0]` ops:
  only a difference found is reported.
  """
  a, b = _skip_identities(a), _skip_identities(b)
  if a is b:
    return None
  budget[0] -= 1
  if budget[0] < 0:
    return None
  op_a, op_b = a.op, b.op
  if op_a.type != op_b.type or a.value_index != b.value_index:
    return f"{op_a.name} is {op_a.type}, {op_b.name} is {op_b.type}"
  if op_a.type == "Const":
    value_a = tf.make_ndarray(op_a.get_attr("value"))
    value_b = tf.make_ndarray(op_b.get_attr("value"))
    if value_a.shape != value_b.shape or not np.array_equal(
        value_a, value_b, equal_nan=value_a.dtype.kind in "fc"):
      return f"constant {op_a.name} is {value_a}, {op_b.name} is {value_b}"
    return None
  if len(op_a.inputs) != len(op_b.inputs):
    return f"{op_a.name} and {op_b.name} read different numbers of inputs"
  if op_a.type in _READS_SHAPE:
    # A size read as a value is the whole batch's by now (`_meet.rewiring`);
    # what is left reads shapes of values every tower has alike.
    return None
  for x, y in zip(op_a.inputs, op_b.inputs):
    found = _difference(x, y, budget)
    if found is not None:
      return found
  return None


def _combine_by_aggregation(replication: Replication,
                            group: List[Optional[_Write]],
                            present: List[_Write],
                            aggregation: tf.VariableAggregation) -> str:
  """Each tower's own value, combined by the variable's aggregation."""
  first = present[0]
  name = first.variable.op.name
  extremum = (
      _running_extremum(present) if aggregation == _Aggregation.NONE else None)
  if (aggregation in (_Aggregation.SUM, _Aggregation.MEAN) or
      extremum) and (len(present) != len(group)):
    raise ValueError(
        f"Variable {name!r} (aggregation {aggregation.name}) is written by "
        f"towers {[i for i, w in enumerate(group) if w]} only; every tower "
        "must make the same writes for them to be combined.")
  # Every tower writes: `present` is `group`.
  if aggregation in (_Aggregation.SUM, _Aggregation.MEAN):
    _feed_combined(replication, cast(List[_Write], group), aggregation)
  elif extremum:
    _feed_extremum(replication, cast(List[_Write], group), extremum)
  elif aggregation == _Aggregation.NONE:
    _check_same_in_every_tower(replication, group)
  return f"each tower's value, aggregation {aggregation.name}"


def _feed_combined(replication: Replication, group: List[_Write],
                   aggregation: tf.VariableAggregation) -> None:
  """Gives tower 0's write the towers' combined value or rows."""
  first = group[0]
  mean = aggregation == _Aggregation.MEAN
  if first.kind is _Kind.SLICE:
    raise ValueError(
        f"Variable {first.variable.op.name!r} (aggregation "
        f"{aggregation.name}) is written through a slice ({first.op.name}); "
        "slice writes cannot be combined across towers: write the whole "
        "variable, or declare aggregation=ONLY_FIRST_REPLICA.")
  with tf.name_scope("combined_writes"), tf.device(first.variable.device):
    if first.kind in (_Kind.SCATTER_ADD, _Kind.SCATTER):
      weights = _weights(replication) if (
          mean and first.kind is _Kind.SCATTER_ADD) else None
      _set_rows(first, *_concatenated_rows(replication, group, weights))
      return
    if mean and _written_alike(group):
      return  # Any weighted mean of one value is that value: tower 0's.
    if mean:
      add_between_shard_variance(
          [w.op for w in group], _weights(replication),
          lambda values: _weighted_sum(replication, values))
    values = [w.op.inputs[1] for w in group]
    if first.kind is _Kind.VALUE and not mean:
      old = _read(first)
      values = [v - old for v in values]
      combined = old + _real_sum(replication, values)
    elif mean:
      combined = _weighted_sum(replication, values)
    else:
      combined = _real_sum(replication, values)
    _tf.update_input(first.op, 1, combined)


# Ops `_computed_alike` compares per write before it gives up (and the
# towers' writes are combined).
_ALIKE_BUDGET = 64


def _written_alike(group: List[_Write]) -> bool:
  """Whether every tower writes what tower 0 writes, computed alike.

  Synchronised batch norm hands every tower the hub's statistics, so each
  tower's moving-average write is the same arithmetic on the same tensors:
  combining them would only add ops (and a rounding).
  """
  value = group[0].op.inputs[1]
  return all(w.kind is group[0].kind and
             _computed_alike(value, w.op.inputs[1], [_ALIKE_BUDGET])
             for w in group[1:])


def _computed_alike(a: tf.Tensor, b: tf.Tensor, budget: List[int]) -> bool:
  """Whether `a` and `b` are one value: the same tensor, or the same
  deterministic op (type and attributes; reads of one variable with the same
  control inputs) of inputs computed alike. Looks at `budget[0]` ops at most.
  """
  if a is b:
    return True
  op_a, op_b = a.op, b.op
  budget[0] -= 1
  if (budget[0] < 0 or a.value_index != b.value_index or
      op_a.type != op_b.type or len(op_a.inputs) != len(op_b.inputs)):
    return False
  if op_a.type in _READS:
    if op_a.control_inputs != op_b.control_inputs:
      return False
  elif op_a.op_def.is_stateful:
    return False
  attrs = [{
      k: v for k, v in op.node_def.attr.items() if not k.startswith("_")
  } for op in (op_a, op_b)]
  return attrs[0] == attrs[1] and all(
      _computed_alike(x, y, budget) for x, y in zip(op_a.inputs, op_b.inputs))


def _extremum_of_old_value(write: _Write) -> Optional[str]:
  """'Maximum' or 'Minimum' where the write keeps a running one, else None.

  That is an assign of `tf.maximum` of the variable's own value and a
  `tf.reduce_max` over the batch axis (`tf.minimum`, `tf.reduce_min`), or a
  scatter_max (scatter_min) of rows. The maximum of anything else over the
  shards (e.g. of their means) is not the batch's.
  """
  if write.op.type in _SCATTER_EXTREMA:
    return "Maximum" if write.op.type.endswith("Max") else "Minimum"
  if write.kind is not _Kind.VALUE:
    return None
  value = _source(write.op.inputs[1])
  if value.type not in _EXTREMA:
    return None
  variable = _source(write.op.inputs[0]).name
  others = [t for t in value.inputs if _read_source(t).name != variable]
  if len(others) == 1 and _reduces_batch(others[0].op,
                                         _BATCH_EXTREMA[value.type]):
    return value.type
  return None


def _reduces_batch(op: tf.Operation, reduction: str) -> bool:
  """Whether `op` is a `reduction` (e.g. 'Max') over axis 0, the batch's."""
  while op.type in _MONOTONE and op.inputs:
    op = op.inputs[0].op
  if op.type != reduction:
    return False
  axes = tf.get_static_value(op.inputs[1])
  rank = op.inputs[0].shape.rank
  return axes is not None and any(
      axis == 0 or (rank is not None and axis == -rank)
      for axis in np.reshape(axes, [-1]))


def _read_source(tensor: tf.Tensor) -> tf.Operation:
  """The variable a read (ReadVariableOp, ref snapshot) reads, or its op."""
  op = _source(tensor)
  if op.type in _READS:
    op = _source(op.inputs[0])
  return op


def _running_extremum(writes: Sequence[_Write]) -> Optional[str]:
  """The extremum every tower's write keeps (see above), else None."""
  kinds = {_extremum_of_old_value(w) for w in writes}
  return kinds.pop() if len(kinds) == 1 else None


def _feed_extremum(replication: Replication, group: List[_Write],
                   extremum: str) -> None:
  """Gives tower 0's write the maximum (minimum) over the towers.

  Each tower's value is the maximum of the old value and its shard's, so
  their maximum is the old value's and the whole batch's: one device's.
  """
  first = group[0]
  with tf.name_scope("combined_writes"), tf.device(first.variable.device):
    if first.kind is _Kind.SCATTER:
      _set_rows(first, *_concatenated_rows(replication, group, None))
      return
    combined = functools.reduce(_EXTREMA[extremum],
                                [w.op.inputs[1] for w in group])
    _tf.update_input(first.op, 1, combined)


def _read(write: _Write) -> tf.Tensor:
  """The variable's value before the combined write."""
  with tf.control_dependencies([w for w in write.op.inputs[1:]]):
    if write.variable.dtype != write.variable.dtype.base_dtype:
      return tf.identity(write.op.inputs[0])
    return tf.raw_ops.ReadVariableOp(
        resource=write.op.inputs[0], dtype=write.op.get_attr("dtype"))


def _weights(replication: Replication) -> List[Any]:
  """Each tower's share of the batch (tower 0 holds all of an empty batch).

  With an empty batch tower 0's shard is the whole batch, so its value is
  what one device computes.
  """
  return list(replication.fractions)


def _real_sum(replication: Replication,
              values: Sequence[tf.Tensor]) -> tf.Tensor:
  """The towers' values added up, those computed on phantom rows as zero.

  So a SUM counter fed a phantom tower's row count counts one device's rows.
  """
  return sums.real_sum(values, replication.validity)


def _weighted_sum(replication: Replication,
                  values: Sequence[tf.Tensor]) -> tf.Tensor:
  """Sum of weight * value; a tower with weight 0 adds 0 even if NaN."""
  terms = []
  dtype = values[0].dtype
  compute = dtype if dtype.is_floating else tf.float64
  for weight, value in zip(_weights(replication), values):
    if isinstance(weight, float) and weight == 0.0:
      continue
    value = tf.cast(value, compute)
    weighted = value * sums.share_in(weight, compute)
    if not isinstance(weight, float):
      weighted = tf.where(weight > 0, weighted, tf.zeros_like(weighted))
    terms.append(weighted)
  combined = tf.add_n(terms)
  if not dtype.is_floating:
    combined = tf.round(combined)
  return tf.cast(combined, dtype)


def _row_layout(write: _Write) -> Tuple[Optional[int], tf.TensorShape]:
  """(depth of an Nd scatter's indices or None, shape of one row)."""
  if "Nd" not in write.op.type:
    return None, write.variable.shape[1:]
  depth = tf.compat.dimension_value(write.op.inputs[1].shape[-1])
  if depth is None:
    raise ValueError(
        f"{write.op.name}: scatter_nd indices need a known last dimension to "
        "be combined across towers.")
  return depth, write.variable.shape[depth:]


def _set_rows(write: _Write, indices: tf.Tensor, updates: tf.Tensor) -> None:
  """Makes a scatter write `updates` at `indices` instead."""
  depth, row_shape = _row_layout(write)
  # Inputs change one at a time, and each must stay compatible with the
  # other's shape: give both a shape with an unknown number of rows.
  indices = tf.compat.v1.placeholder_with_default(
      indices, [None] if depth is None else [None, depth])
  updates = tf.compat.v1.placeholder_with_default(updates,
                                                  [None] + row_shape.as_list())
  _tf.update_input(write.op, 1, indices)
  _tf.update_input(write.op, 2, updates)


def _concatenated_rows(
    replication: Replication, group: List[_Write],
    weights: Optional[Sequence[Any]]) -> Tuple[tf.Tensor, tf.Tensor]:
  """Every tower's scatter indices and updates, in tower order, flattened.

  A tower that computed on a phantom row writes no rows.
  """
  all_indices, all_updates = [], []
  for index, write in enumerate(group):
    valid = replication.is_valid(index)
    if valid is False:
      continue
    depth, row_shape = _row_layout(write)
    indices, updates = write.op.inputs[1], write.op.inputs[2]
    indices = tf.reshape(indices, [-1] if depth is None else [-1, depth])
    rows = tf.reshape(updates, [-1] + row_shape.as_list())
    if weights is not None:
      rows = rows * tf.cast(weights[index], rows.dtype)
    if valid is not True:
      count = tf.where(valid, tf.shape(indices)[0], 0)
      indices, rows = indices[:count], rows[:count]
    all_indices.append(indices)
    all_updates.append(rows)
  return tf.concat(all_indices, 0), tf.concat(all_updates, 0)


def _check_same_in_every_tower(replication: Replication,
                               group: List[Optional[_Write]]) -> NoReturn:
  """NONE: a value each tower computes from its own shard has no answer."""
  write = group[0]
  assert write is not None  # `_combine` refuses a group without tower 0
  name = write.variable.op.name
  fix = ("wrap every optimizer in replicate.TowerOptimizer"
         if write.variable.trainable else
         "declare how the towers' writes combine when creating it, e.g. "
         "aggregation=tf.VariableAggregation.MEAN for averages of per-tower "
         "statistics or SUM for per-tower counts; a running maximum "
         "(minimum) needs none when written as tf.maximum(old value, "
         "tf.reduce_max(x)) (tf.minimum, tf.reduce_min)")
  kind = _written_kind(replication, write)
  cause = (f": op {kind.op!r} {kind.why}"
           if isinstance(kind, row_kinds.Local) and kind.op else "")
  raise ValueError(
      f"Tower 0 writes {name!r} ({write.op.type} {write.op.name!r}) with a "
      f"value computed from its own shard of the batch{cause}, and {name!r} "
      "declares no aggregation (VariableAggregation.NONE), so the towers' "
      f"writes cannot be made one device's; {fix}.")


def _follow(write: _Write,
            first: _Write,
            sinks: "_Sinks",
            order: "_Order",
            values: bool = True) -> None:
  """Makes a later tower's write run after tower 0's and change nothing.

  On one device every read the model makes before its write (batch
  renormalization reads its moving statistics, then updates them) sees the
  old value; so tower 0's write, the one that changes the variable, waits
  for the later tower's reads of it that its write does not precede. Where
  the later tower's value is combined into tower 0's (`values`), tower 0's
  write waits for that value too.
  """
  op = write.op
  waits = order.reads_before(write)
  if values:
    waits += [t.op for t in op.inputs[1:]]
  for wait in waits:
    _tf.add_control_input(first.op, wait)
  if write.kind in (_Kind.SCATTER_ADD, _Kind.SCATTER):
    depth, row_shape = _row_layout(write)
    with tf.name_scope("no_rows"), tf.device(write.variable.device):
      _set_rows(
          write,
          tf.zeros([0] if depth is None else [0, depth], op.inputs[1].dtype),
          tf.zeros([0] + row_shape.as_list(), op.inputs[2].dtype))
  else:
    _tf.update_input(op, 0, sinks.get(write))
  # A ref write's output is the variable: its readers get the combined one.
  for output, first_output in zip(op.outputs, first.op.outputs):
    _tf.rewire(output, first_output)
  _tf.add_control_input(op, first.op)


class _Order:
  """Which of a tower's reads of a variable come before its writes.

  The order is the model's own, taken before any write is combined.
  """

  def __init__(self, graph: tf.Graph,
               tower_ops: Sequence[Sequence[tf.Operation]],
               writes: Sequence[Dict[Tuple[str, int], _Write]]) -> None:
    self._tower_of = {
        op: index for index, ops in enumerate(tower_ops) for op in ops
    }
    self._writes = writes
    self._control_outputs: DefaultDict[tf.Operation, List[tf.Operation]] = (
        collections.defaultdict(list))
    for op in graph.get_operations():
      for control in op.control_inputs:
        self._control_outputs[control].append(op)

  def reads_before(self, write: _Write) -> List[tf.Operation]:
    """The reads of `write`'s variable in its tower that no write of it
    there precedes (outside tf.cond / tf.while_loop bodies, which cannot be
    ordered from outside)."""
    tower = self._tower_of.get(write.op)
    reads = [
        op for op in self._readers(_source(write.op.inputs[0]))
        if self._tower_of.get(op) == tower and not _tf.op_in_v1_control_flow(op)
    ]
    if not reads:
      return []
    name = write.variable.op.name
    after = set()
    assert tower is not None  # `write` is one of the towers' writes
    for (written, _), other in self._writes[tower].items():
      if written == name:
        after |= self._after(other.op)
    return [op for op in reads if op not in after]

  def readers(self, handle: tf.Operation) -> List[tf.Operation]:
    """The ops reading the variable `handle` makes (through Identity)."""
    return self._readers(handle)

  def after_all(self, ops: Sequence[tf.Operation]) -> Set[tf.Operation]:
    """Every op that runs after any of `ops` (data or control edges)."""

    def later(current: tf.Operation) -> List[tf.Operation]:
      return _graph.consumer_ops(current) + list(
          self._control_outputs.get(current, []))

    return set(_graph.walk([c for op in ops for c in later(op)], later))

  def _readers(self, handle: tf.Operation) -> List[tf.Operation]:
    found, pending = [], list(handle.outputs)
    while pending:
      tensor = pending.pop()
      for consumer in tensor.consumers():
        if consumer.type in _FORWARDING:
          pending.extend(consumer.outputs)
        elif consumer.type not in _KINDS and not _call_writes(consumer, tensor):
          found.append(consumer)
    return found

  def _after(self, op: tf.Operation) -> Set[tf.Operation]:

    def later(current: tf.Operation) -> List[tf.Operation]:
      return _graph.consumer_ops(current) + list(
          self._control_outputs.get(current, []))

    return set(_graph.walk(later(op), later))


class _Sinks:
  """Never-read local variables for later towers' writes, one per device,
  dtype and shape (creating a variable per model variable was a tenth of
  a deep model's state combining)."""

  def __init__(self) -> None:
    self._sinks: Dict[Tuple[Any, ...], tf.Tensor] = {}

  def get(self, write: _Write) -> tf.Tensor:
    variable = write.variable
    dtype = write.op.inputs[0].dtype
    is_ref = dtype != dtype.base_dtype
    key = (variable.device, variable.dtype.base_dtype,
           tuple(variable.shape.as_list()), is_ref)
    if key not in self._sinks:
      self._sinks[key] = self._make(*key)
    return self._sinks[key]

  def _make(self, device: Optional[str], dtype: tf.DType,
            shape: Tuple[Optional[int], ...], is_ref: bool) -> tf.Tensor:
    name = "_".join([dtype.name] + [str(d) for d in shape] +
                    (["ref"] if is_ref else []))
    with tf.device(device):
      sink = tf.compat.v1.Variable(
          lambda: tf.zeros(shape, dtype),
          trainable=False,
          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
          use_resource=not is_ref,
          name=f"replicate_sink/{name}")
    return sink.op.outputs[0] if is_ref else sink.handle
