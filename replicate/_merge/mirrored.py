"""MIRRORED: a copy of each trained variable on every tower device.

The towers are built with one set of variables on tower 0's device, the
optimizer's gradients summed between the devices (`_meet.all_reduce`) and
its update built once, on tower 0's device. Once the graph is complete,
`mirror` makes it run on every device at the bandwidth minimum:

- each variable the update writes (the trained variables, their slots)
  gets a copy on every other tower device, a local variable initialised
  from the original (so checkpoints hold the original only, under its own
  name, and a restore or warm start reaches every copy when the session's
  local variables are initialised); the original's initialiser, which
  `Variable.load` runs with the value fed, sets the copies too, last when
  both initialisers run in one step;
- each tower's reads of such a variable read its own device's copy;
- the update (every op from the summed gradients to the writes: the code
  between compute and apply, the optimizer's own ops) is copied onto every
  other device, reading that device's sums and copies. Each copy runs the
  same ops on the same bits as tower 0's: the copies stay bitwise equal.

An update inside a function body (a dynamic loss scale's tf.cond) is
copied with its bodies, placed on each device. Where copies cannot give
one device's result (a variable also written outside the update, an update
inside a v1 tf.cond) nothing is mirrored: the variables stay on tower 0's
device, read from there, as exact as before and slower, and the warning
says why and how to avoid it. In evaluation and prediction (no update) the
towers read their own device's copies of the model's variables.
"""

from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from absl import logging
import tensorflow as tf

from replicate import _context
from replicate import _graph
from replicate import _tf
from replicate._prepare import devices as _devices

# Ops that run a function body.
_FUNCTION_CALLS = frozenset([
    "If", "StatelessIf", "Case", "StatelessCase", "While", "StatelessWhile",
    "PartitionedCall", "StatefulPartitionedCall"
])
# Ops that take a variable's handle and only read it.
_READS = frozenset([
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "_ReadVariablesOp"
])


def _components(value: Any) -> List[tf.Tensor]:
  if isinstance(value, tf.IndexedSlices):
    return [value.values, value.indices]
  return [value]


def _variable_handle_op(tensor: tf.Tensor) -> Optional[tf.Operation]:
  return tensor.op if tensor.op.type == "VarHandleOp" else None


def _written(op: tf.Operation) -> List[tf.Operation]:
  """The variables `op` may write: those whose handle it takes, unless it
  only reads them (a read op, or a function call's input TensorFlow marks
  read-only)."""
  if op.type in _READS:
    return []
  try:
    read_only = set(op.get_attr("_read_only_resource_inputs"))
  except ValueError:
    read_only = set()
  written = []
  for position, tensor in enumerate(op.inputs):
    source = _variable_handle_op(tensor)
    if source is not None and position not in read_only:
      written.append(source)
  return written


