"""The towers' writes to one variable made the one write of one device.

What tower 0's write writes decides how (`combine`): a value the towers
share with one device (every batch reduction is the whole batch's) is
tower 0's write alone; rows scattered into a variable are every tower's
rows, in batch order; a value that stays each tower's is combined by the
variable's declared `tf.VariableAggregation` (MEAN weighted by shard, with
the variance between the shards added to a moving variance; SUM;
ONLY_FIRST_REPLICA; under NONE a running maximum or minimum over the
towers, else an error). A tower on a phantom row adds nothing. Later
towers' writes then write a never-read sink (`Sinks`) or no rows, after
tower 0's (`_follow`).
"""

import functools
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple, cast

from absl import logging
import numpy as np
import tensorflow as tf

from replicate import _graph
from replicate import _tf
from replicate._batch import row_kinds
from replicate._batch import sums
from replicate._batch_norm.moving_variance import add_between_shard_variance
from replicate._context import Replication
from replicate._merge import state_compare
from replicate._merge import state_writes
from replicate._merge import update_order

_Aggregation = tf.VariableAggregation
_Kind = state_writes.Kind
_Write = state_writes.Write
# Elementwise extrema by the reduction over towers that gives one device's
# result, the batch reduction each must take for that, the ops that keep
# its order on the way, and the scatters that write an extremum.
_EXTREMA = {"Maximum": tf.maximum, "Minimum": tf.minimum}
_BATCH_EXTREMA = {"Maximum": "Max", "Minimum": "Min"}
_MONOTONE = frozenset(["Identity", "Cast"])
_SCATTER_EXTREMA = frozenset(
    f"{prefix}Scatter{nd}{kind}" for prefix in ("", "Resource")
    for nd in ("", "Nd") for kind in ("Max", "Min"))


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


def combine(replication: Replication, group: List[Optional[_Write]],
            sinks: "Sinks", order: update_order.Order) -> None:
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
    state_compare.check_written_alike(group)
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
    if mean and state_compare.written_alike(group):
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
  value = _graph.look_through(write.op.inputs[1]).op
  if value.type not in _EXTREMA:
    return None
  variable = _graph.look_through(write.op.inputs[0]).op.name
  others = [t for t in value.inputs if _read_source(t).name != variable]
  if len(others) == 1 and _reduces_batch(others[0], _BATCH_EXTREMA[value.type]):
    return value.type
  return None


def _reduces_batch(tensor: tf.Tensor, reduction: str) -> bool:
  """Whether `tensor` is a `reduction` (e.g. 'Max') over axis 0, the
  batch's, through ops that keep its order."""
  op = _graph.look_through(tensor, _MONOTONE).op
  if op.type != reduction:
    return False
  axes = tf.get_static_value(op.inputs[1])
  rank = op.inputs[0].shape.rank
  return axes is not None and any(
      axis == 0 or (rank is not None and axis == -rank)
      for axis in np.reshape(axes, [-1]))


def _read_source(tensor: tf.Tensor) -> tf.Operation:
  """The variable a read (ReadVariableOp, ref snapshot) reads, or its op."""
  op = _graph.look_through(tensor).op
  if op.type in state_writes.READS:
    op = _graph.look_through(op.inputs[0]).op
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
  assert write is not None  # `combine` refuses a group without tower 0
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
            sinks: "Sinks",
            order: update_order.Order,
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


class Sinks:
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
