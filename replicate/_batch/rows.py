"""Which tensors of a tower hold the tower's rows of the batch.

Each tower computes on its shard of the batch. Every tensor it builds is one
of these kinds:

- `WHOLE`: the same in every tower and equal to one device's value (a
  variable's value, a constant, a meeting's result, a batch reduction once
  it is rewired to the whole batch's value);
- `Rows(axis)`: the tower's part of one device's tensor, cut along `axis`
  (the inputs along axis 0, what per-row ops compute from them);
- `Size`: an integer computed from the shard's size (`tf.shape(x)[0]`): as
  an operand that shapes rows (a reshape, a fill) it is the tower's own,
  as a value (a mean's denominator) it must be the whole batch's;
- `SHARD`: a per-tower statistic the user asked for
  (`sync_batch_norm=False`): rows normalised with it stay rows;
- `Local`: a per-tower value that is none of these (a row picked by its
  position, rows mixed by an op that cannot be split): fine inside the
  tower, wrong wherever one device's value is needed;
- `Listed(axis)`: a TensorList (a loop's accumulator) of elements with rows
  on `axis`.

`TowerRows` finds the kinds by following the tower's ops in creation order
from its inputs, and records the events the replication must act on: batch
reductions (an op reducing rows to a value: `Reduction`), sizes used as
values (`SizeUse`), ops that mix rows and run once on the whole batch
(`Mixing`), batch normalization kernels in training (`FusedNorm`). Function
bodies (`tf.cond`, `tf.while_loop`, `tf.function`) are followed too; a
reduction inside one cannot be rewired and makes its outputs `Local`.
"""

from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
)

from absl import logging
import tensorflow as tf

from replicate import _tf
from replicate._batch import flow_rules
from replicate._batch import op_types
from replicate._batch import row_kinds
from replicate._batch import shape_rules
from replicate._batch import static
from replicate._batch import value_rules

# How a run of the transfer functions treats what needs every tower.
TOWER = row_kinds.TOWER_OPS  # the tower's own ops: events, to be rewired

BODY = "body"  # a function body run per tower: such ops are not allowed

WHOLE_BATCH = "whole batch"  # a body run once on the whole batch: fine