class _Plan:
  """What `mirror` copies: the variables and the update's ops."""

  def __init__(self, replication: _context.Replication,
               variables: Dict[tf.Operation, tf.Variable]) -> None:
    self.replication = replication
    gradients = replication.mirrored_gradients
    # Seen gradient tensor -> its sums on every tower's device.
    self.sums: Dict[Any, List[tf.Tensor]] = {}
    for gradient in gradients:
      for position, seen in enumerate(_components(gradient.seen)):
        self.sums[seen.ref()] = [
            _components(own)[position] for own in gradient.per_tower
        ]
    seeds = [seen.deref() for seen in self.sums]
    # What the sums are computed from (the towers' forward and backward
    # passes, the all-reduce): never copied.
    self.before: Set[tf.Operation] = set(
        _graph.walk([
            t.op
            for g in gradients
            for own in g.per_tower
            for t in _components(own)
        ], _graph.input_and_control_ops))
    initializers = {
        v.initializer for v in variables.values() if v.initializer is not None
    }
    self.excluded = self.before | initializers
    self.variables: Set[tf.Operation] = set()
    self.ops: List[tf.Operation] = []
    self.refusal: Optional[str] = None
    from_gradients = self._descendants([t.op for t in seeds], seeds)
    for op in from_gradients:
      self.variables.update(_written(op))
    while True:
      starts = [c for v in self.variables for c in v.outputs[0].consumers()]
      region = from_gradients | self._descendants(starts, [])
      writes = [
          op for op in region
          if _written(op) and set(_written(op)) <= self.variables or
          op in from_gradients and _written(op)
      ]
      grown = {v for op in writes for v in _written(op)} - self.variables
      if not grown:
        break
      self.variables |= grown
    # Through data edges, and control edges from what the gradients feed
    # (a read the update merely waits for is not part of it).
    updating = set(
        _graph.walk(
            writes, lambda op: [
                t.op
                for t in op.inputs
                if t.op in region and t.ref() not in self.sums
            ] + [c for c in op.control_inputs if c in from_gradients]))
    self.ops = _in_order(updating)
    self._check(initializers, variables)

  def _descendants(self, starts: Iterable[tf.Operation],
                   seeds: List[tf.Tensor]) -> Set[tf.Operation]:
    """Ops reading (through data edges) `starts` or `seeds`, outside the
    forward pass, the sums and the initialisers."""
    first = [c for t in seeds for c in t.consumers()]
    found = set(
        _graph.walk([op for op in list(starts) + first], _graph.consumer_ops))
    return {
        op for op in found
        if op not in self.excluded and op.type != "VarHandleOp" and not any(
            t.ref() in self.sums for t in op.outputs)
    }

  def _check(self, initializers: Set[tf.Operation],
             variables: Dict[tf.Operation, tf.Variable]) -> None:
    """Sets `refusal` where copies could not give one device's result."""
    members = set(self.ops)
    device = _devices.device_key(self.replication.placed[0])
    for variable in sorted(self.variables, key=lambda v: v.name):
      if variable not in variables:
        self.refusal = f"variable {variable.name} is in no collection"
        return
      # Unpinned (the Estimator's global step): placed with its update.
      if variable.device and _devices.device_key(variable.device) != device:
        self.refusal = (f"variable {variable.name} is on {variable.device}, "
                        "not on tower 0's device")
        return
      for reader in variable.outputs[0].consumers():
        if (_written(reader) and reader not in members and
            reader not in initializers):
          self.refusal = (f"variable {variable.name} is also written by "
                          f"{reader.name} ({reader.type}), outside the "
                          "optimizer's update (to keep the copies at the "
                          "bandwidth minimum, constrain it after the update: "
                          "a layer's kernel_constraint, or a write after the "
                          "optimizer's op)")
          return
    for op in self.ops:
      if _tf.op_in_v1_control_flow(op):
        self.refusal = (f"the update's op {op.name} is inside a v1 tf.cond or "
                        "tf.while_loop, whose frames cannot be copied op by "
                        "op (build it with control flow v2, TensorFlow 2's "
                        "default: tf.compat.v1.enable_control_flow_v2())")
        return


def _in_order(ops: Set[tf.Operation]) -> List[tf.Operation]:
  """`ops` with each after its inputs and control inputs among them (a
  control input can be added after an op is built)."""
  ordered: List[tf.Operation] = []
  placed: Set[tf.Operation] = set()
  for start in sorted(ops, key=_tf.op_id):
    pending = [(start, False)]
    while pending:
      op, ready = pending.pop()
      if op in placed:
        continue
      if ready:
        placed.add(op)
        ordered.append(op)
        continue
      pending.append((op, True))
      pending.extend((dep, False)
                     for dep in _graph.input_and_control_ops(op)
                     if dep in ops and dep not in placed)
  return ordered


def _variables_by_handle() -> Dict[tf.Operation, tf.Variable]:
  """The graph's resource variables (global and local) by handle op."""
  found = {}
  for variable in (*tf.compat.v1.global_variables(),
                   *tf.compat.v1.local_variables()):
    handle = getattr(variable, "handle", None)
    if isinstance(handle, tf.Tensor):
      found[handle.op] = variable
  return found


def mirror(replication: _context.Replication) -> None:
  """Copies the trained variables and their update onto every tower device.

  See the module docstring. Call once the towers and their merged state
  writes are built, before anything else reads the graph's ops.
  """
  by_handle = _variables_by_handle()
  if not replication.mirrored_gradients:
    _mirror_reads(replication, by_handle)
    return
  plan = _Plan(replication, by_handle)
  if plan.refusal is not None or not plan.variables:
    logging.warning(
        "replicate: MIRRORED keeps the variables on %s only (each tower "
        "reads them from there; results unchanged): %s", replication.placed[0],
        plan.refusal or "no variable is updated")
    return
  copies: Dict[tf.Operation, List[tf.Tensor]] = {}
  for variable in plan.variables:
    if not variable.device:
      # Unpinned (the Estimator's global step): on tower 0's device, with
      # its update, not where a tower's read of it would draw it.
      _tf.set_device(variable, replication.placed[0])
  with _context.outside(replication), replication.library():
    for variable in sorted(plan.variables, key=lambda v: v.name):
      copies[variable] = [variable.outputs[0]] + [
          _copy_variable(by_handle[variable], index, device)
          for index, device in enumerate(replication.placed)
          if index
      ]
  _read_own_copies(replication, copies)
  clones, triggers = _copy_update(replication, plan, copies)
  _wait_for_copies(plan, clones, triggers)
  _order_own_reads(plan, clones, copies)
  logging.info(
      "replicate: MIRRORED: %d variables copied on %d devices, their update "
      "(%d ops) applied on each", len(copies), replication.num_towers,
      len(plan.ops))


