"""Model-state writes: one write per step, combined over the towers.

A model_fn changes model state outside the optimizer: batch-norm moving
statistics, EMA shadows, counters, the global step, and the local variables
that hold eval metrics' state (TensorFlow's, Keras' or hand-made). Every
tower builds such a write; this module turns the towers' writes to one
variable into one write per step, combined by the variable's declared
`tf.VariableAggregation` as `tf.distribute` defines it:

- MEAN: the towers' values (assign) or changes (assign_add/sub, scatter
  add/sub) weighted by their share of the batch (tower 0's where every
  tower computes its value alike from the same tensors, as synchronised
  batch norm's moving statistics);
- SUM: the towers' changes added up (an assign adds up `value - old`);
- ONLY_FIRST_REPLICA: tower 0's write;
- NONE: a running maximum or minimum (an assign of `tf.maximum` of the
  old value and a `tf.reduce_max` over the batch, or `tf.minimum` and
  `tf.reduce_min`; a scatter_max or scatter_min) takes the maximum or
  minimum over the towers; any other write is tower 0's where
  every tower writes the same thing (nothing computed from the tower's
  inputs), else a ValueError asking for an aggregation.

A metric fed a per-batch scalar (`tf.compat.v1.metrics.mean(loss)`) is
neither: its writes are tower 0's, with the whole batch's scalar, or a
ValueError naming the metric (see `_scalars.MetricsOfScalars`).

A tower that computed on a phantom row (see _split) adds nothing: its SUM
changes count zero, its MEAN weight is zero and its scatter rows are
dropped.

Tower 0's write op carries the combined value; later towers' writes go to a
throwaway variable (dense) or write no rows (scatter) and run after tower
0's, so whatever a tower ordered after its write sees the combined state;
tower 0's waits for every tower's written value, so whatever a tower
ordered before its write sees the state before it.
Initializers (`init_from_checkpoint` included) are never touched, and a
trainable variable written by an optimizer outside `TowerOptimizer` is an
error.
"""

import collections
import enum
import functools
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from replicate import _aggregate
from replicate import _scalars
from replicate import _step_ops
from replicate._context import Replication
from replicate._variance import add_between_shard_variance

_Aggregation = tf.VariableAggregation


class _Kind(enum.Enum):
  VALUE = "assign"
  ADD = "assign_add"
  SUB = "assign_sub"
  SCATTER_ADD = "scatter_add"     # rows added (or subtracted): linear
  SCATTER = "scatter"             # rows replaced or combined otherwise
  SLICE = "strided_slice_assign"