class _Context:
  """What one run of the transfer functions reports and knows."""

  def __init__(
      self,
      mode: str,
      per_tower: Callable[[tf.Operation], bool],
      kind_of: Callable[[tf.Tensor],
                        row_kinds.Kind] = (lambda tensor: row_kinds.WHOLE)):
    self.mode = mode
    self.per_tower = per_tower
    # The kind of a tensor computed before the op at hand.
    self.kind_of = kind_of
    self.events: List[row_kinds.Event] = []
    # Inside a BODY: the first op needing every tower, if any.
    self.needs_towers: Optional[tf.Operation] = None
    # The inputs of the op at hand holding positions of the tower's own
    # rows, which it uses as indices into them.
    self.own_positions: FrozenSet[int] = frozenset()

  def needs_every_tower(self, op: tf.Operation,
                        event: Optional[row_kinds.Event], kind: row_kinds.Kind,
                        why: str) -> row_kinds.Kind:
    """An op needing every tower's rows: an event, or in a body a mark."""
    if self.mode == TOWER:
      if event is not None:
        self.events.append(event)
      return kind
    if self.mode == WHOLE_BATCH:
      return kind
    if self.needs_towers is None:
      self.needs_towers = op
    return row_kinds.Local(
        op.name, why + " inside a tf.cond, tf.while_loop or "
        "tf.function body run per tower")

  def reduce(self, op: tf.Operation, combine: str, axis: int) -> row_kinds.Kind:
    """A batch reduction: the whole batch's value once rewired."""
    if self.per_tower(op):
      return row_kinds.SHARD
    return self.needs_every_tower(op, row_kinds.Reduction(op, combine, axis),
                                  row_kinds.WHOLE, "reduces rows")

  def whole_batch(self,
                  op: tf.Operation,
                  outputs: Sequence[row_kinds.Kind],
                  why: str,
                  guessed: bool = False) -> List[row_kinds.Kind]:
    """An op mixing rows, run once on the whole batch (a `Mixing` event):
    `outputs`' kinds; in a body run per tower, Local."""
    if self.mode == TOWER:
      self.events.append(row_kinds.Mixing(op, tuple(outputs), guessed))
      return list(outputs)
    if self.mode == WHOLE_BATCH:
      return list(outputs)
    if self.needs_towers is None:
      self.needs_towers = op
    return [
        row_kinds.Local(
            op.name, why + " inside a tf.cond, tf.while_loop or "
            "tf.function body run per tower")
    ] * len(op.outputs)

  def value_of_size(self, op: tf.Operation, index: int) -> row_kinds.Kind:
    return self.needs_every_tower(op, row_kinds.SizeUse(op, index),
                                  row_kinds.WHOLE, "reads the shard's size")

  def value_of_positions(self, op: tf.Operation, index: int,
                         kind: row_kinds.Positions) -> row_kinds.Kind:
    """Positions read as values: the whole batch's (an event), as rows."""
    if not kind.whole:
      return row_kinds.Local(
          op.name, "reads positions of the tower's rows counted in a way "
          "that has no whole-batch positions (tf.range from 0 by 1 up to a "
          "count of rows has)")
    return self.needs_every_tower(op, row_kinds.PositionUse(op, index),
                                  row_kinds.Rows(kind.axis),
                                  "reads positions of the tower's rows")

  def function_kinds(
      self, op: tf.Operation,
      kinds: Sequence[row_kinds.Kind]) -> Optional[List[row_kinds.Kind]]:
    """A call's output kinds; a body needing every tower runs once."""
    if self.mode == WHOLE_BATCH:
      found = function_kinds(op, kinds, self.per_tower, WHOLE_BATCH)
      return None if found is None else found[0]
    found = function_kinds(op, kinds, self.per_tower, BODY)
    if found is None:
      return None
    outputs, inner = found
    local = row_kinds.any_local(kinds)
    if local:
      return [local] * len(op.outputs) if inner is not None else outputs
    unread = row_kinds.any_local(outputs)
    if inner is None and unread is None:
      return outputs
    if self.mode == BODY:
      if self.needs_towers is None and inner is not None:
        self.needs_towers = inner
      return outputs
    # A body that needs every tower's rows, or whose outputs are not rows
    # of one device's nor whole values (a value carried from row to row,
    # rows reshaped across their axis): it runs once, on the whole batch.
    if inner is not None:
      why = f"{inner.type} op {inner.name!r}, which needs every tower's rows"
    else:
      assert unread is not None
      why = f"{unread.op!r}, which {unread.why}"
    static = [
        t.name
        for t, k in zip(op.inputs, kinds)
        if isinstance(k, row_kinds.Rows) and t.shape.rank is not None and
        t.shape[k.axis] is not None
    ]
    if static:
      # Its bodies were traced for the tower's shard size: they cannot
      # run on the whole batch.
      return [
          row_kinds.Local(
              op.name, f"has {why} in its body; replicate runs "
              "such a call once on the whole batch, but this one was "
              f"built for the shard's static size ({static[0]}): "
              "compute it outside the tf.cond / tf.while_loop / "
              "tf.function (e.g. give Keras layers a Python bool "
              "`training`), or batch without drop_remainder")
          for _ in op.outputs
      ]
    found = function_kinds(op, kinds, self.per_tower, WHOLE_BATCH)
    assert found is not None  # the bodies were read above
    whole, guessed = found[0], False
    if any(row_kinds.is_local(k) for k in whole):
      # What the body makes of the whole batch's rows, where its ops do
      # not say: by the outputs' shapes, checked when the step runs.
      rows = row_kinds.first_rows(kinds)
      shaped = row_kinds.rows_by_shape(op, 0 if rows is None else rows.axis)
      whole = [s if row_kinds.is_local(k) else k for k, s in zip(whole, shaped)]
      guessed = True
    self.events.append(row_kinds.Mixing(op, tuple(whole), guessed))
    logging.vlog(1, "replicate: %s runs once on the whole batch (%s)", op.name,
                 why)
    return whole


