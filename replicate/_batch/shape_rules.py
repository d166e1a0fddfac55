"""Rows rules of ops that move values: reshapes, concatenations, slices,
gathers, fills, and tensors' shapes and sizes.

Each rule maps an op and its inputs' kinds (see `_batch.row_kinds`) to
its outputs' kinds, and reports through `ctx` (`_batch.rows`) what needs
every tower; `RULES` maps op types to rules.
"""

from typing import (
    Any,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
)

import numpy as np
import tensorflow as tf

from replicate._batch import op_types
from replicate._batch import row_kinds
from replicate._batch import static


def _reshape(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
             ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Where the rows go: the entry of the new shape computed from the
  tower's size, else its -1, else the axis before which as many elements
  lie as before the rows in the input."""
  data, shape = kinds[0], kinds[1]
  if row_kinds.is_local(data):
    return [data]
  if isinstance(shape, row_kinds.Size):
    entries = shape.entries
    if isinstance(data, row_kinds.Rows) or data is row_kinds.WHOLE:
      return [row_kinds.Rows(min(entries) if entries else 0)]
  if not isinstance(data, row_kinds.Rows):
    return [data]
  values = static.partial_ints(op.inputs[1])
  if values is not None and (None not in values or values.count(-1) == 1):
    before = op.inputs[0].shape[:data.axis].num_elements()
    if values.count(-1) == 1:
      position = values.index(-1)
      # Entries may be None (unknown): np.prod then gives None or raises.
      if before is not None and int(np.prod(
          values[:position])) == before:  # type: ignore[arg-type]
        return [row_kinds.Rows(position)]
    elif before is not None:
      product = 1
      for position, value in enumerate(values):
        if product == before:
          return [row_kinds.Rows(position)]
        assert value is not None  # `None not in values` on this branch
        product *= value
    return [
        row_kinds.Local(
            op.name, f"reshapes rows cut along axis {data.axis} into "
            f"shape {values}")
    ]
  if data.axis == 0:
    return [row_kinds.Rows(0)]
  return [row_kinds.Local(op.name, f"reshapes rows cut along axis {data.axis}")]


def _transpose(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
               ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    return [kind]
  perm = static.static_ints(op.inputs[1])
  if perm is None:
    return [
        row_kinds.Local(op.name,
                        "transposes rows by a permutation known at run "
                        "time")
    ]
  return [row_kinds.Rows(perm.index(kind.axis))]


def _expand_dims(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                 ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if isinstance(kind, row_kinds.Size):
    return [kind]
  if not isinstance(kind, row_kinds.Rows):
    return [kind]
  axis = static.static_ints(op.inputs[1])
  rank = static.rank_of(op.outputs[0])
  if axis is None:
    return [row_kinds.Local(op.name, "expands dimensions at a run-time axis")]
  inserted = static.axis_in(axis[0], rank)
  if inserted is None and axis[0] == -1:
    # After the last axis, whatever the rank: the rows stay where they are.
    return [kind]
  if inserted is None:
    return [row_kinds.Local(op.name, "expands dimensions of unknown rank")]
  return [row_kinds.Rows(kind.axis + (1 if inserted <= kind.axis else 0))]


def _squeeze(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
             ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    return [kind]
  dims = list(op.get_attr("squeeze_dims"))
  rank = static.rank_of(op.inputs[0])
  if not dims:
    if rank is None:
      return [row_kinds.Local(op.name, "squeezes a tensor of unknown rank")]
    dims = [i for i, d in enumerate(op.inputs[0].shape.as_list()) if d == 1]
  squeezed = {static.axis_in(d, rank) for d in dims}
  if kind.axis in squeezed:
    return [row_kinds.Local(op.name, "squeezes the rows axis away")]
  return [
      row_kinds.Rows(kind.axis - sum(
          1 for d in squeezed if d is not None and d < kind.axis))
  ]


def _concat(op: tf.Operation,
            kinds: Sequence[row_kinds.Kind],
            ctx: row_kinds.Context,
            axis_first: bool = False) -> Sequence[row_kinds.Kind]:
  if axis_first:
    axis_tensor, values = op.inputs[0], list(zip(op.inputs[1:], kinds[1:]))
  else:
    axis_tensor, values = op.inputs[-1], list(zip(op.inputs[:-1], kinds[:-1]))
  value_kinds = [k for _, k in values]
  local = row_kinds.any_local(value_kinds)
  if local:
    return [local]
  if any(isinstance(k, row_kinds.Size) for k in value_kinds):
    return [_concat_sizes(values)]
  rows = {k.axis for k in value_kinds if isinstance(k, row_kinds.Rows)}
  if not rows:
    return [
        row_kinds.SHARD if row_kinds.SHARD in value_kinds else row_kinds.WHOLE
    ]
  axis = static.static_ints(axis_tensor)
  rank = static.rank_of(op.outputs[0])
  if axis is None or len(rows) > 1:
    return [row_kinds.Local(op.name, "concatenates rows")]
  row_axis = rows.pop()
  if static.axis_in(axis[0], rank) == row_axis and not all(
      isinstance(k, row_kinds.Rows) for k in value_kinds):
    # Rows joined with values of no rows (a memory bank's): one device's
    # order, on the whole batch.
    return ctx.whole_batch(op, [row_kinds.WHOLE],
                           "concatenates rows with values of no rows")
  if static.axis_in(axis[0], rank) == row_axis:
    # Along the rows: the tower's rows of one device's, in another order
    # (the towers' pieces interleave): per-row ops and reductions are
    # unaffected; what needs one device's order refuses it (`_batch.rows`).
    return [row_kinds.Rows(row_axis, order=op.name)]
  return [row_kinds.Rows(row_axis)]


def _concat_sizes(
    values: Iterable[Tuple[tf.Tensor, row_kinds.Kind]]) -> row_kinds.Size:
  entries: Set[int] = set()
  offset = 0
  for tensor, kind in values:
    length = tensor.shape.num_elements()
    if length is None:
      return row_kinds.Size(False, None)
    if isinstance(kind, row_kinds.Size):
      if kind.entries is None and not kind.scalar:
        return row_kinds.Size(False, None)
      entries.update(offset + e for e in (kind.entries or {0}))
    offset += length
  return row_kinds.Size(False, frozenset(entries))


def _pack(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
          ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  local = row_kinds.any_local(kinds)
  if local:
    return [local]
  if any(isinstance(k, row_kinds.Size) for k in kinds):
    if all(
        isinstance(k, row_kinds.Size) and k.scalar or k is row_kinds.WHOLE
        for k in kinds):
      return [
          row_kinds.Size(
              False,
              frozenset(i for i, k in enumerate(kinds)
                        if isinstance(k, row_kinds.Size)))
      ]
    return [row_kinds.Size(False, None)]
  rows = {k.axis for k in kinds if isinstance(k, row_kinds.Rows)}
  if not rows:
    return [row_kinds.SHARD if row_kinds.SHARD in kinds else row_kinds.WHOLE]
  if len(rows) > 1:
    return [row_kinds.Local(op.name, "stacks rows cut along different axes")]
  axis = op.get_attr("axis")
  rank = static.rank_of(op.outputs[0])
  inserted = static.axis_in(axis, rank)
  row_axis = rows.pop()
  if inserted is None:
    return [row_kinds.Local(op.name, "stacks at an unknown axis")]
  return [row_kinds.Rows(row_axis + (1 if inserted <= row_axis else 0))]


def _unpack(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
            ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if isinstance(kind, row_kinds.Size):
    entries = kind.entries
    return [
        row_kinds.Size(True)
        if entries is None or i in entries else row_kinds.WHOLE
        for i in range(len(op.outputs))
    ]
  if not isinstance(kind, row_kinds.Rows):
    return row_kinds.same_for_outputs(op, kind)
  axis = static.axis_in(op.get_attr("axis"), static.rank_of(op.inputs[0]))
  if axis == kind.axis:
    return row_kinds.same_for_outputs(
        op, row_kinds.Local(op.name, "unstacks the rows"))
  return row_kinds.same_for_outputs(
      op,
      row_kinds.Rows(kind.axis -
                     (1 if axis is not None and axis < kind.axis else 0)))


def _split(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
           ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  if op.type == "Split":
    axis_tensor, kind, value = op.inputs[0], kinds[1], op.inputs[1]
  else:
    axis_tensor, kind, value = op.inputs[2], kinds[0], op.inputs[0]
  if not isinstance(kind, row_kinds.Rows):
    return row_kinds.same_for_outputs(op, kind)
  axis = static.static_ints(axis_tensor)
  if axis is None or static.axis_in(axis[0],
                                    static.rank_of(value)) == kind.axis:
    return row_kinds.same_for_outputs(
        op, row_kinds.Local(op.name, "splits the rows"))
  return row_kinds.same_for_outputs(op, kind)


def _slice(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
           ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Slice(x, begin, size): rows stay where the rows axis is whole."""
  kind = kinds[0]
  if isinstance(kind, row_kinds.Size):
    return [
        _sliced_size(kind, static.static_ints(op.inputs[1]),
                     static.static_ints(op.inputs[2]))
    ]
  if not isinstance(kind, row_kinds.Rows):
    return [kind]
  begin = _entry(op.inputs[1], kind.axis)
  size = _entry(op.inputs[2], kind.axis)
  if begin == 0 and (size == -1 or
                     kinds[2] != row_kinds.WHOLE and size is None):
    return [kind]
  return [row_kinds.Local(op.name, "slices part of the rows")]


def _entry(tensor: tf.Tensor, index: int) -> Optional[int]:
  """Entry `index` of an int vector if known when built."""
  values = static.partial_ints(tensor)
  if values is not None and index < len(values):
    return values[index]
  return None


def _sliced_size(kind: row_kinds.Size, begin: Optional[List[int]],
                 size: Optional[List[int]]) -> row_kinds.Kind:
  if kind.scalar:
    return kind
  if kind.entries is None or begin is None or size is None:
    return row_kinds.Size(False, None)
  start = begin[0]
  stop = None if size[0] == -1 else start + size[0]
  picked = {
      e - start
      for e in kind.entries
      if e >= start and (stop is None or e < stop)
  }
  return row_kinds.Size(False, frozenset(picked)) if picked else row_kinds.WHOLE


def _strided_slice(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                   ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if isinstance(kind, row_kinds.Size):
    return [_strided_size(op, kind)]
  if not isinstance(kind, row_kinds.Rows):
    return [kind]
  mapping = _strided_mapping(op, static.rank_of(op.inputs[0]))
  if mapping is None:
    return [row_kinds.Local(op.name, "slices rows with a run-time slice")]
  fate = mapping.get(kind.axis)
  if fate is None:
    return [row_kinds.Local(op.name, "picks single rows by position")]
  if fate in ("shrunk", "partial"):
    return [_picked_rows(op, kinds, ctx)]
  return [row_kinds.Rows(fate)]


def _picked_rows(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                 ctx: row_kinds.Context) -> row_kinds.Kind:
  """Rows picked by their position in the batch (`x[0]`, `x[:2]`,
  `tf.gather(x, 0)`): the whole batch's, picked once.

  Integer rows picked by position stay the tower's own (`Local`: refused
  where one device's value is needed): they are positions and counts of
  the tower's own values far more often than data (a ragged tensor's row
  splits, `splits[-1]`, `splits[1:]`, whose whole-batch value is not the
  towers' concatenated).
  """
  if op.inputs[0].dtype.is_integer:
    return row_kinds.Local(
        op.name, "picks integer rows (positions or "
        "counts of the tower's own values) by position")
  local = row_kinds.any_local(kinds)
  if local or any(
      isinstance(k, (row_kinds.Size, row_kinds.Listed)) for k in kinds[1:]):
    return local or row_kinds.Local(op.name, "picks rows by the shard's size")
  if static.permutes_rows(op.inputs[1]):
    # Every row, in another order (`tf.argsort`'s): as long as the rows,
    # so the towers get their rows of it back.
    axis = kinds[0].axis if isinstance(kinds[0], row_kinds.Rows) else 0
    rows = row_kinds.Rows(axis)
    return ctx.whole_batch(op, [rows], "puts the rows in another order")[0]
  return ctx.needs_every_tower(op, row_kinds.Mixing(op, (row_kinds.WHOLE,)),
                               row_kinds.WHOLE, "picks rows by position")


def _strided_mapping(op: tf.Operation,
                     rank: Optional[int]) -> Optional[Dict[int, Any]]:
  """Input dim -> output dim, 'shrunk' or 'partial'; None if unknowable."""
  begin = static.static_ints(op.inputs[1])
  end = static.static_ints(op.inputs[2])
  strides = static.static_ints(op.inputs[3])
  if strides is None:
    return None
  n = len(strides)
  masks = {
      name: op.get_attr(name)
      for name in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                   "shrink_axis_mask")
  }
  mapping: Dict[int, Any] = {}
  in_dim, out_dim = 0, 0
  for i in range(n):
    bit = 1 << i
    if masks["ellipsis_mask"] & bit:
      if rank is None:
        return None
      following = sum(
          1 for j in range(i + 1, n) if not masks["new_axis_mask"] & (1 << j))
      for _ in range(rank - in_dim - following):
        mapping[in_dim] = out_dim
        in_dim += 1
        out_dim += 1
      continue
    if masks["new_axis_mask"] & bit:
      out_dim += 1
      continue
    if masks["shrink_axis_mask"] & bit:
      mapping[in_dim] = "shrunk"
      in_dim += 1
      continue
    whole_begin = masks["begin_mask"] & bit or (begin is not None and
                                                begin[i] == 0)
    whole_end = masks["end_mask"] & bit
    if strides[i] == 1 and whole_begin and whole_end:
      mapping[in_dim] = out_dim
    elif strides[i] == 1 and whole_begin and end is not None and (end[i]
                                                                  >= 2**31 - 1):
      mapping[in_dim] = out_dim
    else:
      mapping[in_dim] = "partial"
    in_dim += 1
    out_dim += 1
  rest = (rank - in_dim) if rank is not None else None
  if rest is None:
    return mapping if all(d in mapping for d in range(in_dim)) else None
  for _ in range(rest):
    mapping[in_dim] = out_dim
    in_dim += 1
    out_dim += 1
  return mapping


def _strided_size(op: tf.Operation, kind: row_kinds.Size) -> row_kinds.Kind:
  if kind.scalar:
    return kind
  begin = static.static_ints(op.inputs[1])
  end = static.static_ints(op.inputs[2])
  strides = static.static_ints(op.inputs[3])
  length = op.inputs[0].shape.num_elements()
  if kind.entries is None or begin is None or end is None or (
      strides is None) or length is None or (len(strides) != 1 or
                                             op.get_attr("ellipsis_mask") or
                                             op.get_attr("new_axis_mask")):
    return row_kinds.Size(op.get_attr("shrink_axis_mask") == 1, None)
  start = 0 if op.get_attr("begin_mask") & 1 else begin[0]
  if start < 0:
    start += length
  if op.get_attr("shrink_axis_mask") & 1:
    return row_kinds.Size(True) if start in kind.entries else row_kinds.WHOLE
  stop = length if op.get_attr("end_mask") & 1 else min(end[0], length)
  if stop < 0:
    stop += length
  picked = [
      i for i, e in enumerate(range(start, stop, strides[0]))
      if e in kind.entries
  ]
  return row_kinds.Size(False, frozenset(picked)) if picked else row_kinds.WHOLE


def _tile(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
          ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  data, multiples = kinds
  if row_kinds.is_local(data):
    return [data]
  if isinstance(data, row_kinds.Rows):
    value = _entry(op.inputs[1], data.axis)
    counted = isinstance(
        multiples, row_kinds.Size) and (multiples.entries is None or
                                        bool(multiples.entries - {data.axis}))
    if value == 1 and not counted:
      return [data]
    if value == 1:
      # Rows repeated along another axis as many times as the batch has
      # rows (pairs of rows): one device's count, on the whole batch.
      return ctx.whole_batch(op, [data], "repeats rows as often as the "
                             "batch has rows")
    return ctx.whole_batch(op, [row_kinds.WHOLE], "repeats the rows")
  if isinstance(multiples, row_kinds.Size):
    entries = multiples.entries
    return [row_kinds.Rows(min(entries) if entries else 0)]
  return [data]


def _pad(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
         ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if not isinstance(kind, row_kinds.Rows):
    return [kind]
  if static.row_ints(op.inputs[1], kind.axis) == [0, 0]:
    return [kind]
  local = row_kinds.any_local(kinds[1:])
  if local:
    return [local]
  # Rows added before or after the batch's: on the whole batch.
  return ctx.whole_batch(op, [row_kinds.WHOLE], "pads the rows axis")


def _broadcast_to(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                  ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  data, shape = kinds
  if row_kinds.is_local(data):
    return [data]
  if isinstance(data, row_kinds.Rows):
    out_rank, in_rank = static.rank_of(op.outputs[0]), static.rank_of(
        op.inputs[0])
    if out_rank is None or in_rank is None:
      return [data]
    return [row_kinds.Rows(out_rank - in_rank + data.axis)]
  if isinstance(shape, row_kinds.Size):
    return [row_kinds.Rows(min(shape.entries) if shape.entries else 0)]
  return [data]


def _fill(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
          ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  dims, value = kinds
  if isinstance(dims, row_kinds.Size):
    return [row_kinds.Rows(min(dims.entries) if dims.entries else 0)]
  if row_kinds.is_local(value) or row_kinds.is_local(dims):
    return [value if row_kinds.is_local(value) else dims]
  return [value if value is row_kinds.SHARD else row_kinds.WHOLE]


def _from_shape(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Ops whose output has the shape their first input gives."""
  shape = kinds[0]
  if isinstance(shape, row_kinds.Size):
    return row_kinds.same_for_outputs(
        op, row_kinds.Rows(min(shape.entries) if shape.entries else 0))
  local = row_kinds.any_local(kinds)
  return row_kinds.same_for_outputs(op, local or row_kinds.WHOLE)


def _range(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
           ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """Positions of the tower's rows (or entries); the whole batch's are
  known where they count from 0 by 1 up to a count of rows (which the
  towers' counts add up to)."""
  if any(isinstance(k, row_kinds.Size) for k in kinds):
    start, limit, delta = op.inputs
    whole = (
        kinds[0] is row_kinds.WHOLE and kinds[2] is row_kinds.WHOLE and
        isinstance(kinds[1], row_kinds.Size) and
        static.static_ints(start) == [0] and
        static.static_ints(delta) == [1] and static.counts_rows(limit))
    return [row_kinds.Positions(0, whole)]
  local = row_kinds.any_local(kinds)
  return [local or row_kinds.WHOLE]


def _shape(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
           ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  outputs: List[row_kinds.Kind] = []
  for kind in kinds:
    if isinstance(kind, row_kinds.Rows):
      outputs.append(row_kinds.Size(False, frozenset([kind.axis])))
    elif isinstance(kind, row_kinds.Listed):
      outputs.append(row_kinds.Size(False, frozenset([kind.axis])))
    elif row_kinds.is_local(kind):
      outputs.append(
          row_kinds.Local(op.name, "is the shape of a per-tower value"))
    else:
      outputs.append(row_kinds.WHOLE)
  return outputs


def _size(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
          ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if isinstance(kind, (row_kinds.Rows, row_kinds.Listed)):
    return [row_kinds.Size(True)]
  if row_kinds.is_local(kind):
    return [kind]
  return [row_kinds.WHOLE]


def _gather(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
            ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  params, indices = kinds[0], kinds[1]
  if op.type == "GatherV2":
    axes = static.static_ints(op.inputs[2])
    if axes is None:
      return [row_kinds.Local(op.name, "gathers along a run-time axis")]
    axis = static.axis_in(axes[0], static.rank_of(op.inputs[0]))
    batch_dims = op.get_attr("batch_dims")
  else:
    axis, batch_dims = 0, 0
  if isinstance(params, row_kinds.Size):
    return [_gathered_size(op, params)]
  if batch_dims:
    if isinstance(params, row_kinds.Rows) and params.axis == 0 or isinstance(
        indices, row_kinds.Rows) and indices.axis == 0:
      return [row_kinds.Rows(0)]
  if isinstance(indices, row_kinds.Rows):
    # Integer rows indexing rows are positions of the tower's own rows (a
    # sparse tensor's coordinates, tf.where's); positions in the whole
    # batch (a sort's) are whole values, picked from on the whole batch.
    if isinstance(params, row_kinds.Rows) and params.axis != axis:
      return [row_kinds.Local(op.name, "gathers rows by rows")]
    if row_kinds.is_local(params) and not row_kinds.is_tower_set(params):
      # A value of the tower's own (its counts, say) picked per row is
      # still the tower's own; only its distinct values are its rows'.
      return [params]
    return [row_kinds.Rows((axis or 0) + indices.axis)]
  if isinstance(params, row_kinds.Rows):
    if params.axis == axis:
      if row_kinds.is_local(indices):
        return [
            row_kinds.Local(op.name, "gathers rows by positions of the tower")
        ]
      return [_picked_rows(op, kinds, ctx)]
    index_rank = static.rank_of(op.inputs[1])
    if params.axis < (axis or 0):
      return [params]
    if index_rank is None:
      return [row_kinds.Local(op.name, "gathers with indices of unknown rank")]
    return [row_kinds.Rows(params.axis + index_rank - 1)]
  local = row_kinds.any_local([params, indices])
  if local:
    return [local]
  return [
      row_kinds.SHARD if row_kinds.SHARD in (params,
                                             indices) else row_kinds.WHOLE
  ]


def _gathered_size(op: tf.Operation, params: row_kinds.Size) -> row_kinds.Kind:
  indices = static.static_ints(op.inputs[1])
  if params.entries is None or indices is None:
    return row_kinds.Size(static.rank_of(op.outputs[0]) == 0, None)
  if static.rank_of(op.outputs[0]) == 0:
    return row_kinds.Size(
        True) if indices[0] in params.entries else row_kinds.WHOLE
  picked = [i for i, e in enumerate(indices) if e in params.entries]
  return row_kinds.Size(False, frozenset(picked)) if picked else row_kinds.WHOLE


def _gather_nd(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
               ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  params, indices = kinds
  if isinstance(indices, row_kinds.Rows) and indices.axis == 0:
    if row_kinds.is_local(params) and not row_kinds.is_tower_set(params):
      return [params]
    return [row_kinds.Rows(0)]
  if isinstance(params, row_kinds.Rows):
    batch_dims = op.get_attr("batch_dims") if "batch_dims" in [
        a.name for a in op.op_def.attr
    ] else 0
    if batch_dims and params.axis == 0:
      return [row_kinds.Rows(0)]
    if op.inputs[0].dtype.is_integer:
      return [
          row_kinds.Local(
              op.name, "picks integer rows (positions or counts of the "
              "tower's own values) by position")
      ]
    return ctx.whole_batch(op, [row_kinds.WHOLE], "picks rows by position")
  local = row_kinds.any_local(kinds)
  return [local or row_kinds.WHOLE]


def _resource_gather(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                     ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  indices = kinds[1]
  if isinstance(indices, row_kinds.Rows):
    return [row_kinds.Rows(indices.axis + op.get_attr("batch_dims"))]
  return [
      indices if row_kinds.is_local(indices) or indices is row_kinds.SHARD else
      row_kinds.WHOLE
  ]


def _scatter_nd(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  indices, updates, shape = kinds
  if isinstance(shape, row_kinds.Size):
    return [row_kinds.Rows(min(shape.entries) if shape.entries else 0)]
  local = row_kinds.any_local([indices, updates])
  if local:
    return [local]
  if isinstance(indices, row_kinds.Rows) or isinstance(updates, row_kinds.Rows):
    return [ctx.reduce(op, "sum", 0)]
  return [row_kinds.WHOLE]


# Op type -> rule.
RULES: Dict[str, row_kinds.Rule] = {
    "Reshape": _reshape,
    "Transpose": _transpose,
    "ConjugateTranspose": _transpose,
    "ExpandDims": _expand_dims,
    "Squeeze": _squeeze,
    "ConcatV2": _concat,
    "Concat": lambda op, k, c: _concat(op, k, c, axis_first=True),
    "Pack": _pack,
    "Unpack": _unpack,
    "Split": _split,
    "SplitV": _split,
    "Slice": _slice,
    "StridedSlice": _strided_slice,
    "Tile": _tile,
    "Pad": _pad,
    "PadV2": _pad,
    "MirrorPad": _pad,
    "BroadcastTo": _broadcast_to,
    "Fill": _fill,
    "Range": _range,
    "Shape": _shape,
    "ShapeN": _shape,
    "Size": _size,
    "Rank": lambda op, k, c: [row_kinds.WHOLE],
    "Gather": _gather,
    "GatherV2": _gather,
    "GatherNd": _gather_nd,
    "ResourceGather": _resource_gather,
    "ScatterNd": _scatter_nd,
}

for op_type in op_types.RANDOM_FROM_SHAPE:
  RULES.setdefault(op_type, _from_shape)
