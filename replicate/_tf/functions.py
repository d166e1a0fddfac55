"""Function bodies a call op runs, and copies of them placed on a device.

TensorFlow has no public API to read the graph a function-call op (If,
While, PartitionedCall, ...) runs, nor to copy a library function with
its ops on another device.
"""

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import tensorflow as tf


def function_bodies(op: tf.Operation) -> Optional[List[Any]]:
  """The FuncGraphs a function-call op runs, or None where unknown.

  cond_v2 keeps its branches on the If op (`_true_graph`, `_false_graph`);
  other calls name functions of the graph's library, whose entries keep
  the graph they were traced from (`Graph._get_function(...).graph`).
  """
  if op.type in ("If", "StatelessIf") and hasattr(op, "_true_graph"):
    return [op._true_graph, op._false_graph]
  names: List[str] = []
  for attr in ("then_branch", "else_branch", "cond", "body", "f", "branches"):
    try:
      value = op.get_attr(attr)
    except ValueError:
      continue
    values = value if isinstance(value, list) else [value]
    names.extend(v.name for v in values)
  if not names:
    return None
  graph = op.graph
  bodies = []
  for name in names:
    function = graph._get_function(name)
    body = getattr(function, "graph", None)
    if body is None:
      return None
    bodies.append(body)
  return bodies


# Attributes of a node that name the functions it calls.
_CALL_ATTRIBUTES = ("then_branch", "else_branch", "cond", "body", "f",
                    "branches")


def function_on_device(graph: tf.Graph,
                       name: str,
                       suffix: str,
                       device: str,
                       copied: Optional[Dict[str, str]] = None) -> str:
  """A copy of `graph`'s function `name` (and of those it calls) whose ops
  are placed on `device`; returns the copy's name, `name` + `suffix`.

  A function body's ops keep the devices they were traced under; a call
  copied onto another device runs them there only in such a copy. Reads
  the function's definition (`Graph._get_function(name).definition`) and
  adds the copy to the graph's library through the C API
  (`TF_FunctionImportFunctionDef`, `TF_GraphCopyFunction` on
  `Graph._c_graph`).
  """
  from tensorflow.core.framework import function_pb2
  from tensorflow.python.client import pywrap_tf_session
  copied = {} if copied is None else copied
  if name in copied:
    return copied[name]
  definition = function_pb2.FunctionDef()
  definition.CopyFrom(graph._get_function(name).definition)
  new = f"{name}{suffix}"
  copied[name] = new
  definition.signature.name = new
  for node in definition.node_def:
    node.device = device
    if "_class" in node.attr:
      # Colocation with the original body's ops: the copy's are its own.
      del node.attr["_class"]
    for attribute in _CALL_ATTRIBUTES:
      if attribute not in node.attr:
        continue
      value = node.attr[attribute]
      if value.HasField("func"):
        value.func.name = function_on_device(graph, value.func.name, suffix,
                                             device, copied)
      for function in value.list.func:
        function.name = function_on_device(graph, function.name, suffix, device,
                                           copied)
  imported = pywrap_tf_session.TF_FunctionImportFunctionDef(
      definition.SerializeToString())
  try:
    pywrap_tf_session.TF_GraphCopyFunction(graph._c_graph, imported, None)
  finally:
    pywrap_tf_session.TF_DeleteFunction(imported)
  return new


def called_functions(op: tf.Operation) -> Dict[str, Any]:
  """`op`'s attributes naming functions it calls: name -> AttrValue."""
  return {
      name: value
      for name, value in op.node_def.attr.items()
      if name in _CALL_ATTRIBUTES and
      (value.HasField("func") or value.list.func)
  }


class TracedGradient(NamedTuple):
  """A custom gradient function traced on stand-ins for its gradients.

  `graph`: the FuncGraph holding its ops; `gradients`: the stand-ins, one
  per output of the op; `captures`: (outer tensor, its stand-in inside) for
  each tensor of the model the function reads; `outputs`: the gradients it
  returns for the op's inputs (None where it gives none).
  """
  graph: Any
  gradients: List[tf.Tensor]
  captures: List[Tuple[tf.Tensor, tf.Tensor]]
  outputs: List[Optional[tf.Tensor]]


def custom_gradient_type(op: tf.Operation) -> Optional[str]:
  """The name `op`'s gradient is registered under when it is not its
  type's own (`tf.custom_gradient`'s IdentityN: `_gradient_op_type`)."""
  try:
    name = op.get_attr("_gradient_op_type")
  except ValueError:
    return None
  return name.decode() if isinstance(name, bytes) else name


def trace_custom_gradient(op: tf.Operation) -> Optional[TracedGradient]:
  """`op`'s registered gradient function called once in a scratch
  FuncGraph on placeholders shaped as `op`'s outputs, so its ops can be
  read as a function body's; None where it cannot be called so.

  Looks the function up in the gradient registry
  (`ops.get_gradient_function`) and traces it in a `func_graph.FuncGraph`,
  which captures what it reads of the model's graph.
  """
  from tensorflow.python.framework import func_graph
  from tensorflow.python.framework import ops
  try:
    function = ops.get_gradient_function(op)
  except LookupError:
    return None
  if function is None:
    return None
  scratch = func_graph.FuncGraph(f"replicate_gradient_of_{op.name}")
  with scratch.as_default():
    gradients = [
        tf.compat.v1.placeholder(t.dtype, t.shape, name=f"gradient_{i}")
        for i, t in enumerate(op.outputs)
    ]
    try:
      outputs = function(op, *gradients)
    except Exception:  # pylint: disable=broad-except
      # What it reads (a shape, a Python value) cannot be had here: the
      # caller then takes the gradient to mix rows.
      return None
  if not isinstance(outputs, (list, tuple)):
    outputs = [outputs]
  return TracedGradient(scratch, gradients, list(scratch.captures),
                        [_dense(o) for o in outputs])


def _dense(value: Any) -> Optional[tf.Tensor]:
  """A gradient's tensor of values (an IndexedSlices' values), or None."""
  if isinstance(value, tf.IndexedSlices):
    return value.values
  return value if isinstance(value, tf.Tensor) else None