_TRANSFER: Dict[str, row_kinds.Rule] = {
    **value_rules.RULES,
    **shape_rules.RULES,
    **flow_rules.RULES
}

# Ops writing a value into a variable: a size written is a count.
_WRITES = frozenset([
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "Assign",
    "AssignAdd", "AssignSub", "ResourceScatterAdd", "ResourceScatterUpdate",
    "ScatterAdd", "ScatterUpdate"
])


def _reads_size_as_value(op: tf.Operation, index: int) -> bool:
  """Whether `op` reads its input `index`, a shard size, as a number.

  A size turned into a floating value (a mean's denominator), or written
  into a variable (a counter), is a count of the batch's rows; anywhere
  else (shapes of new tensors, sparse shapes, comparisons with the
  tower's own positions) it is the tower's own.
  """
  if index in op_types.SHAPE_ROLES.get(op.type, ()):
    return False
  if op.type in _WRITES:
    return True
  return any(t.dtype.is_floating or t.dtype.is_complex for t in op.outputs)


def _size_inputs(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                 ctx: _Context) -> List[row_kinds.Kind]:
  """Reads shard sizes as numbers: events, then WHOLE (see above)."""
  if any(row_kinds.is_local(k) for k in kinds):
    # Compared or combined with a value of the tower itself (a ragged
    # tensor's row splits, say): the tower's own size.
    return list(kinds)
  result = list(kinds)
  for index, kind in enumerate(kinds):
    if not isinstance(kind, row_kinds.Size):
      continue
    if op.type in _READS_NO_VALUES:
      result[index] = row_kinds.WHOLE if op.type in ("ZerosLike",
                                                     "OnesLike") else kind
    elif _reads_size_as_value(op, index):
      result[index] = ctx.value_of_size(op, index)
  return result


# Ops that read their input's shape or type, never its values.
_READS_NO_VALUES = frozenset(
    ["Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike"])

_SIZE_ARITHMETIC = frozenset([
    "Mul", "AddV2", "Add", "Sub", "FloorDiv", "FloorMod", "TruncateDiv", "Div",
    "Maximum", "Minimum", "Neg", "Abs", "Cast", "Identity", "Reshape",
    "ExpandDims", "Squeeze", "Prod", "Sum", "Max", "Min", "BroadcastArgs"
])


def _size_arithmetic(op: tf.Operation,
                     kinds: Sequence[row_kinds.Kind]) -> List[row_kinds.Kind]:
  """Integer arithmetic of shard sizes: a size again."""
  outputs: List[row_kinds.Kind] = []
  for tensor in op.outputs:
    if tensor.shape.rank == 0:
      outputs.append(row_kinds.Size(True))
      continue
    entries: Optional[Set[int]]
    entries = set()
    for value, kind in zip(op.inputs, kinds):
      if isinstance(kind, row_kinds.Size):
        if kind.scalar or kind.entries is None or (value.shape.rank
                                                   != tensor.shape.rank):
          entries = None
          break
        entries.update(kind.entries)
    outputs.append(
        row_kinds.Size(
            False, None if entries is None or
            op.type in ("Reshape", "ExpandDims", "Squeeze", "BroadcastArgs") and
            len(entries) != 1 else frozenset(entries) if entries else None))
  return outputs


# Ops whose integer input (index) may hold positions indexing the tower's own
# rows: index -> the input that must then hold the rows (or their count).
_INDEXES = {
    "GatherV2": {
        1: 0
    },
    "Gather": {
        1: 0
    },
    "GatherNd": {
        1: 0
    },
    "TensorScatterUpdate": {
        1: 0
    },
    "TensorScatterAdd": {
        1: 0
    },
    "TensorScatterSub": {
        1: 0
    },
    "TensorScatterMax": {
        1: 0
    },
    "TensorScatterMin": {
        1: 0
    },
    "ScatterNd": {
        0: 2
    },
    "SegmentSum": {
        1: 0
    },
    "SegmentMean": {
        1: 0
    },
    "SegmentMax": {
        1: 0
    },
    "SegmentMin": {
        1: 0
    },
    "SegmentProd": {
        1: 0
    },
    "UnsortedSegmentSum": {
        1: 2
    },
    "UnsortedSegmentMax": {
        1: 2
    },
    "UnsortedSegmentMin": {
        1: 2
    },
    "UnsortedSegmentProd": {
        1: 2
    },
    "SparseToDense": {
        0: 1
    },
    "SparseTensorDenseMatMul": {
        0: 2
    },
    "OneHot": {},
}

