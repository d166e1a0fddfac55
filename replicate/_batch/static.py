"""Integer values of shape tensors known while the graph is built.

A rule needs the axes, sizes and positions an op is given; these are
folded from the few ops shape arithmetic uses, without running the graph.
"""

from typing import Callable, Dict, List, Optional, cast

import numpy as np
import tensorflow as tf

from replicate import _context
from replicate import _graph

# Ops a small integer vector built from constants may go through.
_FOLDABLE = frozenset([
    "Const", "Identity", "Tile", "ConcatV2", "Concat", "Pack", "Squeeze",
    "ExpandDims", "Reshape", "Cast", "Fill", "Range", "AddV2", "Add", "Sub",
    "Mul", "StridedSlice", "Slice", "Neg", "Maximum", "Minimum", "Prod", "Sum",
    "ZerosLike", "OnesLike"
])


def _folded_ints(tensor: tf.Tensor, limit: int = 32) -> Optional[List[int]]:
  """An int vector computed from constants alone, evaluated; else None.

  `tf.get_static_value` folds a few ops only (not Tile or Squeeze, which
  MultiHead's logits slices are built with).
  """
  if not tensor.dtype.is_integer or tensor.shape.rank not in (0, 1):
    return None
  cache = _context.graph_store(tensor.graph, "folded ints")
  if tensor.ref() not in cache:
    cache[tensor.ref()] = _fold(tensor, limit)
  return cache[tensor.ref()]


def _fold(tensor: tf.Tensor, limit: int) -> Optional[List[int]]:
  ops: Dict[str, tf.Operation] = {}
  for op in _graph.walk([tensor.op], _graph.input_ops):
    if op.type not in _FOLDABLE or len(ops) >= limit or op.control_inputs:
      return None
    ops[op.name] = op
  graph_def = tf.compat.v1.GraphDef()
  for op in sorted(ops.values(), key=lambda o: o.name):
    node = graph_def.node.add()
    node.CopyFrom(op.node_def)
    node.ClearField("device")
  with tf.Graph().as_default() as graph:
    tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
      value = session.run(graph.get_tensor_by_name(tensor.name))
  return [int(v) for v in np.reshape(value, [-1])]


def partial_ints(tensor: tf.Tensor,
                 depth: int = 0) -> Optional[List[Optional[int]]]:
  """The entries of an int vector known when built (None: not known).

  Follows constants, stacks, concatenations and slices of a static shape,
  as a new shape is usually written (`[v, -1]` joined to `tf.shape(x)[1:]`).
  """
  values = _some_known(static_ints(tensor))
  if values is not None:
    return values
  op = tensor.op
  if depth > 8 or tensor.shape.rank != 1:
    return None
  if op.type in ("Tile", "Squeeze", "Reshape", "ExpandDims"):
    values = _some_known(_folded_ints(tensor))
    if values is not None:
      return values
  length = tensor.shape.num_elements()
  if op.type in ("ZerosLike", "OnesLike") and length is not None:
    return [0 if op.type == "ZerosLike" else 1] * length
  if op.type in ("Mul", "AddV2", "Add", "Sub") and length is not None:
    parts = []
    for part in op.inputs:
      found = (
          _some_known(static_ints(part))
          if part.shape.rank == 0 else partial_ints(part, depth + 1))
      if found is None:
        return None
      parts.append(found * length if len(found) == 1 else found)
    apply: Callable[[int, int], int] = {
        "Mul": lambda a, b: a * b,
        "Sub": lambda a, b: a - b
    }.get(op.type, lambda a, b: a + b)
    return [
        None if a is None or b is None else apply(a, b) for a, b in zip(*parts)
    ]
  if op.type == "Pack":
    return [(_some_known(static_ints(t)) or [None])[0] for t in op.inputs]
  if op.type in ("ConcatV2", "Concat"):
    parts = op.inputs[:-1] if op.type == "ConcatV2" else op.inputs[1:]
    entries: List[Optional[int]] = []
    for part in parts:
      found = partial_ints(part, depth + 1)
      if found is None:
        length = part.shape.num_elements()
        if length is None:
          return None
        found = [None] * length
      entries.extend(found)
    return entries
  length = tensor.shape.num_elements()
  return None if length is None else [None] * length


def _some_known(values: Optional[List[int]]) -> Optional[List[Optional[int]]]:
  """`values` as entries some of which may be unknown (the same list)."""
  return cast(Optional[List[Optional[int]]], values)


def static_ints(tensor: tf.Tensor) -> Optional[List[int]]:
  """The entries of an int tensor known when built, or None: folded by
  TensorFlow, else from constants through a few ops (the permutation
  `tf.nn.softmax(x, axis=0)` builds from ranges and a difference)."""
  value = tf.get_static_value(tensor)
  if value is None:
    return _folded_ints(tensor)
  return [int(v) for v in np.reshape(value, [-1])]


def rank_of(tensor: tf.Tensor) -> Optional[int]:
  """The static rank of `tensor`, or None."""
  return tensor.shape.rank


def axis_in(axis: int, rank: Optional[int]) -> Optional[int]:
  """`axis` as a non-negative index, or None where the rank is unknown."""
  if axis >= 0:
    return axis
  return None if rank is None else axis % rank


_SAME_VALUE = frozenset(["Identity", "Cast", "Snapshot"])


def counts_rows(tensor: tf.Tensor) -> bool:
  """Whether `tensor` is a count the towers' own add up to one device's:
  a tensor's size, or one entry of its shape (through casts)."""
  op = tensor.op
  while op.type in _SAME_VALUE and op.inputs:
    op = op.inputs[0].op
  if op.type == "Size":
    return True
  if op.type == "StridedSlice":
    return op.inputs[0].op.type in ("Shape", "ShapeN") and (
        op.get_attr("shrink_axis_mask") == 1)
  if op.type == "Unpack":
    return op.inputs[0].op.type in ("Shape", "ShapeN")
  return False


def permutes_rows(tensor: tf.Tensor) -> bool:
  """Whether `tensor` is a permutation of a vector's rows: the positions a
  sort of all of them gives (`tf.argsort` of a vector is `top_k`'s indices
  with k its length)."""
  tensor = _graph.look_through(tensor, _SAME_VALUE)
  op = tensor.op
  return (op.type == "TopKV2" and tensor is op.outputs[1] and
          rank_of(op.inputs[0]) == 1 and counts_rows(op.inputs[1]))


def row_ints(tensor: tf.Tensor, index: int) -> Optional[List[int]]:
  """Row `index` of an int matrix known when built, though other rows may
  not be (`tf.pad`'s paddings `[[0, 0], [0, n - t], [0, 0]]` are stacked
  rows)."""
  values = static_ints(tensor)
  if values is not None and tensor.shape.rank == 2 and (tensor.shape[1]
                                                        is not None):
    width = int(tensor.shape[1])
    return values[index * width:(index + 1) * width]
  op = tensor.op
  if op.type == "Pack" and op.get_attr("axis") == 0 and index < len(op.inputs):
    return static_ints(op.inputs[index])
  return None
