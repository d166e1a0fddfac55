"""Rows rules of control flow and containers: tf.cond's Switch and Merge,
function calls, TensorLists and TensorArrays, and ops no rule knows.

Each rule maps an op and its inputs' kinds (see `_batch.row_kinds`) to
its outputs' kinds, and reports through `ctx` (`_batch.rows`) what needs
every tower; `RULES` maps op types to rules.
"""

from typing import Dict, List, Sequence, Set

from absl import logging
import tensorflow as tf

from replicate._batch import row_kinds


def _switch(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
            ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  data, pred = kinds
  if row_kinds.is_local(pred) or isinstance(pred, row_kinds.Rows):
    return row_kinds.same_for_outputs(
        op,
        row_kinds.Local(op.name, "branches on a value of the "
                        "tower's rows"))
  return row_kinds.same_for_outputs(op, data)


def _merge(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
           ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  return [row_kinds.join(kinds), row_kinds.WHOLE]


def _tensor_list_from_tensor(
    op: tf.Operation, kinds: Sequence[row_kinds.Kind],
    ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  kind = kinds[0]
  if isinstance(kind, row_kinds.Rows):
    if kind.axis == 0:
      return [row_kinds.Listed(row_kinds.ROWS_LISTED)]
    return [row_kinds.Listed(kind.axis - 1)]
  return [kind if row_kinds.is_local(kind) else row_kinds.WHOLE]


def _tensor_list_set(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                     ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  listed, item = kinds[0], kinds[2]
  if _lists_rows(listed):
    # A list of the rows: an element computed from its row (or from no
    # rows) keeps it one.
    if row_kinds.is_one_row(item) or item is row_kinds.WHOLE:
      return [listed]
    return [
        item if row_kinds.is_local(item) else row_kinds.Local(
            op.name, "puts rows into a list of the rows")
    ]
  if isinstance(item, row_kinds.Rows):
    if isinstance(listed, row_kinds.Listed) and listed.axis != item.axis:
      return [
          row_kinds.Local(op.name, "mixes rows of different axes in a list")
      ]
    return [row_kinds.Listed(item.axis)]
  if row_kinds.is_local(item):
    return [item]
  return [listed]


def _lists_rows(kind: row_kinds.Kind) -> bool:
  return isinstance(kind,
                    row_kinds.Listed) and kind.axis == row_kinds.ROWS_LISTED


def _tensor_list_get(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                     ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  listed = kinds[0]
  if _lists_rows(listed):
    if ctx.mode == row_kinds.TOWER_OPS:
      # A row taken by its position outside a loop (a scan's first row):
      # one device's row at that position, on the whole batch.
      return ctx.whole_batch(op, [row_kinds.WHOLE],
                             "takes one of the rows by its position")
    return [row_kinds.one_row(op)]
  if isinstance(listed, row_kinds.Listed):
    return [row_kinds.Rows(listed.axis)]
  return [listed if row_kinds.is_local(listed) else row_kinds.WHOLE]


def _tensor_list_stack(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                       ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  listed = kinds[0]
  if isinstance(listed, row_kinds.Listed):
    return [row_kinds.Rows(listed.axis + 1)]
  return [listed if row_kinds.is_local(listed) else row_kinds.WHOLE]


def _tensor_list_other(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                       ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  listed = kinds[0] if kinds else row_kinds.WHOLE
  if op.type == "TensorListReserve" and isinstance(kinds[1], row_kinds.Size):
    # As long as the rows: a list of them (`tf.map_fn`'s results).
    listed = row_kinds.Listed(row_kinds.ROWS_LISTED)
  outputs: List[row_kinds.Kind] = []
  for tensor in op.outputs:
    if tensor.dtype == tf.variant:
      outputs.append(
          listed if isinstance(listed, (row_kinds.Listed,
                                        row_kinds.Local)) else row_kinds.WHOLE)
    elif op.type == "TensorListLength" and _lists_rows(listed):
      outputs.append(row_kinds.Size(True))
    else:
      outputs.append(row_kinds.WHOLE)
  return outputs


def _tensor_array_write(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                        ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  # TensorArrayWriteV3(handle, index, value, flow_in) -> flow_out
  item, flow = kinds[2], kinds[3]
  if _lists_rows(flow):
    if row_kinds.is_one_row(item) or item is row_kinds.WHOLE:
      return [flow]
    return [
        item if row_kinds.is_local(item) else row_kinds.Local(
            op.name, "puts rows into a list of the rows")
    ]
  if isinstance(item, row_kinds.Rows):
    return [row_kinds.Listed(item.axis)]
  if row_kinds.is_local(item):
    return [item]
  return [flow]


def _tensor_array_scatter(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                          ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  # TensorArrayScatterV3(handle, indices, value, flow_in) -> flow_out
  value, flow = kinds[2], kinds[3]
  if isinstance(value, row_kinds.Rows):
    if value.axis == 0:
      return [row_kinds.Listed(row_kinds.ROWS_LISTED)]
    return [row_kinds.Listed(value.axis - 1)]
  return [value if row_kinds.is_local(value) else flow]


def _tensor_array_read(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                       ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  flow = kinds[-1]
  if _lists_rows(flow):
    return [row_kinds.one_row(op)]
  if isinstance(flow, row_kinds.Listed):
    return [row_kinds.Rows(flow.axis)]
  return [flow if row_kinds.is_local(flow) else row_kinds.WHOLE]


def _tensor_array_gather(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
                         ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  flow = kinds[-1]
  if isinstance(flow, row_kinds.Listed):
    gathered: List[row_kinds.Kind] = [row_kinds.Rows(flow.axis + 1)]
    return gathered + [row_kinds.WHOLE] * (len(op.outputs) - 1)
  return row_kinds.same_for_outputs(
      op, flow if row_kinds.is_local(flow) else row_kinds.WHOLE)


def _call(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
          ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """A function call (tf.cond, tf.while_loop, tf.function): its bodies."""
  outputs = ctx.function_kinds(op, kinds)
  if outputs is None:
    local = row_kinds.any_local(kinds)
    if local:
      return row_kinds.same_for_outputs(op, local)
    if all(k is row_kinds.WHOLE for k in kinds):
      return row_kinds.same_for_outputs(op, row_kinds.WHOLE)
    return row_kinds.same_for_outputs(
        op,
        row_kinds.Local(
            op.name, "is a function call whose "
            "body replicate cannot read"))
  return outputs


# Op type -> rule.
RULES: Dict[str, row_kinds.Rule] = {
    "Switch":
        _switch,
    "RefSwitch":
        _switch,
    "Merge":
        _merge,
    "RefMerge":
        _merge,
    "TensorListFromTensor":
        _tensor_list_from_tensor,
    "TensorListSetItem":
        _tensor_list_set,
    "TensorListPushBack":
        lambda op, k, c: _tensor_list_set(op, [k[0], row_kinds.WHOLE, k[1]], c),
    "TensorListGetItem":
        _tensor_list_get,
    "TensorListPopBack":
        lambda op, k, c: [k[0], _tensor_list_get(op, k, c)[0]],
    "TensorListStack":
        _tensor_list_stack,
    "TensorArrayWriteV3":
        _tensor_array_write,
    "TensorArrayScatterV3":
        _tensor_array_scatter,
    "TensorArrayReadV3":
        _tensor_array_read,
    "TensorArrayGatherV3":
        _tensor_array_gather,
    "TensorArrayConcatV3":
        lambda op, k, c: [
            row_kinds.Local(op.name, "concatenates a list of rows")
            if isinstance(k[-1], row_kinds.Listed) and k[-1].axis == 0 else
            (row_kinds.Rows(k[-1].axis) if isinstance(k[-1], row_kinds.Listed)
             else row_kinds.WHOLE), row_kinds.WHOLE
        ],
    "If":
        _call,
    "StatelessIf":
        _call,
    "While":
        _call,
    "StatelessWhile":
        _call,
    "Case":
        _call,
    "StatelessCase":
        _call,
    "PartitionedCall":
        _call,
    "StatefulPartitionedCall":
        _call,
}

for op_type in ("TensorListReserve", "TensorListLength",
                "TensorListElementShape", "TensorListResize", "EmptyTensorList",
                "TensorArrayV3", "TensorArraySizeV3", "TensorArrayCloseV3"):
  RULES.setdefault(op_type, _tensor_list_other)

_unknown_logged: Set[str] = set()

# A graph collection of op type names (strings) the user declares to compute
# each row of their outputs from the same row of their inputs (custom ops).
PER_ROW_COLLECTION = "replicate_per_row_op_types"

# Ops of ragged tensors: each row's values are computed from the same
# row's (the towers' row partitions are their own).
_ROW_PARTITIONED = ("Ragged",)


def declared_per_row(op: tf.Operation) -> bool:
  """Whether the user declared `op`'s type to compute each row from its own
  row (`PER_ROW_COLLECTION`)."""
  return op.type in op.graph.get_collection(PER_ROW_COLLECTION)


def unknown(op: tf.Operation, kinds: Sequence[row_kinds.Kind],
            ctx: row_kinds.Context) -> Sequence[row_kinds.Kind]:
  """An op no rule knows: not assumed to keep rows apart, it runs once on
  the whole batch (logged once a type), unless declared per-row.

  Its outputs are taken to hold the rows where they keep an unknown
  extent on the first input's rows axis (as the shards' are), else to be
  one whole value (`row_kinds.rows_by_shape`); the run checks the guess
  and a wrong one fails with an error naming the op, never silently.
  """
  settled = row_kinds.without_rows(op, kinds)
  if settled is not None:
    return settled
  if all(k is row_kinds.WHOLE or k is row_kinds.SHARD for k in kinds):
    return row_kinds.same_for_outputs(op, row_kinds.SHARD)
  rows = [k for k in kinds if isinstance(k, row_kinds.Rows)]
  local = row_kinds.any_local(kinds)
  if local or not rows:
    return row_kinds.same_for_outputs(
        op, local or row_kinds.Local(
            op.name, f"is a {op.type} op, whose effect on rows replicate "
            "does not know"))
  axis = rows[0].axis
  if (declared_per_row(op) or op.type.startswith(_ROW_PARTITIONED)) and all(
      k.axis == 0 for k in rows):
    return [
        row_kinds.Rows(0) if t.shape.rank != 0 else row_kinds.Local(
            op.name, f"is a {op.type} op reducing rows to a scalar")
        for t in op.outputs
    ]
  if op.type not in _unknown_logged:
    _unknown_logged.add(op.type)
    logging.info(
        "replicate: %s ops have no rows rule: each runs once on the whole "
        "batch's rows (gathered on one device); if it computes each row "
        "from the same row, add its type to the graph collection %r", op.type,
        PER_ROW_COLLECTION)
  return ctx.whole_batch(
      op,
      row_kinds.rows_by_shape(op, axis),
      f"is a {op.type} op no rule knows",
      guessed=True)