# Ops named Sparse... that take no sparse tensor (their integers are not
# coordinates of rows).
_DENSE_SPARSE_NAMED = frozenset(
    ["SparseSoftmaxCrossEntropyWithLogits", "SparseMatMul"])


def _indexes_own_rows(op: tf.Operation, index: int,
                      kinds: Sequence[row_kinds.Kind]) -> bool:
  """Whether `op` reads positions (input `index`) as indices into the
  tower's own rows, where they are one device's."""
  if op.type in ("DynamicStitch", "ParallelDynamicStitch"):
    # The indices place the data in the output: the tower's own rows.
    return index < len(op.inputs) // 2
  roles = _INDEXES.get(op.type)
  if roles is None:
    # A sparse op: its indices and segment ids are coordinates in the
    # tower's sparse rows.
    return op.type.startswith(
        ("Sparse", "Ragged")) and op.type not in _DENSE_SPARSE_NAMED
  target = roles.get(index)
  if target is None:
    return False
  kind = kinds[target]
  if op.type == "GatherV2" and isinstance(kind, row_kinds.Rows):
    axes = static.static_ints(op.inputs[2])
    return axes is not None and static.axis_in(
        axes[0], static.rank_of(op.inputs[0])) == kind.axis
  return isinstance(kind, (row_kinds.Rows, row_kinds.Size, row_kinds.Positions))


def _position_inputs(
    op: tf.Operation, kinds: Sequence[row_kinds.Kind], ctx: _Context
) -> Tuple[List[row_kinds.Kind], List[Tuple[int, row_kinds.Positions]]]:
  """Positions inputs as the rule sees them (rows), and those left the
  tower's own (integer arithmetic, shapes): made the whole batch's where
  read as values (floating, boolean or no outputs, a write)."""
  result, kept = list(kinds), []
  values = op.type in _WRITES or not op.outputs or any(
      not t.dtype.is_integer for t in op.outputs)
  ctx.own_positions = frozenset()
  for index, kind in enumerate(kinds):
    if not isinstance(kind, row_kinds.Positions):
      continue
    if _indexes_own_rows(op, index, kinds):
      result[index] = row_kinds.Rows(kind.axis)
      ctx.own_positions |= {index}
    elif values:
      result[index] = ctx.value_of_positions(op, index, kind)
    else:
      result[index] = row_kinds.Rows(kind.axis)
      kept.append((index, kind))
  return result, kept


def _kept_positions(op: tf.Operation,
                    kept: Sequence[Tuple[int, row_kinds.Positions]],
                    outputs: Sequence[row_kinds.Kind], ctx: _Context,
                    before: int) -> List[row_kinds.Kind]:
  """Outputs of an op that kept positions the tower's own: its integer rows
  hold such positions too; if the op needs every tower (its rule reported
  events since `before`), they are made the whole batch's first."""
  if len(ctx.events) > before or (ctx.needs_towers is not None and
                                  ctx.needs_towers is op):
    events = ctx.events[before:]
    del ctx.events[before:]
    converted = [
        ctx.value_of_positions(op, index, kind) for index, kind in kept
    ]
    ctx.events.extend(events)
    local = row_kinds.any_local(converted)
    return list(outputs) if local is None else [local] * len(outputs)
  whole = all(kind.whole for _, kind in kept)
  return [
      row_kinds.Positions(k.axis, whole)
      if isinstance(k, row_kinds.Rows) and t.dtype.is_integer else k
      for t, k in zip(op.outputs, outputs)
  ]


_COPIES = frozenset(["Identity", "Snapshot", "StopGradient"])

_STATEFUL_CALLS = frozenset(["StatefulPartitionedCall", "PartitionedCall"])