_KINDS = {
    "AssignVariableOp": _Kind.VALUE, "Assign": _Kind.VALUE,
    "AssignAddVariableOp": _Kind.ADD, "AssignAdd": _Kind.ADD,
    "AssignSubVariableOp": _Kind.SUB, "AssignSub": _Kind.SUB,
    "ResourceStridedSliceAssign": _Kind.SLICE, "StridedSliceAssign": _Kind.SLICE,
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


def combine_state_writes(replication: Replication, specs: Sequence = ()):
  """Makes the towers' writes to each model variable one write per step.

  Raises:
    ValueError: an optimizer outside TowerOptimizer updates a variable; the
      towers write a variable a different number of times or in different
      ways; a NONE-aggregation variable gets a value computed from the
      tower's inputs; or the write has no combined form for its aggregation.
  """
  variables = _state_variables(replication)
  skip = replication.apply_ops | _initializer_ops(variables.values())
  _check_no_writes_in_functions(replication, variables, skip, specs)
  writes = [_tower_writes(ops, variables, skip) for ops in replication.tower_ops]
  sinks = _Sinks()
  metrics = _scalars.MetricsOfScalars(replication, specs) if specs else None
  for key in sorted({k for tower in writes for k in tower}):
    group = [tower.get(key) for tower in writes]
    _combine(replication, group, sinks, metrics)


def _state_variables(replication: Replication) -> Dict[str, tf.Variable]:
  """Model and metric variables by the name of the op writes take as input.

  Global and local variables, and those tower 0 created in no collection
  (a Keras metric's, until an EstimatorSpec adds them to LOCAL_VARIABLES):
  every tower writes the same one, since towers share them (`_sharing`).
  """
  variables = {}
  created = replication.created[0].values() if replication.created else ()
  for variable in (*tf.compat.v1.global_variables(),
                   *tf.compat.v1.local_variables(), *created):
    handle = getattr(variable, "handle", None)
    op = handle.op if isinstance(handle, tf.Tensor) else variable.op
    variables[op.name] = variable
  return variables


def _initializer_ops(variables) -> set:
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


def _check_no_writes_in_functions(replication: Replication, variables, skip,
                                  specs: Sequence):
  """Refuses writes inside tf.cond / tf.while_loop bodies (functions).

  Their ops are not in the graph to combine, so every tower would write.
  TensorFlow marks a function call's resource inputs that are only read.
  The summed gradients' apply (in `skip`) runs once, so it may (a
  loss-scale optimizer applies inside a tf.cond). So may a call no step
  runs: a Keras functional model's layers built on its `Input`. Tower 0's
  ops are the model's (a later tower's train_op is tower 0's update), so a
  later tower's write is left alone where neither it nor its counterpart
  in tower 0 (the same write of the same variable) is run by the step.
  """
  run = None  # names of the ops the step runs, found on first need
  first = _function_writes(replication.tower_ops[0], variables, skip)
  for ops in replication.tower_ops[1:]:
    for key, (op, variable) in _function_writes(ops, variables, skip).items():
      counterpart = first.get(key)
      if specs and counterpart is not None and run is None:
        run = _step_ops.run_by_the_step(replication.graph, specs)
      if (run is not None and counterpart is not None and
          op.name not in run and counterpart[0].name not in run):
        logging.info("replicate: %s %s (and tower 0's %s) writes %s inside a "
                     "function no step runs; left alone", op.type, op.name,
                     counterpart[0].name, variable.op.name)
        continue
      raise ValueError(
          f"{op.type} op {op.name!r} writes variable {variable.op.name!r} "
          "inside a tf.cond, tf.while_loop or tf.function, where the "
          "towers' writes cannot be combined; write it outside (e.g. give "
          "Keras layers a Python bool `training=mode == "
          "tf.estimator.ModeKeys.TRAIN`, not a tensor).")


def _function_writes(ops, variables, skip):
  """(variable name, n) -> (op, variable): the n-th function call writing it.

  A call writes the resource inputs TensorFlow does not mark read-only.
  """
  counts = collections.Counter()
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


def _tower_writes(ops, variables, skip):
  """(variable name, n) -> the tower's n-th write to that variable."""
  counts = collections.Counter()
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


def _aggregation(variable) -> _Aggregation:
  value = int(getattr(variable, "aggregation", _Aggregation.NONE).value)
  return _Aggregation(value)


def _combine(replication: Replication, group: List[Optional[_Write]],
             sinks: "_Sinks", metrics: Optional[_scalars.MetricsOfScalars]):
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
  if group[0] is not None and metrics is not None and (
      metrics.make_tower_0s(group[0].op, name)):
    for write in group[1:]:
      if write is not None:
        _follow(write, group[0], sinks)
    logging.info("replicate: %d writes to %s (%s) of a per-batch scalar made "
                 "tower 0's", len(present), name, first.kind.value)
    return
  extremum = (_running_extremum(present) if aggregation == _Aggregation.NONE
              else None)
  if (aggregation in (_Aggregation.SUM, _Aggregation.MEAN) or extremum) and (
      len(present) != len(group)):
    raise ValueError(
        f"Variable {name!r} (aggregation {aggregation.name}) is written by "
        f"towers {[i for i, w in enumerate(group) if w]} only; every tower "
        "must make the same writes for them to be combined.")
  if group[0] is None:
    raise ValueError(
        f"Variable {name!r} is written by towers "
        f"{[i for i, w in enumerate(group) if w]} but not by tower 0, whose "
        "writes are the model's; write it in every tower or in tower 0.")
  if aggregation in (_Aggregation.SUM, _Aggregation.MEAN):
    _feed_combined(replication, group, aggregation)
  elif extremum:
    _feed_extremum(replication, group, extremum)
  elif aggregation == _Aggregation.NONE:
    _check_same_in_every_tower(replication, group)
  for write in group[1:]:
    if write is not None:
      _follow(write, group[0], sinks)
  logging.info("replicate: %d writes to %s (%s, aggregation %s) made one",
               len(present), name, first.kind.value, aggregation.name)


def _feed_combined(replication, group: List[_Write], aggregation):
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
    # Ops have no public way to change an input once built.
    first.op._update_input(1, combined)  # pylint: disable=protected-access


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
  attrs = [{k: v for k, v in op.node_def.attr.items() if not k.startswith("_")}
           for op in (op_a, op_b)]
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


def _feed_extremum(replication, group: List[_Write], extremum: str):
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
    # Ops have no public way to change an input once built.
    first.op._update_input(1, combined)  # pylint: disable=protected-access


def _read(write: _Write) -> tf.Tensor:
  """The variable's value before the combined write."""
  with tf.control_dependencies([w for w in write.op.inputs[1:]]):
    if write.variable.dtype._is_ref_dtype:  # pylint: disable=protected-access
      return tf.identity(write.op.inputs[0])
    return tf.raw_ops.ReadVariableOp(
        resource=write.op.inputs[0], dtype=write.op.get_attr("dtype"))


def _weights(replication: Replication):
  """Each tower's share of the batch (tower 0 holds all of an empty batch).

  With an empty batch tower 0's shard is the whole batch, so its value is
  what one device computes.
  """
  return list(replication.fractions)


def _real_sum(replication, values: Sequence[tf.Tensor]) -> tf.Tensor:
  """The towers' values added up, those computed on phantom rows as zero.

  So a SUM counter fed a phantom tower's row count counts one device's rows.
  """
  return _aggregate.real_sum(values, replication.validity)


def _weighted_sum(replication, values: Sequence[tf.Tensor]) -> tf.Tensor:
  """Sum of weight * value; a tower with weight 0 adds 0 even if NaN."""
  terms = []
  dtype = values[0].dtype
  compute = dtype if dtype.is_floating else tf.float64
  for weight, value in zip(_weights(replication), values):
    if isinstance(weight, float) and weight == 0.0:
      continue
    value = tf.cast(value, compute)
    weighted = value * _aggregate.share_in(weight, compute)
    if not isinstance(weight, float):
      weighted = tf.where(weight > 0, weighted, tf.zeros_like(weighted))
    terms.append(weighted)
  combined = tf.add_n(terms)
  if not dtype.is_floating:
    combined = tf.round(combined)
  return tf.cast(combined, dtype)


def _row_layout(write: _Write):
  """(depth of an Nd scatter's indices or None, shape of one row)."""
  if "Nd" not in write.op.type:
    return None, write.variable.shape[1:]
  depth = tf.compat.dimension_value(write.op.inputs[1].shape[-1])
  if depth is None:
    raise ValueError(
        f"{write.op.name}: scatter_nd indices need a known last dimension to "
        "be combined across towers.")
  return depth, write.variable.shape[depth:]


def _set_rows(write: _Write, indices: tf.Tensor, updates: tf.Tensor):
  """Makes a scatter write `updates` at `indices` instead."""
  depth, row_shape = _row_layout(write)
  # Inputs change one at a time, and each must stay compatible with the
  # other's shape: give both a shape with an unknown number of rows.
  indices = tf.compat.v1.placeholder_with_default(
      indices, [None] if depth is None else [None, depth])
  updates = tf.compat.v1.placeholder_with_default(
      updates, [None] + row_shape.as_list())
  # Ops have no public way to change an input once built.
  write.op._update_input(1, indices)  # pylint: disable=protected-access
  write.op._update_input(2, updates)  # pylint: disable=protected-access


def _concatenated_rows(replication, group: List[_Write], weights):
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


def _check_same_in_every_tower(replication, group: List[Optional[_Write]]):
  """NONE: tower 0's write is one device's only if no tower's input shows."""
  fingerprints = set()
  for index, write in enumerate(group):
    if write is None:
      continue
    reaches_input, fingerprint = _trace(replication, write.op.inputs[1:],
                                        replication.sizes[index])
    fingerprints.add(fingerprint)
    if reaches_input or len(fingerprints) > 1:
      name = write.variable.op.name
      fix = ("wrap every optimizer in replicate.TowerOptimizer"
             if write.variable.trainable else
             "declare how the towers' writes combine when creating it, "
             "e.g. aggregation=tf.VariableAggregation.MEAN for averages "
             "(moving statistics, EMA of a loss) or SUM for counts and "
             "totals (metric state); a running maximum (minimum) needs "
             "none when written as tf.maximum(old value, tf.reduce_max(x)) "
             "(tf.minimum, tf.reduce_min)")
      raise ValueError(
          f"Tower {index} writes {name!r} ({write.op.type} "
          f"{write.op.name!r}) with a value computed from its own shard of "
          f"the batch, and {name!r} declares no aggregation "
          "(VariableAggregation.NONE), so the towers' writes cannot be made "
          f"one device's; {fix}.")


def _trace(replication, tensors, shard_size=None):
  """Whether `tensors` are computed from the towers' inputs, and their shape.

  The fingerprint (op types and constant values met on the way) tells
  apart towers that compute differently, e.g. from a static shard size.
  `shard_size` (the tower's examples, an int where the batch is static)
  tells a shard's folded shape from a true constant.
  """
  inside = replication.tower_op_names
  pending = [t.op for t in tensors]
  seen, fingerprint, reaches_input = set(), [], False
  while pending:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.name in replication.split_op_names or _scalars.is_folded_shard_shape(
        op, shard_size):
      reaches_input = True
      continue
    if op.name not in inside:
      continue
    if op.type == "Const":
      fingerprint.append(op.get_attr("value").SerializeToString())
    fingerprint.append(op.type)
    pending.extend(t.op for t in op.inputs)
  return reaches_input, tuple(fingerprint)


def _follow(write: _Write, first: _Write, sinks: "_Sinks"):
  """Makes a later tower's write run after tower 0's and change nothing.

  Tower 0's write, the one that changes the variable, waits for what the
  later tower's write would have written: on one device every read the
  model makes before its write (batch renormalization reads its moving
  statistics, then updates them) sees the old value; here every tower's
  reads ordered before its own write are.
  """
  op = write.op
  # No public API adds a control input to an op once built.
  for tensor in op.inputs[1:]:
    first.op._add_control_input(tensor.op)  # pylint: disable=protected-access
  if write.kind in (_Kind.SCATTER_ADD, _Kind.SCATTER):
    depth, row_shape = _row_layout(write)
    with tf.name_scope("no_rows"), tf.device(write.variable.device):
      _set_rows(write, tf.zeros([0] if depth is None else [0, depth],
                                op.inputs[1].dtype),
                tf.zeros([0] + row_shape.as_list(), op.inputs[2].dtype))
  else:
    op._update_input(0, sinks.get(write))  # pylint: disable=protected-access
  # A ref write's output is the variable: its readers get the combined one.
  for output, first_output in zip(op.outputs, first.op.outputs):
    for consumer in output.consumers():
      for position, tensor in enumerate(consumer.inputs):
        if tensor is output:
          consumer._update_input(position, first_output)  # pylint: disable=protected-access
  op._add_control_input(first.op)  # pylint: disable=protected-access


class _Sinks:
  """Never-read local variables for later towers' writes, one per device,
  dtype and shape (creating a variable per model variable was a tenth of
  a deep model's state combining)."""

  def __init__(self):
    self._sinks = {}

  def get(self, write: _Write) -> tf.Tensor:
    variable = write.variable
    is_ref = write.op.inputs[0].dtype._is_ref_dtype  # pylint: disable=protected-access
    key = (variable.device, variable.dtype.base_dtype, tuple(
        variable.shape.as_list()), is_ref)
    if key not in self._sinks:
      self._sinks[key] = self._make(*key)
    return self._sinks[key]

  def _make(self, device, dtype, shape, is_ref) -> tf.Tensor:
    name = "_".join([dtype.name] + [str(d) for d in shape] +
                    (["ref"] if is_ref else []))
    with tf.device(device):
      sink = tf.compat.v1.Variable(
          lambda: tf.zeros(shape, dtype),
          trainable=False, collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
          use_resource=not is_ref, name=f"replicate_sink/{name}")
    return sink.op.outputs[0] if is_ref else sink.handle