def _mirror_reads(replication: _context.Replication,
                  by_handle: Dict[tf.Operation, tf.Variable]) -> None:
  """No update (evaluation, prediction, training without gradients): the
  model's variables the towers read get a copy on every other tower device,
  which that tower reads; filled from the original (restored from the
  checkpoint) when the session starts, so no step moves them. A variable
  the graph writes (besides its initialiser) stays one, read where it is."""
  local = {id(v) for v in tf.compat.v1.local_variables()}
  others = {
      op for index, ops in enumerate(replication.tower_ops) if index
      for op in ops
  }
  read = []
  for handle, variable in sorted(by_handle.items(), key=lambda i: i[0].name):
    consumers = handle.outputs[0].consumers()
    if id(variable) in local or not any(c in others for c in consumers):
      continue
    if any(_written(c) and c is not variable.initializer for c in consumers):
      continue
    read.append(handle)
  if not read:
    return
  copies: Dict[tf.Operation, List[tf.Tensor]] = {}
  with _context.outside(replication), replication.library():
    for handle in read:
      if not handle.device:
        _tf.set_device(handle, replication.placed[0])
      copies[handle] = [handle.outputs[0]] + [
          _copy_variable(by_handle[handle], index, device)
          for index, device in enumerate(replication.placed)
          if index
      ]
  _read_own_copies(replication, copies)
  logging.info(
      "replicate: MIRRORED: %d variables read from a copy on each of the %d "
      "devices", len(copies), replication.num_towers)


def _copy_variable(original: tf.Variable, index: int, device: str) -> tf.Tensor:
  """A local copy of `original` on `device`, initialised from it.

  Its own initialiser (run with the local variables, after a restore)
  takes the original's value, or its initial value while it has none. The
  original's initialiser (run with the global variables, or by
  `Variable.load` with the value fed) sets the copy to the same initial
  value, after the copy's own initialiser when both run in one step.
  """
  name = original.op.name
  initializer = original.initializer
  assigns = initializer is not None and initializer.type == "AssignVariableOp"
  initial = initializer.inputs[1] if assigns else original.initial_value
  dtype = original.dtype.base_dtype
  with tf.device(device):
    value = tf.cond(
        tf.raw_ops.VarIsInitializedOp(resource=original.handle),
        lambda: tf.raw_ops.ReadVariableOp(
            resource=original.handle, dtype=dtype),
        lambda: tf.identity(initial))
    copy = tf.compat.v1.Variable(
        value,
        trainable=False,
        collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
        name=_copy_name(original.graph, f"tower_{index}/{name}"),
        dtype=dtype,
        shape=original.shape,
        use_resource=True)
    if assigns:
      with tf.control_dependencies([copy.initializer]):
        also = tf.raw_ops.AssignVariableOp(resource=copy.handle, value=initial)
      _tf.add_control_input(initializer, also)
  return copy.handle


def _copy_name(graph: tf.Graph, name: str) -> str:
  """`name` exactly where no op has it (the tower reserved it for its own
  name of the variable, `_towers.views`), else made unique."""
  try:
    graph.get_operation_by_name(name)
  except KeyError:
    return name + "/"
  return name


def _read_own_copies(replication: _context.Replication,
                     copies: Dict[tf.Operation, List[tf.Tensor]]) -> None:
  """Each tower's reads of a mirrored variable read its device's copy.

  The ops of tower i's model_fn call (not the variables' creation, which
  the first tower built runs for all) that take the variable's handle; ops
  a tower colocated with a variable (an embedding lookup's gather) and
  their gradients (named after them) go with its device's copy; and ops
  colocated with any op moved (a gather's gradient) follow it.
  """
  tower_of = {
      op: index for index, ops in enumerate(replication.tower_ops) if index
      for op in ops
  }
  moved: Dict[bytes, str] = {}
  for variable, handles in copies.items():
    for reader in list(variable.outputs[0].consumers()):
      index = tower_of.get(reader, 0)
      if not index:
        continue
      for position, value in enumerate(reader.inputs):
        if value is variable.outputs[0]:
          _tf.update_input(reader, position, handles[index])
      _tf.set_device(reader, replication.placed[index])
      moved[f"loc:@{reader.name}".encode()] = replication.placed[index]
  renamed = [{
      f"loc:@{variable.name}".encode():
          f"loc:@{handles[index].op.name}".encode()
      for variable, handles in copies.items()
  }
             for index in range(replication.num_towers)]
  for op in replication.graph.get_operations():
    index = _named_tower(replication, op.name)
    if index and _tf.replace_colocation(op, renamed[index]):
      _tf.set_device(op, replication.placed[index])
      moved[f"loc:@{op.name}".encode()] = replication.placed[index]
  for op in replication.graph.get_operations():
    if "_class" not in op.node_def.attr:
      continue
    for group in op.get_attr("_class"):
      if group in moved:
        _tf.set_device(op, moved[group])
        break


