"""Whether the towers' writes to a variable write values computed alike.

Two questions, one walk (`difference`) over a pair of towers' values:

- A value one device computes once (the whole batch's) must be built alike
  in every tower (`check_written_alike`); a difference found is an error
  the user can fix, and the walk reports only what it finds.
- Towers' per-tower values computed by the same ops from the same tensors
  are one value (`written_alike`), so a mean of them is tower 0's: the walk
  proves it, and counts anything it cannot prove as a difference.
"""

from typing import List, Optional

import numpy as np
import tensorflow as tf

from replicate import _graph
from replicate._merge import state_writes

# Ops the walk compares per pair of written values before it gives up.
_BUDGET = 64
# Ops looked through when looking for a difference: they pass a value on.
_PASSING = frozenset(["Identity", "Snapshot"])
_READS_SHAPE = frozenset(["Shape", "ShapeN", "Size", "Rank"])


def difference(a: tf.Tensor, b: tf.Tensor, budget: List[int],
               strict: bool) -> Optional[str]:
  """How tower values `a` and `b` are computed differently, or None.

  One walk for both of this module's questions; only its rules differ.
  Either way `a` and `b` are alike where they are one tensor, or the same
  output of ops of one type whose inputs are alike, and the walk looks at
  `budget[0]` ops at most.

  Strict (proving one value, `written_alike`): the ops' attributes must
  match too, a stateful op is a difference unless it reads a variable with
  the same control inputs, and running out of budget is a difference.
  Otherwise (reporting a difference, `check_written_alike`): Identity and
  Snapshot are looked through, constants compare by value, shape reads are
  alike (a size read as a value is the whole batch's by now,
  `_meet.rewiring`), and running out of budget finds nothing.
  """
  if not strict:
    a, b = _graph.look_through(a, _PASSING), _graph.look_through(b, _PASSING)
  if a is b:
    return None
  budget[0] -= 1
  if budget[0] < 0:
    return "too many ops to compare" if strict else None
  op_a, op_b = a.op, b.op
  if op_a.type != op_b.type or a.value_index != b.value_index:
    return f"{op_a.name} is {op_a.type}, {op_b.name} is {op_b.type}"
  if op_a.type == "Const" and not strict:
    value_a = tf.make_ndarray(op_a.get_attr("value"))
    value_b = tf.make_ndarray(op_b.get_attr("value"))
    if value_a.shape != value_b.shape or not np.array_equal(
        value_a, value_b, equal_nan=value_a.dtype.kind in "fc"):
      return f"constant {op_a.name} is {value_a}, {op_b.name} is {value_b}"
    return None
  if len(op_a.inputs) != len(op_b.inputs):
    return f"{op_a.name} and {op_b.name} read different numbers of inputs"
  if strict:
    if op_a.type in state_writes.READS:
      if op_a.control_inputs != op_b.control_inputs:
        return f"{op_a.name} and {op_b.name} wait for different ops"
    elif op_a.op_def.is_stateful:
      return f"{op_a.name} is stateful"
    attrs = [{
        k: v for k, v in op.node_def.attr.items() if not k.startswith("_")
    } for op in (op_a, op_b)]
    if attrs[0] != attrs[1]:
      return f"{op_a.name} and {op_b.name} differ in attributes"
  elif op_a.type in _READS_SHAPE:
    # What is left reads shapes of values every tower has alike.
    return None
  for x, y in zip(op_a.inputs, op_b.inputs):
    found = difference(x, y, budget, strict)
    if found is not None:
      return found
  return None


def check_written_alike(group: List[Optional[state_writes.Write]]) -> None:
  """A value one device computes once must be computed alike in every tower.

  Where a tower's write differs from tower 0's in a constant (a shard's
  size taken from a static shape as a Python number, say), the towers do
  not agree on it and tower 0's is not one device's.

  Raises:
    ValueError: a tower's write differs from tower 0's.
  """
  first = group[0]
  assert first is not None  # the caller refuses a group without tower 0
  for index, write in enumerate(group[1:], start=1):
    if write is None:
      continue
    for a, b in zip(first.op.inputs[1:], write.op.inputs[1:]):
      found = difference(a, b, [_BUDGET], strict=False)
      if found is not None:
        name = first.variable.op.name
        raise ValueError(
            f"Towers 0 and {index} write {name!r} ({first.op.name}, "
            f"{write.op.name}) with values that should be one device's but "
            f"differ: {found}. A number taken from a tensor's static "
            "shape (x.shape[0], a Python int) is the tower's shard size; "
            "use tf.shape(x)[0] (the whole batch's size wherever it is a "
            "value), or declare the variable's aggregation.")


def written_alike(group: List[state_writes.Write]) -> bool:
  """Whether every tower writes what tower 0 writes, computed alike.

  Synchronised batch norm hands every tower the statistics made on the
  consolidation device, so each tower's moving-average write is the same
  arithmetic on the same tensors: combining them would only add ops (and a
  rounding).
  """
  value = group[0].op.inputs[1]
  return all(w.kind is group[0].kind and
             difference(value, w.op.inputs[1], [_BUDGET], strict=True) is None
             for w in group[1:])
