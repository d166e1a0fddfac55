"""Rows rules of ops that compute values: reductions, products, per-row
and elementwise ops, sparse ops, summaries.

Each rule maps an op and its inputs' kinds (see `_batch.row_kinds`) to
its outputs' kinds, and reports through `ctx` (`_batch.rows`) what needs
every tower; `RULES` maps op types to rules.
"""

from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

from replicate._batch import flow_rules
from replicate._batch import op_types
from replicate._batch import row_kinds
from replicate._batch import static


def _output_axes(
    op: tf.Operation,
    kinds: Sequence[row_kinds.Kind],
    aligned: Sequence[bool] = ()) -> Any:
  """The output axes a broadcasting elementwise op's rows land on, or the
  Local / SHARD / WHOLE kind it has without rows. `aligned[i]`: input i's
  axes are the output's as they are (not right-aligned)."""
  out_rank = static.rank_of(op.outputs[0]) if op.outputs else None
  axes, shard = set(), False
  for position, (tensor, kind) in enumerate(zip(op.inputs, kinds)):
    if row_kinds.is_local(kind):
      return kind
    if kind is row_kinds.SHARD:
      shard = True
    if isinstance(kind, row_kinds.Rows):
      in_rank = static.rank_of(tensor)
      if (out_rank is not None and in_rank is not None and
          not (position < len(aligned) and aligned[position])):
        axes.add(out_rank - in_rank + kind.axis)
      else:
        axes.add(kind.axis)
  if axes:
    return axes
  return row_kinds.SHARD if shard else row_kinds.WHOLE


def _elementwise_rule(
    op: tf.Operation,
    kinds: Sequence[row_kinds.Kind],
    ctx: row_kinds.Context,
    aligned: Sequence[bool] = ()
) -> Sequence[row_kinds.Kind]:
  """A broadcasting elementwise op: rows where its inputs' rows land; rows
  of one input meeting rows of another along another axis (a pairwise
  difference `x[:, None] - x[None, :]`) meet on the whole batch."""
  axes = _output_axes(op, kinds, aligned)
  if not isinstance(axes, set):
    return row_kinds.same_for_outputs(op, axes)
  if len(axes) == 1:
    return row_kinds.same_for_outputs(op, row_kinds.Rows(axes.pop()))
  return ctx.whole_batch(
      op, row_kinds.same_for_outputs(op, row_kinds.Rows(min(axes))),
      f"combines rows cut along axes {sorted(axes)}")


