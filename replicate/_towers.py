"""Building the towers: one call of the user's model_fn per device.

Each tower builds under its own name scope (none for tower 0, `tower_i/`
after), its own device function, and a variable creator that hands later
towers the variables tower 0 created, so that one set of model variables is
shared whatever API created them (get_variable, tf.compat.v1.layers or Keras
layers, which ignore variable-scope reuse).
"""

import contextlib
from typing import Callable

import tensorflow as tf
from absl import logging

from replicate import _sharing
from replicate._context import Replication
from replicate._context import Tower
from replicate._context import absolute_name_scope


@contextlib.contextmanager
def _own_collections(replication: Replication, index: int):
  """Keeps the towers' update ops and summaries apart.

  Each tower sees in UPDATE_OPS the ops from before tower 0 and its own, as
  the unwrapped model_fn would. Summaries of towers after the first are
  dropped: TensorBoard shows tower 0's, under the unwrapped model's names.
  """
  graph = replication.graph
  updates = graph.get_collection_ref(tf.compat.v1.GraphKeys.UPDATE_OPS)
  updates[:] = replication.update_ops_before
  summaries = graph.get_collection_ref(tf.compat.v1.GraphKeys.SUMMARIES)
  summaries_before = list(summaries)
  yield
  if index > 0:
    summaries[:] = summaries_before


@contextlib.contextmanager
def tower_scope(replication: Replication, index: int,
                device_function: Callable[[tf.Operation], str],
                device: str, name_counters: _sharing.NameCounters):
  """Builds tower `index`: its name scope, reuse, devices and variables."""
  replication.created.append({})
  replication.tower = Tower(index, replication.num_towers, device)
  name_counters.restore()
  with contextlib.ExitStack() as stack:
    stack.enter_context(_own_collections(replication, index))
    graph = replication.graph
    if index > 0:
      stack.enter_context(tf.compat.v1.variable_scope(
          replication.root_variable_scope, reuse=True))
      stack.enter_context(
          absolute_name_scope(graph, replication.root_name_scope))
      name_root = stack.enter_context(graph.name_scope(f"tower_{index}"))
    else:
      name_root = (replication.root_name_scope + "/"
                   if replication.root_name_scope else "")
    stack.enter_context(tf.compat.v1.device(device_function))
    stack.enter_context(tf.compat.v1.variable_creator_scope(
        _sharing.variable_creator(replication, index, name_root)))
    logging.info("replicate: building tower %d of %d on %s", index,
                 replication.num_towers, device)
    first_op = len(graph.get_operations())
    yield replication.tower
    ops = graph.get_operations()[first_op:]
    replication.tower_ops.append(ops)
    replication.tower_op_names.update(op.name for op in ops)
