"""The model-state writes each tower makes, found in its ops.

A write is an op that assigns, adds to or scatters into a model or metric
variable (`KINDS`), in the tower's own ops; the towers share their
variables (`_towers.sharing`), so every tower's n-th write to a variable is
one write of one device, made N times. Initializers (`init_from_checkpoint`
included) are not writes of the step. An optimizer's own update of a
variable is an error here: only `TowerOptimizer`'s is built once. A write
inside a function call (tf.cond, tf.while_loop, tf.function) cannot be
combined with another tower's, so it is refused where the step runs it with
the tower's rows (`check_writes_in_functions`).
"""

import collections
import enum
from typing import (
    AbstractSet,
    Callable,
    Counter,
    Dict,
    Iterable,
    NamedTuple,
    Set,
    Tuple,
)

from absl import logging
import tensorflow as tf

from replicate import _graph
from replicate._batch import row_kinds
from replicate._context import Replication


class Kind(enum.Enum):
  """How a write changes its variable."""
  VALUE = "assign"
  ADD = "assign_add"
  SUB = "assign_sub"
  SCATTER_ADD = "scatter_add"  # rows added (or subtracted): linear
  SCATTER = "scatter"  # rows replaced or combined otherwise
  SLICE = "strided_slice_assign"


# The write ops by type; their variable is input 0.
KINDS = {
    "AssignVariableOp": Kind.VALUE,
    "Assign": Kind.VALUE,
    "AssignAddVariableOp": Kind.ADD,
    "AssignAdd": Kind.ADD,
    "AssignSubVariableOp": Kind.SUB,
    "AssignSub": Kind.SUB,
    "ResourceStridedSliceAssign": Kind.SLICE,
    "StridedSliceAssign": Kind.SLICE,
}
for _name in ("Add", "Sub", "NdAdd", "NdSub"):
  KINDS["ResourceScatter" + _name] = KINDS["Scatter" + _name] = (
      Kind.SCATTER_ADD)
for _name in ("Update", "Mul", "Div", "Min", "Max", "NdUpdate", "NdMin",
              "NdMax"):
  KINDS["ResourceScatter" + _name] = KINDS["Scatter" + _name] = Kind.SCATTER
del _name

_RESTORES = frozenset(["RestoreV2", "Restore", "RestoreSlice"])
# Prefixes of the types of an optimizer's update ops.
TRAINING_OP_PREFIXES = ("Apply", "ResourceApply", "SparseApply",
                        "ResourceSparseApply")
# Ops that read a resource variable's value from its handle.
READS = frozenset(["ReadVariableOp"])


class Write(NamedTuple):
  """One write op of a tower, how it writes, and the variable it writes."""
  op: tf.Operation
  kind: Kind
  variable: tf.Variable


def state_variables(replication: Replication) -> Dict[str, tf.Variable]:
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


def initializer_ops(variables: Iterable[tf.Variable]) -> Set[str]:
  """The names of the variables' initializer ops: never the step's writes."""
  names = set()
  for variable in variables:
    initializer = variable.initializer
    names.add(getattr(initializer, "op", initializer).name)
  return names


def _is_initializer(op: tf.Operation) -> bool:
  """A write of a checkpoint's value (`init_from_checkpoint`)."""
  return any(_graph.look_through(t).op.type in _RESTORES for t in op.inputs[1:])


def tower_writes(ops: Iterable[tf.Operation], variables: Dict[str, tf.Variable],
                 skip: AbstractSet[str]) -> Dict[Tuple[str, int], Write]:
  """(variable name, n) -> the tower's n-th write to that variable.

  Raises:
    ValueError: an optimizer outside TowerOptimizer updates a variable.
  """
  counts: Counter[str] = collections.Counter()
  writes = {}
  for op in ops:
    if op.name in skip or not op.inputs:
      continue
    variable = variables.get(_graph.look_through(op.inputs[0]).op.name)
    if variable is None:
      continue
    if op.type.startswith(TRAINING_OP_PREFIXES):
      raise ValueError(
          f"{op.type} op {op.name!r} updates variable {variable.op.name!r} "
          "outside replicate.TowerOptimizer, so every tower would apply its "
          "own update; wrap the optimizer in replicate.TowerOptimizer (every "
          "optimizer of the model_fn).")
    kind = KINDS.get(op.type)
    if kind is None or _is_initializer(op):
      continue
    name = variable.op.name
    writes[(name, counts[name])] = Write(op, kind, variable)
    counts[name] += 1
  return writes


def call_writes(op: tf.Operation, tensor: tf.Tensor) -> bool:
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
      variable = variables.get(_graph.look_through(tensor).op.name)
      if (variable is None or tensor.dtype != tf.resource or
          position in read_only):
        continue
      name = variable.op.name
      writes[(name, counts[name])] = (op, variable)
      counts[name] += 1
  return writes


def check_writes_in_functions(replication: Replication,
                              variables: Dict[str, tf.Variable],
                              skip: AbstractSet[str],
                              run_by_the_step: Callable[[], Set[str]]) -> None:
  """Refuses writes inside tf.cond / tf.while_loop bodies that differ.

  A function call's writes cannot be combined with another tower's (its
  ops are in its body, not in the graph). Tower 0's are the model's where
  the body sees no rows (a gradient accumulator zeroed or applied every k
  steps, say: the values are the whole batch's) or where the call was made
  to read the whole batch (a Keras metric's update_state); the other
  towers' are never run unless something the step runs reads them.
  `run_by_the_step` gives the names of the ops the step runs; it is called
  at first need only, since it walks the graph.

  Raises:
    ValueError: a write the step runs reads the tower's rows inside a
      function call.
  """
  run = None
  rewiring = replication.rewiring
  for index, ops in enumerate(replication.tower_ops):
    for op, variable in _function_writes(ops, variables, skip).values():
      if index == 0:
        kinds = [rewiring.kind(t) for t in op.inputs]
        if rewiring.reads_whole_batch(op) or all(
            row_kinds.shares_value(k) for k in kinds):
          continue
      if run is None:
        run = run_by_the_step()
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
