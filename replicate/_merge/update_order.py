"""The order of a step's reads of a variable and its updates of it.

On one device a read of a variable the model makes before an update of it
sees the old value: program order. Across towers nothing orders one tower's
read against the update another tower's ops trigger, so the reads and the
writes get control edges: the optimizer's update waits for every tower's
reads (`order_reads_before_updates`), and a combined state write waits for
the reads each tower makes before its own write (`Order.reads_before`).
The order is taken from the model's graph before any write is combined.
"""

import collections
from typing import Any, DefaultDict, Dict, List, Sequence, Set, Tuple

from absl import logging
import tensorflow as tf

from replicate import _graph
from replicate import _tf
from replicate._batch import step_ops
from replicate._context import Replication
from replicate._merge import state_writes


class Order:
  """Which of a tower's reads of a variable come before its writes.

  The order is the model's own, taken before any write is combined.
  """

  def __init__(
      self, graph: tf.Graph, tower_ops: Sequence[Sequence[tf.Operation]],
      writes: Sequence[Dict[Tuple[str, int], state_writes.Write]]) -> None:
    self._tower_of = {
        op: index for index, ops in enumerate(tower_ops) for op in ops
    }
    self._writes = writes
    self._control_outputs: DefaultDict[tf.Operation, List[tf.Operation]] = (
        collections.defaultdict(list))
    for op in graph.get_operations():
      for control in op.control_inputs:
        self._control_outputs[control].append(op)

  def reads_before(self, write: state_writes.Write) -> List[tf.Operation]:
    """The reads of `write`'s variable in its tower that no write of it
    there precedes (outside tf.cond / tf.while_loop bodies, which cannot be
    ordered from outside)."""
    tower = self._tower_of.get(write.op)
    reads = [
        op for op in self._readers(_graph.look_through(write.op.inputs[0]).op)
        if self._tower_of.get(op) == tower and not _tf.op_in_v1_control_flow(op)
    ]
    if not reads:
      return []
    name = write.variable.op.name
    after = set()
    assert tower is not None  # `write` is one of the towers' writes
    for (written, _), other in self._writes[tower].items():
      if written == name:
        after |= self._after(other.op)
    return [op for op in reads if op not in after]

  def readers(self, handle: tf.Operation) -> List[tf.Operation]:
    """The ops reading the variable `handle` makes (through Identity)."""
    return self._readers(handle)

  def after_all(self, ops: Sequence[tf.Operation]) -> Set[tf.Operation]:
    """Every op that runs after any of `ops` (data or control edges)."""

    def later(current: tf.Operation) -> List[tf.Operation]:
      return _graph.consumer_ops(current) + list(
          self._control_outputs.get(current, []))

    return set(_graph.walk([c for op in ops for c in later(op)], later))

  def _readers(self, handle: tf.Operation) -> List[tf.Operation]:
    found, pending = [], list(handle.outputs)
    while pending:
      tensor = pending.pop()
      for consumer in tensor.consumers():
        if consumer.type in _graph.IDENTITIES:
          pending.extend(consumer.outputs)
        elif (consumer.type not in state_writes.KINDS and
              not state_writes.call_writes(consumer, tensor)):
          found.append(consumer)
    return found

  def _after(self, op: tf.Operation) -> Set[tf.Operation]:

    def later(current: tf.Operation) -> List[tf.Operation]:
      return _graph.consumer_ops(current) + list(
          self._control_outputs.get(current, []))

    return set(_graph.walk(later(op), later))


def order_reads_before_updates(replication: Replication, order: Order,
                               specs: Sequence[Any]) -> None:
  """Every tower's reads of a variable run before the optimizer updates it.

  A model_fn may read a variable for a value the step fetches apart from
  the gradients' forward pass (Keras' `minimize(loss_fn)` builds the loss
  again inside its tape; a metric of the weights): nothing orders such a
  read against the update. On one device the read is ready when the step
  starts and runs first; a tower's read is one of many ready ops, on
  another device, and under load could run after the update, reporting
  the next step's weights. The update waits for every read that it does
  not itself precede, in every tower, so the step sees the weights as one
  device's program order has them.
  """
  # The updates are built by the optimizer's meeting, outside the towers'
  # own ops: every op since the first tower began.
  first = min(
      start for start, _ in replication.ranges.values() if start is not None)
  prefixes = state_writes.TRAINING_OP_PREFIXES
  updates = [
      op for op in replication.graph.get_operations()[first:]
      if op.type.startswith(prefixes) and op.inputs
  ]
  if not updates:
    return
  after = order.after_all(updates)
  in_towers = {op for ops in replication.tower_ops for op in ops}
  # Reads the step runs anyway: not an imported graph's unfed ops (a TF1 Hub
  # module's own graph beside its applied copy).
  run = run_by_the_step(replication, specs)
  for update in updates:
    reads = [
        op for op in order.readers(_graph.look_through(update.inputs[0]).op)
        if op in in_towers and op not in after and op.name in run and
        not op.type.startswith(prefixes) and not _tf.op_in_v1_control_flow(op)
    ]
    known = set(update.control_inputs)
    for read in reads:
      if read not in known:
        _tf.add_control_input(update, read)
  logging.vlog(1, "replicate: %d optimizer updates wait for their reads",
               len(updates))


def run_by_the_step(replication: Replication, specs: Sequence[Any]) -> Set[str]:
  """Names of the ops the step runs: tower 0's spec's, its values' whole
  batch's (every tower's partials), the other towers' predictions."""
  return step_ops.run_by_the_step(
      replication.graph, specs[:1], [s.predictions for s in specs[1:]] +
      list(replication.rewiring.replacements().values()))