def _select(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
            ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """v1 Select: a vector condition picks whole rows (its axis 0 is the
  values' axis 0), any other condition is elementwise."""
  vector = static.rank_of(op.inputs[0]) == 1
  return _elementwise_rule(op, kinds, ctx, aligned=[vector])


# ------------------------------------------------------- transfer functions


def _rows_or_whole(tensor: tf.Tensor, axis: int,
                   extent: Optional[tf.Tensor]) -> row_kinds.Kind:
  """Rows on `axis` for an output as long as the rows (`extent` counts
  them, or None: same shape as the input), else one whole value."""
  del tensor
  if extent is None or static.counts_rows(extent):
    return row_kinds.Rows(axis)
  return row_kinds.WHOLE


def _reduction(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
               ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  data, axes = op.inputs[0], op.inputs[1]
  kind = kinds[0]
  if row_kinds.is_local(kind) or kind is row_kinds.SHARD:
    return [kind]
  if not isinstance(kind, row_kinds.Rows):
    return [row_kinds.WHOLE]
  rank = static.rank_of(data)
  values = static.static_ints(axes)
  keep = op.get_attr("keep_dims")
  if values is None:
    # Axes computed at run time (all of them for an unknown rank).
    return [ctx.reduce(op, op_types.REDUCTIONS[op.type], kind.axis)]
  reduced = {static.axis_in(a, rank) for a in values}
  if None in reduced:
    reduced = set(values)
  if kind.axis in reduced:
    return [ctx.reduce(op, op_types.REDUCTIONS[op.type], kind.axis)]
  if keep:
    return [kind]
  # No axis is None here: an unknown one made `reduced` the axes as given.
  return [
      row_kinds.Rows(kind.axis -
                     sum(1 for a in reduced if a is not None and a < kind.axis))
  ]


def _arg_reduction(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                   ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    return [row_kinds.non_row(kind)]
  axis = static.static_ints(op.inputs[1])
  if axis is None or static.axis_in(axis[0], static.rank_of(
      op.inputs[0])) == kind.axis:
    # The position in the whole batch.
    return ctx.whole_batch(op, [row_kinds.WHOLE],
                           "takes the position of an extremum over rows")
  return [
      row_kinds.Rows(kind.axis -
                     (1 if axis[0] %
                      (static.rank_of(op.inputs[0]) or 1) < kind.axis else 0))
  ]


def _segment_reduction(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                       ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  data, ids, count = kinds[0], kinds[1], kinds[2]
  if isinstance(count, row_kinds.Size):
    return [row_kinds.Rows(0)]  # one segment per row
  local = row_kinds.any_local([data, ids, count])
  if local:
    return [local]
  if isinstance(data, row_kinds.Rows) and data.axis == 0 or isinstance(
      ids, row_kinds.Rows):
    return [ctx.reduce(op, op_types.SEGMENT_REDUCTIONS[op.type], 0)]
  if isinstance(data, row_kinds.Rows):
    return [row_kinds.Rows(data.axis)]
  return [
      row_kinds.SHARD if row_kinds.SHARD in (data, ids) else row_kinds.WHOLE
  ]


def _sorted_segment(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                    ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Sorted segments: one per row of the tower where the ids are positions
  of its rows (a sparse tensor's rows); segments of values (per query, per
  user) as many as the whole batch's largest id says, each summing rows of
  any tower: on the whole batch."""
  if any(k is not row_kinds.WHOLE for k in kinds[:2]):
    local = row_kinds.any_local(kinds)
    if local:
      return [local]
    if 1 in ctx.own_positions:
      return [row_kinds.Rows(0)]
    return ctx.whole_batch(op, [row_kinds.WHOLE],
                           "sums sorted segments of rows")
  return [row_kinds.WHOLE]


def _matmul(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
            ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  a, b = kinds[0], kinds[1]
  local = row_kinds.any_local([a, b])
  if local:
    return [local]
  ta = op.get_attr("transpose_a")
  tb = op.get_attr("transpose_b")
  a_rows = a.axis if isinstance(a, row_kinds.Rows) else None
  b_rows = b.axis if isinstance(b, row_kinds.Rows) else None
  a_contracted = a_rows is not None and a_rows == (0 if ta else 1)
  b_contracted = b_rows is not None and b_rows == (1 if tb else 0)
  if a_rows is not None and b_rows is not None:
    if a_contracted and b_contracted:
      return [ctx.reduce(op, "sum", a_rows)]
    return ctx.whole_batch(op, [_product_rows(a_contracted, b_contracted)],
                           "multiplies rows by rows")
  if a_rows is not None:
    return [row_kinds.Rows(0)] if not a_contracted else ctx.whole_batch(
        op, [row_kinds.WHOLE], "contracts rows with a tensor without rows")
  if b_rows is not None:
    return [row_kinds.Rows(1)] if not b_contracted else ctx.whole_batch(
        op, [row_kinds.WHOLE], "contracts rows with a tensor without rows")
  return [row_kinds.SHARD if row_kinds.SHARD in (a, b) else row_kinds.WHOLE]


def _product_rows(a_contracted: bool,
                  b_contracted: bool,
                  first: int = 0) -> row_kinds.Kind:
  """Where a product of rows by rows keeps rows: the left operand's on the
  output's first matrix axis, else the right's on its second."""
  if not a_contracted:
    return row_kinds.Rows(first)
  if not b_contracted:
    return row_kinds.Rows(first + 1)
  return row_kinds.WHOLE


def _batch_matmul(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                  ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  rows = [k for k in kinds[:2] if isinstance(k, row_kinds.Rows)]
  local = row_kinds.any_local(kinds[:2])
  if local:
    return [local]
  out_rank = static.rank_of(op.outputs[0])
  if not rows:
    return [row_kinds.SHARD if row_kinds.SHARD in kinds else row_kinds.WHOLE]
  axes = set()
  for tensor, kind in zip(op.inputs[:2], kinds[:2]):
    if isinstance(kind, row_kinds.Rows):
      rank = static.rank_of(tensor)
      if rank is None or out_rank is None or kind.axis >= rank - 2:
        return ctx.whole_batch(op, [_matrix_rows(op, kinds, out_rank)],
                               "multiplies along the rows axis")
      axes.add(out_rank - rank + kind.axis)
  if len(axes) != 1:
    return ctx.whole_batch(op, [row_kinds.Rows(min(axes))],
                           "multiplies rows cut along different axes")
  return [row_kinds.Rows(axes.pop())]


def _matrix_rows(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                 out_rank: Optional[int]) -> row_kinds.Kind:
  """A batched product's rows on a matrix axis, run on the whole batch."""
  if out_rank is None:
    return row_kinds.WHOLE
  adjoint = [
      op.get_attr(name) if name in [a.name
                                    for a in op.op_def.attr] else False
      for name in ("adj_x", "adj_y")
  ]
  contracted = []
  for position, (tensor, kind) in enumerate(zip(op.inputs[:2], kinds[:2])):
    rank = static.rank_of(tensor)
    if not isinstance(kind, row_kinds.Rows) or rank is None:
      contracted.append(True)
      continue
    # Left: rows (rank-2) kept unless adjoint; right: columns (rank-1).
    kept = rank - 2 if position == 0 else rank - 1
    if adjoint[position]:
      kept = rank - 1 if position == 0 else rank - 2
    contracted.append(kind.axis != kept)
  return _product_rows(contracted[0], contracted[1], out_rank - 2)


def _einsum(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
            ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  local = row_kinds.any_local(kinds)
  if local:
    return [local]
  equation = op.get_attr("equation").decode().replace(" ", "")
  if "..." in equation or "->" not in equation:
    if row_kinds.first_rows(kinds) is None:
      return [row_kinds.SHARD if row_kinds.SHARD in kinds else row_kinds.WHOLE]
    return ctx.whole_batch(op, [row_kinds.WHOLE], "einsum with ellipsis")
  inputs, output = equation.split("->")
  letters = inputs.split(",")
  batch = []
  for kind, spec in zip(kinds, letters):
    if isinstance(kind, row_kinds.Rows):
      if kind.axis >= len(spec):
        return ctx.whole_batch(op, [row_kinds.WHOLE], "einsum over rows")
      if spec[kind.axis] not in batch:
        batch.append(spec[kind.axis])
  if not batch:
    return [row_kinds.SHARD if row_kinds.SHARD in kinds else row_kinds.WHOLE]
  kept = [letter for letter in batch if letter in output]
  whole_kind = (
      row_kinds.Rows(min(output.index(letter) for letter in kept))
      if kept else row_kinds.WHOLE)
  if len(batch) > 1:
    return ctx.whole_batch(op, [whole_kind],
                           "einsum combining rows of different axes")
  letter = batch[0]
  carriers = [k for k, spec in zip(kinds, letters) if letter in spec]
  if not all(isinstance(k, row_kinds.Rows) for k in carriers):
    return ctx.whole_batch(op, [whole_kind],
                           "einsum of rows with a tensor without rows")
  if letter in output:
    return [row_kinds.Rows(output.index(letter))]
  rows_inputs = [k for k in kinds if isinstance(k, row_kinds.Rows)]
  return [ctx.reduce(op, "sum", rows_inputs[0].axis)]


def _where(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
           ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  if len(op.inputs) == 1:
    kind = kinds[0]
    if isinstance(kind, row_kinds.Rows):
      # Coordinates of true entries, in row order.
      return [row_kinds.Coordinates() if kind.axis == 0 else row_kinds.Rows(0)]
    return [kind if row_kinds.is_local(kind) else row_kinds.WHOLE]
  return _elementwise_rule(op, kinds, ctx)


def _one_hot(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
             ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    local = row_kinds.any_local(kinds)
    return [local or (kind if kind is row_kinds.SHARD else row_kinds.WHOLE)]
  axis = op.get_attr("axis")
  rank = static.rank_of(op.inputs[0])
  if axis == -1 or rank is None or axis > kind.axis:
    return [kind]
  return [row_kinds.Rows(kind.axis + 1)]


def _along_axis_input(axis_index: int, what: str) -> row_kinds.Rule:
  """Ops working along one axis given as an input (cumsum, reverse, ...):
  along the rows, on the whole batch, each tower getting its rows."""

  def rule(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
           ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
    kind = kinds[0]
    if not isinstance(kind, row_kinds.Rows):
      return row_kinds.same_for_outputs(op, row_kinds.non_row(kind))
    local = row_kinds.any_local(kinds[1:])
    if local:
      return row_kinds.same_for_outputs(op, local)
    axes = static.static_ints(op.inputs[axis_index])
    rank = static.rank_of(op.inputs[0])
    if axes is None or kind.axis in {static.axis_in(a, rank) for a in axes}:
      return ctx.whole_batch(op, row_kinds.same_for_outputs(op, kind), what)
    return row_kinds.same_for_outputs(op, kind)

  return rule


def _last_axis(what: str) -> row_kinds.Rule:
  """Ops working along the last axis (softmax): over the rows, on the
  whole batch, each tower getting its rows."""

  def rule(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
           ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
    kind = kinds[0]
    if not isinstance(kind, row_kinds.Rows):
      local = row_kinds.any_local(kinds)
      return row_kinds.same_for_outputs(
          op, local or (kind if kind is row_kinds.SHARD else row_kinds.WHOLE))
    rank = static.rank_of(op.inputs[0])
    if rank is None or kind.axis == rank - 1:
      return ctx.whole_batch(op, row_kinds.same_for_outputs(op, kind), what)
    return row_kinds.same_for_outputs(op, kind)

  return rule


def _top_k(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
           ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """top_k along the rows (sorting the batch): on the whole batch; the
  values are rows where k counts the rows (`tf.sort`), else the whole
  batch's k values; the positions in the batch are whole values."""
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    local = row_kinds.any_local(kinds)
    return row_kinds.same_for_outputs(
        op, local or (kind if kind is row_kinds.SHARD else row_kinds.WHOLE))
  rank = static.rank_of(op.inputs[0])
  if rank is not None and kind.axis != rank - 1:
    return row_kinds.same_for_outputs(op, kind)
  local = row_kinds.any_local(kinds[1:])
  if local:
    return row_kinds.same_for_outputs(op, local)
  k = op.inputs[1] if op.type == "TopKV2" else None
  values = row_kinds.WHOLE if k is None else _rows_or_whole(
      op.outputs[0], kind.axis, k)
  # The positions are the whole batch's: whole values, never the tower's.
  return ctx.whole_batch(op, [values, row_kinds.WHOLE], "sorts the rows")


def _per_row(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
             ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Every output keeps the rows (axis 0) of the first input with rows."""
  local = row_kinds.any_local(kinds)
  if local:
    return row_kinds.same_for_outputs(op, local)
  rows = row_kinds.first_rows(kinds)
  if rows is None:
    return row_kinds.same_for_outputs(
        op, row_kinds.SHARD if row_kinds.SHARD in kinds else row_kinds.WHOLE)
  return row_kinds.same_for_outputs(
      op,
      row_kinds.Rows(0) if rows.axis == 0 else rows)


def _fused_norm(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    return row_kinds.same_for_outputs(op, row_kinds.non_row(kind))
  rank = static.rank_of(op.inputs[0])
  channel = 1 if op.get_attr("data_format").decode().startswith("NC") else (
      None if rank is None else rank - 1)
  if kind.axis == channel:
    # Each row normalised by itself (the batch folded into the channels:
    # Keras' LayerNormalization): statistics per row.
    return [kind] + [row_kinds.Rows(0)] * (len(op.outputs) - 1)
  if not op.get_attr("is_training"):
    return [kind] + [row_kinds.WHOLE] * (len(op.outputs) - 1)
  if kind.axis != 0:
    return row_kinds.same_for_outputs(
        op,
        row_kinds.Local(op.name, "normalises over an axis "
                        "that is not the batch's"))
  if ctx.per_tower(op):
    return [kind] + [row_kinds.SHARD] * (len(op.outputs) - 1)
  statistics = ctx.needs_every_tower(op, row_kinds.FusedNorm(op),
                                     row_kinds.WHOLE,
                                     "normalises with batch statistics")
  return [kind if statistics is row_kinds.WHOLE else statistics
         ] + [statistics] * (
             len(op.outputs) - 1)


def _py_func(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
             ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Python run on the rows: once on the whole batch, its outputs rows or
  whole by their shapes (checked when it runs), unless its type is
  declared per-row."""
  if all(not isinstance(k, (row_kinds.Rows, row_kinds.Local, row_kinds.Size,
                            row_kinds.Listed)) and k is not row_kinds.SHARD
         for k in kinds):
    return row_kinds.same_for_outputs(op, row_kinds.WHOLE)
  local = row_kinds.any_local(kinds)
  if local:
    return row_kinds.same_for_outputs(op, local)
  rows = row_kinds.first_rows(kinds)
  axis = 0 if rows is None else rows.axis
  if flow_rules.declared_per_row(op) and axis == 0:
    return row_kinds.same_for_outputs(op, row_kinds.Rows(0))
  return ctx.whole_batch(
      op,
      row_kinds.rows_by_shape(op, axis),
      "runs Python on the rows",
      guessed=True)


def _unique(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
            ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Distinct values of rows and each row's index into them.

  Counted (`unique_with_counts`), or with no row reading its index
  (`tf.size(tf.unique(x)[0])`), it runs on the whole batch: one device's
  set, counts and indices. Otherwise the tower's own distinct values index
  its own rows (an embedding lookup of unique ids gathers them back by
  row, as `is_tower_set` lets a gather do); as values they are refused.
  """
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    return row_kinds.same_for_outputs(
        op, kind if row_kinds.is_local(kind) else row_kinds.WHOLE)
  axes = static.static_ints(op.inputs[1]) if op.type.endswith("V2") else [0]
  along_rows = axes is not None and static.axis_in(
      axes[0], static.rank_of(op.inputs[0])) == kind.axis
  if not along_rows:
    return row_kinds.same_for_outputs(
        op, row_kinds.Local(op.name, "finds distinct values across the rows"))
  counted = len(op.outputs) > 2
  if counted or not op.outputs[1].consumers():
    outputs: List[row_kinds.Kind] = [row_kinds.WHOLE, row_kinds.Rows(0)]
    outputs += [row_kinds.WHOLE] * (len(op.outputs) - 2)
    return ctx.whole_batch(op, outputs, "finds the distinct values of rows")
  return [row_kinds.Local(op.name, row_kinds.TOWER_SET), row_kinds.Rows(0)]


def _string_split(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                  ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Strings split into a sparse tensor of their pieces, a row of pieces
  per string: coordinates, values and a shape of the tower's rows."""
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    return row_kinds.same_for_outputs(op, row_kinds.non_row(kind))
  if kind.axis != 0 or static.rank_of(op.inputs[0]) != 1:
    return row_kinds.same_for_outputs(
        op, row_kinds.Local(op.name, "splits strings of rows of unknown rank"))
  return [
      row_kinds.Coordinates(),
      row_kinds.Rows(0),
      row_kinds.Size(False, frozenset([0]))
  ]


def _set_operation(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                   ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """A set operation on sets along the last axis (`tf.sets`), a row's set
  with the same row's: a sparse tensor of the tower's rows. Sets along the
  rows axis itself (rank 1) mix rows: on the whole batch."""
  settled = row_kinds.without_rows(op, kinds)
  if settled is not None:
    return settled
  rows = [k for k in kinds if isinstance(k, row_kinds.Rows)]
  dense = op.inputs[:2] if op.type == "DenseToDenseSetOperation" else (
      op.inputs[:1])
  if all(k.axis == 0 for k in rows) and all(
      (static.rank_of(t) or 0) >= 2 for t in dense):
    return [
        row_kinds.Coordinates(),
        row_kinds.Rows(0),
        row_kinds.Size(False, frozenset([0]))
    ]
  return ctx.whole_batch(op, row_kinds.same_for_outputs(op, row_kinds.WHOLE),
                         "takes sets across the rows")


def _set_size(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
              ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """The size of each set of a sparse tensor's last axis: a count per row
  where its coordinates are the tower's rows'."""
  settled = row_kinds.without_rows(op, kinds[:3])
  if settled is not None:
    return settled
  if isinstance(kinds[2], row_kinds.Size) and 0 in (kinds[2].entries or ()):
    return [row_kinds.Rows(0)]
  return ctx.whole_batch(op, [row_kinds.WHOLE], "counts sets across the rows")


def _bincount(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
              ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Counts of values (`tf.math.bincount`): of one row each where the
  input is a matrix counted along its last axis, else of the whole batch's
  rows, run once on the whole batch."""
  data, weights = kinds[0], kinds[2]
  settled = row_kinds.without_rows(op, [data, weights])
  if settled is not None:
    return settled
  rows = row_kinds.first_rows([data, weights])
  if rows is None:
    return row_kinds.same_for_outputs(op, row_kinds.SHARD)
  if (op.type != "Bincount" and static.rank_of(op.inputs[0]) == 2 and
      rows.axis == 0):
    return [row_kinds.Rows(0)]
  return ctx.whole_batch(op, [row_kinds.WHOLE], "counts the rows' values")


def _dynamic_stitch(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                    ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Rows placed at positions of the tower's own rows are its rows; at
  other positions (values of rows), on the whole batch."""
  if all(k is row_kinds.WHOLE for k in kinds):
    return [row_kinds.WHOLE]
  local = row_kinds.any_local(kinds)
  if local:
    return [local]
  count = len(op.inputs) // 2
  if all(index in ctx.own_positions for index in range(count)):
    return [row_kinds.Rows(0)]
  return ctx.whole_batch(op, [row_kinds.WHOLE], "places rows at positions")


def _dynamic_partition(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                       ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Each partition of the batch's rows is the towers' partitions in order
  (the tower's rows of it are its own partition)."""
  if all(k is row_kinds.WHOLE for k in kinds):
    return row_kinds.same_for_outputs(op, row_kinds.WHOLE)
  local = row_kinds.any_local(kinds)
  if local:
    return row_kinds.same_for_outputs(op, local)
  data, partitions = kinds
  if (isinstance(data, row_kinds.Rows) and data.axis == 0 and
      isinstance(partitions, row_kinds.Rows) and partitions.axis == 0):
    return row_kinds.same_for_outputs(op, row_kinds.Rows(0))
  return ctx.whole_batch(op, row_kinds.same_for_outputs(op, row_kinds.WHOLE),
                         "partitions rows by values of no rows")


def _sparse_fill_empty_rows(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                            ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  if all(k is row_kinds.WHOLE for k in kinds):
    return row_kinds.same_for_outputs(op, row_kinds.WHOLE)
  return [
      row_kinds.Rows(0),
      row_kinds.Rows(0),
      row_kinds.Rows(0),
      row_kinds.Rows(0)
  ][:len(op.outputs)]


def _sparse_reshape(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                    ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  if all(k is row_kinds.WHOLE for k in kinds):
    return row_kinds.same_for_outputs(op, row_kinds.WHOLE)
  return [row_kinds.Rows(0), row_kinds.Size(False, frozenset([0]))]


def _sparse_to_dense(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                     ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  shape = kinds[1]
  if isinstance(shape, row_kinds.Size):
    return [row_kinds.Rows(min(shape.entries) if shape.entries else 0)]
  local = row_kinds.any_local(kinds)
  if local:
    return [local]
  if isinstance(kinds[0], row_kinds.Rows) or isinstance(kinds[2],
                                                        row_kinds.Rows):
    return [ctx.reduce(op, "sum", 0)]
  return [row_kinds.WHOLE]


def _sparse_segment(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                    ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  ids = kinds[2]
  if len(op.inputs) > 3 and isinstance(kinds[3], row_kinds.Size):
    return [row_kinds.Rows(0)]
  if all(k is row_kinds.WHOLE for k in kinds):
    return [row_kinds.WHOLE]
  if ids is row_kinds.WHOLE and isinstance(kinds[0], row_kinds.Rows):
    return ctx.whole_batch(op, [row_kinds.WHOLE],
                           "sums rows into fixed segments")
  if row_kinds.is_local(kinds[0]) and not row_kinds.is_tower_set(kinds[0]):
    return [kinds[0]]
  return [row_kinds.Rows(0)]


def _sparse_dense_matmul(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                         ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  a_indices, a_values, a_shape, b = kinds
  sparse_rows = isinstance(a_shape, row_kinds.Size) or isinstance(
      a_values, row_kinds.Rows)
  adjoint_a = op.get_attr("adjoint_a")
  if sparse_rows:
    if isinstance(b, row_kinds.Rows):
      return [row_kinds.Local(op.name, "multiplies sparse rows by rows")]
    if adjoint_a:
      return [ctx.reduce(op, "sum", 0)]
    return [row_kinds.Rows(0)]
  if isinstance(b, row_kinds.Rows):
    if op.get_attr("adjoint_b"):
      return [row_kinds.Rows(1)]
    return [row_kinds.Local(op.name, "contracts rows with a sparse tensor")]
  local = row_kinds.any_local(kinds)
  return [local or row_kinds.WHOLE]


def _sparse_reduce(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                   ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  if all(k is row_kinds.WHOLE for k in kinds[:3]):
    return row_kinds.same_for_outputs(op, row_kinds.WHOLE)
  axes = static.static_ints(op.inputs[3])
  rank = op.inputs[2].shape.num_elements()
  if axes is None:
    return row_kinds.same_for_outputs(
        op,
        row_kinds.Local(op.name, "reduces a sparse tensor "
                        "along run-time axes"))
  reduced = {static.axis_in(a, rank) for a in axes}
  if 0 in reduced:
    combine = "sum" if "Sum" in op.type else "max"
    if op.type.endswith("Sparse"):
      return row_kinds.same_for_outputs(
          op,
          row_kinds.Local(op.name, "reduces sparse rows to a "
                          "sparse value"))
    return [ctx.reduce(op, combine, 0)]
  if op.type.endswith("Sparse"):
    return [
        row_kinds.Rows(0),
        row_kinds.Rows(0),
        row_kinds.Size(False, frozenset([0]))
    ]
  return [row_kinds.Rows(0)]


def _sparse_rows(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                 ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Sparse ops whose (indices, values, shape) outputs keep the rows."""
  settled = row_kinds.without_rows(op, kinds)
  if settled is not None:
    return settled
  outputs: List[row_kinds.Kind] = []
  for tensor in op.outputs:
    if tensor.dtype == tf.int64 and tensor.shape.rank == 1 and (
        tensor.name.endswith(":2") or "shape" in tensor.name):
      outputs.append(row_kinds.Size(False, frozenset([0])))
    else:
      outputs.append(row_kinds.Rows(0))
  return outputs


def _ctc(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
         ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  if all(k is row_kinds.WHOLE for k in kinds):
    return row_kinds.same_for_outputs(op, row_kinds.WHOLE)
  return [
      row_kinds.Rows(0), row_kinds.Rows(1)
  ][:len(op.outputs)] + [row_kinds.Rows(0)] * max(0,
                                                  len(op.outputs) - 2)


def _reverse_sequence(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                      ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    return [kind if row_kinds.is_local(kind) else row_kinds.WHOLE]
  if op.get_attr("seq_dim") == kind.axis:
    return ctx.whole_batch(op, [kind], "reverses the rows")
  return [kind]


def _pass_through(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                  ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  if op.type == "IdentityN":
    return list(kinds)
  if op.type == "Print":
    return [kinds[0]]
  if not kinds:
    return row_kinds.same_for_outputs(op, row_kinds.WHOLE)
  return row_kinds.same_for_outputs(op, kinds[0])


def _sink(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
          ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  return row_kinds.same_for_outputs(op, row_kinds.WHOLE)


def _bias_add_grad(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                   ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """A bias's gradient sums every axis but the channels'."""
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    return [row_kinds.non_row(kind)]
  rank = static.rank_of(op.inputs[0])
  nchw = op.type == "BiasAddGrad" and (op.get_attr("data_format")
                                       in (b"NCHW", "NCHW"))
  channels = 1 if nchw else (None if rank is None else rank - 1)
  if channels is None or kind.axis == channels:
    return [
        row_kinds.Local(op.name,
                        "sums a bias's gradient of rows of unknown rank")
    ]
  return [ctx.reduce(op, "sum", kind.axis)]


def _summary(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
             ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """A summary of rows (a histogram, images) is of the whole batch's."""
  local = row_kinds.any_local(kinds)
  if local:
    return [local]
  if any(isinstance(k, (row_kinds.Rows, row_kinds.Size)) for k in kinds):
    return [
        ctx.needs_every_tower(op, row_kinds.Mixing(op, (row_kinds.WHOLE,)),
                              row_kinds.WHOLE, "summarises rows")
    ]
  return [row_kinds.WHOLE]


# Op type -> rule.
RULES: Dict[str, row_kinds.Rule] = {
    "MatMul":
        _matmul,
    "BatchMatMul":
        _batch_matmul,
    "BatchMatMulV2":
        _batch_matmul,
    "BatchMatMulV3":
        _batch_matmul,
    "Einsum":
        _einsum,
    "Where":
        _where,
    "OneHot":
        _one_hot,
    "ArgMax":
        _arg_reduction,
    "ArgMin":
        _arg_reduction,
    "Cumsum":
        _along_axis_input(1, "accumulates along the rows"),
    "Cumprod":
        _along_axis_input(1, "accumulates along the rows"),
    "CumulativeLogsumexp":
        _along_axis_input(1, "accumulates along the "
                          "rows"),
    "ReverseV2":
        _along_axis_input(1, "reverses the rows"),
    "Roll":
        _along_axis_input(2, "rolls the rows"),
    "Softmax":
        _last_axis("normalises over the rows"),
    "LogSoftmax":
        _last_axis("normalises over the rows"),
    "TopKV2":
        _top_k,
    "TopK":
        _top_k,
    "Select":
        _select,
    "RandomShuffle":
        lambda op, k, c: [
            row_kinds.Local(op.name, "shuffles the rows")
            if row_kinds.is_rows(k[0]) else
            (k[0] if row_kinds.is_local(k[0]) else row_kinds.WHOLE)
        ],
    "SegmentSum":
        _sorted_segment,
    "SegmentMean":
        _sorted_segment,
    "SegmentMax":
        _sorted_segment,
    "SegmentMin":
        _sorted_segment,
    "SegmentProd":
        _sorted_segment,
    "BiasAddGrad":
        _bias_add_grad,
    "BiasAddGradV1":
        _bias_add_grad,
    "L2Loss":
        lambda op, k, c: ([c.reduce(op, "sum", k[0].axis)]
                          if row_kinds.is_rows(k[0]) else [
                              k[0] if row_kinds.is_local(k[0]) or k[0] is
                              row_kinds.SHARD else row_kinds.WHOLE
                          ]),
    "Unique":
        _unique,
    "UniqueV2":
        _unique,
    "UniqueWithCounts":
        _unique,
    "UniqueWithCountsV2":
        _unique,
    "Bincount":
        _bincount,
    "StringSplit":
        _string_split,
    "DenseToDenseSetOperation":
        _set_operation,
    "DenseToSparseSetOperation":
        _set_operation,
    "SetSize":
        _set_size,
    "StringSplitV2":
        _string_split,
    "DenseBincount":
        _bincount,
    "DynamicStitch":
        _dynamic_stitch,
    "ParallelDynamicStitch":
        _dynamic_stitch,
    "DynamicPartition":
        _dynamic_partition,
    "SparseFillEmptyRows":
        _sparse_fill_empty_rows,
    "SparseReshape":
        _sparse_reshape,
    "SparseToDense":
        _sparse_to_dense,
    "SparseSegmentSum":
        _sparse_segment,
    "SparseSegmentMean":
        _sparse_segment,
    "SparseSegmentSqrtN":
        _sparse_segment,
    "SparseSegmentSumWithNumSegments":
        _sparse_segment,
    "SparseSegmentMeanWithNumSegments":
        _sparse_segment,
    "SparseSegmentSqrtNWithNumSegments":
        _sparse_segment,
    "SparseTensorDenseMatMul":
        _sparse_dense_matmul,
    "SparseReduceSum":
        _sparse_reduce,
    "SparseReduceMax":
        _sparse_reduce,
    "SparseReduceSumSparse":
        _sparse_reduce,
    "SparseReduceMaxSparse":
        _sparse_reduce,
    "SparseSlice":
        _sparse_rows,
    "SparseAdd":
        _sparse_rows,
    "SparseReorder":
        _sparse_rows,
    "SparseSoftmax":
        _sparse_rows,
    "SparseDenseCwiseMul":
        _sparse_rows,
    "SparseDenseCwiseAdd":
        _sparse_rows,
    "SparseDenseCwiseDiv":
        _sparse_rows,
    "SparseCross":
        _sparse_rows,
    "SparseCrossV2":
        _sparse_rows,
    "SparseCrossHashed":
        _sparse_rows,
    "CTCLoss":
        _ctc,
    "CTCLossV2":
        _ctc,
    "ReverseSequence":
        _reverse_sequence,
    "FusedBatchNorm":
        _fused_norm,
    "FusedBatchNormV2":
        _fused_norm,
    "FusedBatchNormV3":
        _fused_norm,
}

for op_type in op_types.REDUCTIONS:
  RULES[op_type] = _reduction

for op_type in op_types.SEGMENT_REDUCTIONS:
  RULES[op_type] = _segment_reduction

for op_type in op_types.ELEMENTWISE:
  RULES.setdefault(op_type, _elementwise_rule)

for op_type in op_types.PER_ROW:
  RULES.setdefault(op_type, _per_row)

for op_type in op_types.PASS_THROUGH:
  RULES[op_type] = _pass_through

for op_type in op_types.SINKS:
  RULES[op_type] = _sink

for op_type in op_types.SUMMARIES:
  RULES[op_type] = _summary

for op_type in op_types.PY_FUNCS:
  RULES[op_type] = _py_func
