"""Edits of ops already built: inputs, control inputs, devices, colocation.

TensorFlow builds an op's inputs, control inputs, device and colocation
once; the library rewires them afterwards (Operation's `_update_input`,
`_add_control_input`, `_set_device`, `_set_attr`, ...).
"""

from typing import Any, Dict, Iterable, List, Sequence

import tensorflow as tf

# pylint: disable=protected-access,g-direct-tensorflow-import
from tensorflow.core.framework import attr_value_pb2 as _attr_value_pb2


def update_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
  """Makes `op` read `tensor` as its input `index` (Operation._update_input)."""
  op._update_input(index, tensor)


def add_control_input(op: tf.Operation, control: tf.Operation) -> None:
  """Makes `op` run after `control` (Operation._add_control_input)."""
  op._add_control_input(control)


def remove_control_inputs(op: tf.Operation,
                          drop: Iterable[tf.Operation]) -> None:
  """Makes `op` no longer wait for the ops in `drop`
  (Operation._remove_all_control_inputs, then _add_control_inputs)."""
  dropped = set(drop)
  kept = [c for c in op.control_inputs if c not in dropped]
  op._remove_all_control_inputs()
  op._add_control_inputs(kept)


def copy_gradient_function(source: tf.Operation, copy: tf.Operation) -> None:
  """Gives `copy` the gradient function `source` was built with, if any
  (Operation._gradient_function): a tf.function's call op gets it from
  the function, not from the gradient registry."""
  function = getattr(source, "_gradient_function", None)
  if function is not None:
    copy._gradient_function = function


def op_id(op: tf.Operation) -> int:
  """The position of `op` in its graph, in order of creation (Operation._id)."""
  return op._id


def control_outputs(op: tf.Operation) -> List[tf.Operation]:
  """The ops that run after `op` (Operation._control_outputs)."""
  return list(op._control_outputs)


def replace_colocation(op: tf.Operation, renamed: Dict[bytes, bytes]) -> bool:
  """Makes `op` colocated with renamed ops (its `_class` attribute, through
  Operation._set_attr); returns whether it changed."""
  if "_class" not in op.node_def.attr:
    return False
  groups = list(op.get_attr("_class"))
  changed = [renamed.get(g, g) for g in groups]
  if changed == groups:
    return False
  op._set_attr(
      "_class",
      _attr_value_pb2.AttrValue(
          list=_attr_value_pb2.AttrValue.ListValue(s=changed)))
  return True


def set_device(op: tf.Operation, device: str) -> None:
  """Places `op` on `device` after it is built (Operation._set_device)."""
  op._set_device(device)


def rewire(tensor: tf.Tensor,
           replacement: tf.Tensor,
           keep: Sequence[tf.Operation] = ()) -> int:
  """Every consumer of `tensor` but `keep` reads `replacement` instead.

  Returns how many inputs changed.
  """
  kept = set(keep)
  changed = 0
  for consumer in list(tensor.consumers()):
    if consumer in kept:
      continue
    for index, value in enumerate(consumer.inputs):
      if value is tensor:
        update_input(consumer, index, replacement)
        changed += 1
  return changed


def unknown_shapes_attr(shapes: Iterable[Any]) -> Any:
  """An AttrValue listing `shapes` (TensorShapeProtos) with unknown sizes."""
  relaxed = [
      tf.TensorShape(None) if s.unknown_rank else tf.TensorShape([None] *
                                                                 len(s.dim))
      for s in shapes
  ]
  return _attr_value_pb2.AttrValue(
      list=_attr_value_pb2.AttrValue.ListValue(
          shape=[shape.as_proto() for shape in relaxed]))
