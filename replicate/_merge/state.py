"""Model-state writes: one write per step, as on one device.

A model_fn changes model state outside the optimizer: batch-norm moving
statistics, EMA shadows, counters, the global step, the local variables
that hold eval metrics' state. Every tower builds such a write; this module
makes the towers' writes to one variable the one write of one device:

- a value the towers share with one device (every batch reduction is the
  whole batch's, see `_meet.rewiring`: a metric's totals, a moving mean, a
  counter) is written once, by tower 0;
- rows written into a variable (a scatter of the rows' indices and values)
  are every tower's rows, in batch order, written once;
- a value that stays each tower's (statistics asked for per tower,
  `sync_batch_norm=False`, or computed by ops replicate cannot split) is
  combined by the variable's declared `tf.VariableAggregation`: MEAN
  weighted by shard (with the variance between the shards added to a
  moving variance), SUM, ONLY_FIRST_REPLICA; NONE takes a running maximum
  or minimum over the towers, else a ValueError asks for an aggregation.

A tower that computed on a phantom row (see _prepare.split) adds nothing. Tower
0's write op carries the value; later towers' writes go to a throwaway variable
(dense) or write no rows (scatter) and run after tower 0's, so whatever a tower
ordered after its write sees the new state; tower 0's waits for every tower's
written value, so whatever a tower ordered before its write sees the state
before it. Initializers (`init_from_checkpoint` included) are never touched, and
a trainable variable updated by an optimizer the towers could not share is an
error.

This module runs the pass; the writes are found by `_merge.state_writes`,
compared by `_merge.state_compare`, combined by `_merge.state_combine`, and
ordered against the step's reads by `_merge.update_order`.
"""

import functools
from typing import Any, Sequence

from replicate._context import Replication
from replicate._merge import state_combine
from replicate._merge import state_writes
from replicate._merge import update_order


def combine_state_writes(replication: Replication,
                         specs: Sequence[Any]) -> None:
  """Makes the towers' writes to each model variable one write per step.

  Raises:
    ValueError: an optimizer outside TowerOptimizer updates a variable; the
      towers write a variable a different number of times or in different
      ways; a NONE-aggregation variable gets a value computed from the
      tower's inputs; or the write has no combined form for its aggregation.
  """
  variables = state_writes.state_variables(replication)
  skip = state_writes.initializer_ops(variables.values())
  writes = [
      state_writes.tower_writes(ops, variables, skip)
      for ops in replication.tower_ops
  ]
  sinks = state_combine.Sinks()
  order = update_order.Order(replication.graph, replication.tower_ops, writes)
  update_order.order_reads_before_updates(replication, order, specs)
  for key in sorted({k for tower in writes for k in tower}):
    group = [tower.get(key) for tower in writes]
    state_combine.combine(replication, group, sinks, order)
  # After the writes are combined: what the step runs then is final.
  state_writes.check_writes_in_functions(
      replication, variables, skip,
      functools.partial(update_order.run_by_the_step, replication, specs))