def _named_tower(replication: _context.Replication, name: str) -> int:
  """The tower an op's name says it was built for ('tower_i/...' or a
  gradient's '.../tower_i/...'); 0 for the rest."""
  for index in range(1, replication.num_towers):
    prefix = replication.tower_prefix(index)
    if name.startswith(prefix) or f"/{prefix}" in name:
      return index
  return 0


def _copy_update(
    replication: _context.Replication, plan: _Plan,
    copies: Dict[tf.Operation, List[tf.Tensor]]
) -> Tuple[Dict[tf.Operation, List[tf.Operation]], Dict[tf.Operation,
                                                        tf.Operation]]:
  """The update's ops once more on every other tower device; and for a
  copied function call, the op running it (reading its outputs)."""
  graph = replication.graph
  clones: Dict[tf.Operation, List[tf.Operation]] = {op: [op] for op in plan.ops}
  triggers: Dict[tf.Operation, tf.Operation] = {}
  for op in plan.ops:
    _tf.set_device(op, replication.placed[0])
  with _context.outside(replication), replication.library():
    for index in range(1, replication.num_towers):
      device = replication.placed[index]
      functions: Dict[str, str] = {}
      mapped: Dict[Any, tf.Tensor] = {}
      for variable, handles in copies.items():
        mapped[variable.outputs[0].ref()] = handles[index]
      for seen, sums in plan.sums.items():
        mapped[seen] = sums[index]
      for op in plan.ops:
        inputs = [mapped.get(t.ref(), t) for t in op.inputs]
        attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
        # A function body (a dynamic loss scale's tf.cond around the update)
        # runs on the device its copy was placed on.
        for key, value in _tf.called_functions(op).items():
          placed = type(value)()
          placed.CopyFrom(value)
          if placed.HasField("func"):
            placed.func.name = _tf.function_on_device(graph, value.func.name,
                                                      f"_tower_{index}", device,
                                                      functions)
          for function in placed.list.func:
            function.name = _tf.function_on_device(graph, function.name,
                                                   f"_tower_{index}", device,
                                                   functions)
          attrs[key] = placed
        with tf.device(device):
          clone = graph.create_op(
              op.type,
              inputs, [t.dtype for t in op.outputs],
              name=f"tower_{index}/{op.name}",
              attrs=attrs)
        for control in op.control_inputs:
          own = clones.get(control)
          copied_control = own[index] if own else control
          _tf.add_control_input(clone,
                                triggers.get(copied_control, copied_control))
        for output, copied in zip(op.outputs, clone.outputs):
          mapped[output.ref()] = copied
          copied.set_shape(output.shape)
        if clone.outputs and _tf.called_functions(op):
          # A function call runs its body for its outputs: what waits for
          # the copy waits for them (a control edge alone would not run it).
          with tf.device(device):
            triggers[clone] = tf.group(
                *[
                    tf.identity(t, name=f"{clone.name}_ran_{position}")
                    for position, t in enumerate(clone.outputs)
                ],
                name=f"{clone.name}_ran")
        clones[op].append(clone)
  return clones, triggers


def _wait_for_copies(plan: _Plan, clones: Dict[tf.Operation,
                                               List[tf.Operation]],
                     triggers: Dict[tf.Operation, tf.Operation]) -> None:
  """Whatever runs after a step of the update runs after each copy of it."""
  members = set(plan.ops)
  copied = {c for own in clones.values() for c in own} | set(triggers.values())
  for op in plan.ops:
    for follower in {
        *(c for t in op.outputs for c in t.consumers()),
        *_tf.control_outputs(op)
    }:
      if follower in members or follower in copied:
        continue
      for clone in clones[op][1:]:
        clone = triggers.get(clone, clone)
        if clone not in follower.control_inputs:
          _tf.add_control_input(follower, clone)


def _order_own_reads(plan: _Plan, clones: Dict[tf.Operation,
                                               List[tf.Operation]],
                     copies: Dict[tf.Operation, List[tf.Tensor]]) -> None:
  """Each copy's writes wait for the reads of their own copy only.

  The update waited for every tower's reads of its variable (see
  `_merge.state`); those reads now read their own device's copy, so each
  device's writes wait for that device's reads alone.
  """
  instance: Dict[tf.Operation, int] = {}
  for handles in copies.values():
    for index, handle in enumerate(handles):
      instance[handle.op] = index
  for op in plan.ops:
    for index, clone in enumerate(clones[op]):
      others = []
      for control in clone.control_inputs:
        read = [
            instance[t.op]
            for t in control.inputs
            if t.op in instance and control.type in _READS
        ]
        if read and read[0] != index:
          others.append(control)
      if others:
        _tf.remove_control_inputs(clone, others)