def _coordinates(
    op: tf.Operation,
    kinds: Sequence[row_kinds.Kind]) -> Optional[List[row_kinds.Kind]]:
  """The outputs of an op taking coordinates' columns (`Coordinates`), or
  None: column 0 alone is positions of the tower's rows, others are rows;
  a copy or a cast is coordinates still. Any other op sees them as rows."""
  if op.type == "ConcatV2" and kinds and all(
      isinstance(k, row_kinds.Coordinates)
      for k in kinds[:-1]) and (static.static_ints(op.inputs[-1]) == [0]):
    return [row_kinds.Coordinates()]
  if not kinds or not isinstance(kinds[0], row_kinds.Coordinates):
    return None
  if op.type in _COPIES or op.type == "Cast" and op.outputs[0].dtype.is_integer:
    return [row_kinds.Coordinates()] * len(op.outputs)
  if op.type in ("GatherV2",
                 "Gather") and (op.type == "Gather" or
                                (static.static_ints(op.inputs[2]) == [0])):
    # Some of the entries, all their coordinates.
    return [row_kinds.Coordinates()]
  if op.type != "StridedSlice" or op.inputs[0].shape.rank not in (None, 2):
    return None
  begin = static.static_ints(op.inputs[1])
  end = static.static_ints(op.inputs[2])
  strides = static.static_ints(op.inputs[3])
  if begin is None or end is None or strides is None or len(begin) != 2 or (
      op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask")):
    return None
  if (op.get_attr("begin_mask") & 1 or begin[0] == 0) and (
      op.get_attr("end_mask")
      & 1) and strides[0] == 1 and not (op.get_attr("shrink_axis_mask") & 1):
    # Every entry, some columns: column 0 alone, or with others.
    first = 0 if op.get_attr("begin_mask") & 2 else begin[1]
    single = op.get_attr("shrink_axis_mask") & 2 or (
        not op.get_attr("end_mask") & 2 and end[1] == first + 1)
    if first == 0 and single:
      return [row_kinds.Positions(0, False)]
    if first >= 1:
      return [row_kinds.Rows(0)]
  return None


def transfer(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
             ctx: _Context) -> Sequence[row_kinds.Kind]:
  """The kinds of `op`'s outputs given its inputs' (and the events)."""
  if not op.outputs:
    kinds, _ = _position_inputs(op, _size_inputs(op, kinds, ctx), ctx)
    if op.type in _STATEFUL_CALLS:
      # Its effect is what its body writes (a Keras metric's update).
      _transfer_rule(op, kinds, ctx)
    return []
  kinds = _size_inputs(op, kinds, ctx)
  coordinates = _coordinates(op, kinds)
  if coordinates is not None:
    return coordinates
  kinds = [
      row_kinds.Rows(0) if isinstance(k, row_kinds.Coordinates) else k
      for k in kinds
  ]
  kinds, kept = _position_inputs(op, kinds, ctx)
  orders = {k.order for k in kinds if isinstance(k, row_kinds.Rows)}
  if orders != {None} and orders:
    return _reordered(op, kinds, ctx, orders)
  if kept:
    before = len(ctx.events)
    outputs = _transfer_rule(op, kinds, ctx)
    return _kept_positions(op, kept, outputs, ctx, before)
  return _sparse_coordinates(op, _transfer_rule(op, kinds, ctx))


def _reordered(op: tf.Operation, kinds: Sequence[row_kinds.Kind], ctx: _Context,
               orders: Set[Any]) -> List[row_kinds.Kind]:
  """An op of rows in another order than one device's (`Rows.order`): as
  its rule says where that keeps them so (rows computed from rows, a
  reduction); the tower's own where it meets rows in another order, or
  needs one device's order (it would run on the whole batch)."""
  if len(orders) > 1:
    return [
        row_kinds.Local(
            op.name, "meets rows joined along the rows (in "
            "another order than one device's) with other rows")
    ] * len(op.outputs)
  order = next(iter(orders))
  before = len(ctx.events)
  outputs = _transfer_rule(op, [
      row_kinds.Rows(k.axis) if isinstance(k, row_kinds.Rows) else k
      for k in kinds
  ], ctx)
  if any(isinstance(e, row_kinds.Mixing) for e in ctx.events[before:]):
    del ctx.events[before:]
    return [
        row_kinds.Local(
            op.name, f"needs the rows in one device's order, "
            f"but {order!r} joined them along the rows (the "
            "towers' pieces interleave)")
    ] * len(op.outputs)
  return [
      row_kinds.Rows(k.axis, order) if isinstance(k, row_kinds.Rows) else k
      for k in outputs
  ]


def _sparse_coordinates(
    op: tf.Operation,
    outputs: Sequence[row_kinds.Kind]) -> Sequence[row_kinds.Kind]:
  """A sparse op's indices outputs of the tower's rows are coordinates."""
  if not op.type.startswith("Sparse") or op.type in _DENSE_SPARSE_NAMED:
    return outputs
  names = [arg.name for arg in op.op_def.output_arg]
  return [
      row_kinds.Coordinates() if isinstance(kind, row_kinds.Rows) and
      kind.axis == 0 and index < len(names) and "indices" in names[index] and
      tensor.shape.rank == 2 else kind
      for index, (tensor, kind) in enumerate(zip(op.outputs, outputs))
  ]


def _transfer_rule(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                   ctx: _Context) -> Sequence[row_kinds.Kind]:
  """`transfer` once sizes and positions are read (its rule)."""
  if (op.type in _SIZE_ARITHMETIC or op.type in op_types.ELEMENTWISE and
      all(t.dtype.is_integer for t in op.outputs)) and any(
          isinstance(k, row_kinds.Size) for k in kinds) and not any(
              isinstance(k, (row_kinds.Rows, row_kinds.Local)) for k in kinds):
    # Integers computed from shard sizes (and whole values) are sizes.
    return _size_arithmetic(op, kinds)
  if all(k is row_kinds.WHOLE for k in kinds) and op.type not in (
      "Range", "Fill") and op.type not in op_types.RANDOM_FROM_SHAPE:
    return [row_kinds.WHOLE] * len(op.outputs)
  rule = _TRANSFER.get(op.type, flow_rules.unknown)
  outputs = rule(op, kinds, ctx)
  if len(outputs) != len(op.outputs):
    outputs = (list(outputs) + [outputs[-1] if outputs else row_kinds.WHOLE] *
               len(op.outputs))[:len(op.outputs)]
  if _tf.custom_gradient_type(op) is not None and any(
      isinstance(k, row_kinds.Rows) for k in kinds):
    outputs = _custom_gradient(op, kinds, outputs, ctx)
  if op.type not in _KEEP_TOWER_SET:
    outputs = [
        row_kinds.Local(op.name, "computes from the tower's own distinct "
                        "values") if row_kinds.is_tower_set(k) else k
        for k in outputs
    ]
  return outputs


def _custom_gradient(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                     outputs: Sequence[row_kinds.Kind],
                     ctx: _Context) -> List[row_kinds.Kind]:
  """An op with a gradient of its own (`tf.custom_gradient`) on rows.

  Its gradient function is read as a body, on gradients with its outputs'
  rows: where it computes each row's gradient from the same row, the op is
  what its rule says; where it mixes rows (a gradient normalised by the
  batch's mean), the op runs once on the whole batch, so its gradient is
  taken once, of the whole batch's gradients. A function that mixes rows
  and reads the tower's own rows besides cannot be given the whole batch's.
  """
  name = _tf.custom_gradient_type(op)
  traced = _tf.trace_custom_gradient(op)
  reads_rows = False
  if traced is not None:
    inner = _Context(BODY, ctx.per_tower)
    body: Dict[Any, row_kinds.Kind] = {}
    for gradient, kind in zip(traced.gradients, outputs):
      body[gradient.ref()] = kind
    for outer, stand_in in traced.captures:
      body[stand_in.ref()] = ctx.kind_of(outer)
      reads_rows |= not row_kinds.shares_value(ctx.kind_of(outer))
    for body_op in traced.graph.get_operations():
      inputs = [body.get(t.ref(), row_kinds.WHOLE) for t in body_op.inputs]
      for tensor, kind in zip(body_op.outputs, transfer(body_op, inputs,
                                                        inner)):
        body.setdefault(tensor.ref(), kind)
    results = [
        body.get(t.ref(), row_kinds.WHOLE) if t is not None else None
        for t in traced.outputs
    ]
    per_row = inner.needs_towers is None and all(
        r is None or r == k or not isinstance(k, row_kinds.Rows)
        for r, k in zip(results, kinds))
    if per_row:
      return list(outputs)
  if reads_rows:
    return [
        row_kinds.Local(
            op.name, f"has a custom gradient ({name}) that mixes the batch's "
            "rows and reads the tower's own rows besides; compute the "
            "gradient from its upstream gradient alone, or run the "
            "model_fn unreplicated")
    ] * len(op.outputs)
  logging.vlog(
      1, "replicate: %s's custom gradient mixes rows: it runs once "
      "on the whole batch", op.name)
  return ctx.whole_batch(op, outputs, f"has a custom gradient ({name}) that "
                         "mixes rows")


# Ops whose outputs hold, for each of the tower's distinct values, what is
# computed from that value alone (an embedding looked up by it, its
# partition): the tower's rows' indices may pick them back as rows.
_KEEP_TOWER_SET = op_types.ELEMENTWISE | op_types.PASS_THROUGH | frozenset([
    "Unique", "UniqueV2", "GatherV2", "Gather", "ResourceGather", "GatherNd",
    "Reshape", "ExpandDims", "Squeeze", "Shape", "Size", "Range",
    "DynamicPartition", "DynamicStitch", "ParallelDynamicStitch"
])


class TowerRows:
  """The kinds of one tower's tensors, found op by op in creation order.

  Args:
    declared: kinds of tensors the tower did not compute (its inputs, the
      stand-ins and results of meetings), by `tensor.ref()`.
    per_tower: whether an op's statistics are asked to stay the tower's
      (`sync_batch_norm=False`).
  """

  def __init__(self,
               declared: Mapping[Any, row_kinds.Declared],
               per_tower: Callable[[tf.Operation], bool] = lambda op: False):
    self._kinds: Dict[Any, row_kinds.Declared] = dict(declared)
    self._per_tower = per_tower
    self._done: Set[tf.Operation] = set()
    self.events: List[row_kinds.Event] = []

  def declare(self, declared: Mapping[Any, row_kinds.Declared]) -> None:
    self._kinds.update(declared)

  def kind(self, tensor: Optional[tf.Tensor]) -> row_kinds.Kind:
    """The kind of `tensor` (WHOLE for a tensor the tower did not build)."""
    if tensor is None:
      return row_kinds.WHOLE
    kind = self._kinds.get(tensor.ref(), row_kinds.WHOLE)
    seen = 0
    while isinstance(kind, row_kinds.Like) and seen < 64:
      kind = self._kinds.get(kind.tensor.ref(), row_kinds.WHOLE)
      seen += 1
    return row_kinds.WHOLE if isinstance(kind, row_kinds.Like) else kind

  def run(self, ops: Iterable[tf.Operation]) -> List[row_kinds.Event]:
    """Finds the kinds of `ops`' outputs (ops in creation order)."""
    ctx = _Context(TOWER, self._per_tower, self.kind)
    for op in ops:
      if op in self._done:
        continue
      self._done.add(op)
      kinds = [self.kind(t) for t in op.inputs]
      for tensor, kind in zip(op.outputs, transfer(op, kinds, ctx)):
        if tensor.ref() not in self._kinds:
          self._kinds[tensor.ref()] = kind
    self.events.extend(ctx.events)
    return ctx.events


def function_kinds(
    op: tf.Operation, kinds: Sequence[row_kinds.Kind],
    per_tower: Callable[[tf.Operation], bool],
    mode: str) -> Optional[Tuple[List[row_kinds.Kind], Optional[tf.Operation]]]:
  """(the kinds of a call's outputs, the first op of its bodies that needs
  every tower, or None), read from its bodies; None where unreadable."""
  bodies = _tf.function_bodies(op)
  if bodies is None:
    return None
  needs: List[tf.Operation] = []

  def body_kinds(body: Any,
                 arguments: Sequence[row_kinds.Kind]) -> List[row_kinds.Kind]:
    outputs, inner = _body_kinds(body, arguments, per_tower, mode)
    if inner is not None:
      needs.append(inner)
    return outputs

  if op.type in ("If", "StatelessIf", "Case", "StatelessCase"):
    arguments = kinds[1:]
    branches = [body_kinds(body, arguments) for body in bodies]
    outputs = [row_kinds.join(column) for column in zip(*branches)]
    if isinstance(kinds[0], row_kinds.Rows) or row_kinds.is_local(kinds[0]):
      outputs = [
          row_kinds.Local(op.name, "branches on a value of the tower's rows")
          for _ in outputs
      ]
  elif op.type in ("While", "StatelessWhile"):
    condition, body = bodies
    carried = list(kinds)
    for _ in range(4):
      after = body_kinds(body, carried)
      # A value carried from row to row of a loop over the rows (a fold,
      # a scan) accumulates the tower's own rows.
      joined = [
          row_kinds.Local(op.name, "accumulates the tower's rows in a loop "
                          "over them") if row_kinds.is_one_row(k) else k
          for k in (row_kinds.join([a, b]) for a, b in zip(carried, after))
      ]
      if joined == carried:
        break
      carried = joined
    tested = body_kinds(condition, carried)
    outputs = carried
    if tested and (row_kinds.is_local(tested[0]) or
                   isinstance(tested[0], row_kinds.Rows)):
      # A loop whose trip count depends on the tower's rows.
      outputs = [
          row_kinds.Local(op.name, "loops as long as the tower's rows say")
          if not isinstance(k, (row_kinds.Rows, row_kinds.Listed)) and
          k is not row_kinds.WHOLE else k for k in outputs
      ]
  else:
    outputs = body_kinds(bodies[0], kinds)
  return outputs, (needs[0] if needs else None)


def _body_kinds(
    body: Any, arguments: Sequence[row_kinds.Kind],
    per_tower: Callable[[tf.Operation], bool],
    mode: str) -> Tuple[List[row_kinds.Kind], Optional[tf.Operation]]:
  """(the kinds of a body's outputs, its first op needing every tower)."""
  kinds: Dict[Any, row_kinds.Kind] = {}
  ctx = _Context(mode, per_tower,
                 lambda tensor: kinds.get(tensor.ref(), row_kinds.WHOLE))
  for tensor, kind in zip(body.inputs, arguments):
    kinds[tensor.ref()] = kind
  for op in body.get_operations():
    inputs = [kinds.get(t.ref(), row_kinds.WHOLE) for t in op.inputs]
    for tensor, kind in zip(op.outputs, transfer(op, inputs, ctx)):
      kinds.setdefault(tensor.ref(), kind)
  outputs = [
      kinds.get(t.ref(), row_kinds.WHOLE) if t is not None else row_kinds.WHOLE
      for t in body.outputs
  ]
  return outputs, ctx.needs_towers


def declared_inputs(shards: Any) -> Dict[Any, row_kinds.Kind]:
  """Kinds of a tower's input tensors: rows; a sparse shape holds a size."""
  kinds: Dict[Any, row_kinds.Kind] = {}
  for leaf in tf.nest.flatten(shards, expand_composites=False):
    if leaf is None:
      continue
    if isinstance(leaf, tf.SparseTensor):
      kinds[leaf.indices.ref()] = row_kinds.Coordinates()
      kinds[leaf.values.ref()] = row_kinds.Rows(0)
      kinds[leaf.dense_shape.ref()] = row_kinds.Size(False, frozenset([0]))
    elif isinstance(leaf, tf.RaggedTensor):
      kinds[leaf.flat_values.ref()] = row_kinds.Rows(0)
      # Offsets into the tower's own values.
      for splits in leaf.nested_row_splits:
        kinds[splits.ref()] = row_kinds.Positions(0, False)
    elif isinstance(leaf, tf.Tensor):
      kinds[leaf.ref()] = row_kinds.Rows(0)
  return kinds
