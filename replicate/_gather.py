"""Gathering the towers' gradients and applying their sum once, per graph.

Every TowerOptimizer call records the tower's gradients in the graph's
gathering state; the last tower's matching call sums each variable's
gradients over the towers and applies them where tower 0 made the call.
State belongs to a graph (Estimator builds a new one per mode) and is
cleared by each replicated model_fn call.
"""

import weakref
from typing import Any, Callable, List, NamedTuple

import tensorflow as tf

from replicate import _aggregate
from replicate import _context
from replicate import _transform


class _Call(NamedTuple):
  grads_and_vars: List[Any]
  scopes: _context.Scopes
  apply: Callable[[List[Any]], Any]   # applies summed gradients, this tower's way
  done: List[tf.Operation]            # what the call returned, to order after the apply


class _GatherState:
  """Gradients recorded in one graph: per tower, one entry per call."""

  def __init__(self):
    self.calls: List[List[_Call]] = []

  def record(self, tower_index: int, call: _Call) -> int:
    while len(self.calls) <= tower_index:
      self.calls.append([])
    self.calls[tower_index].append(call)
    return len(self.calls[tower_index]) - 1


_STATES: "weakref.WeakKeyDictionary[tf.Graph, _GatherState]" = (
    weakref.WeakKeyDictionary())


def _gather_state(graph: tf.Graph) -> _GatherState:
  if graph not in _STATES:
    _STATES[graph] = _GatherState()
  return _STATES[graph]


def clear_gather_state(graph: tf.Graph) -> List[List[Any]]:
  """Forgets the graph's recorded gradients; returns the calls, per tower."""
  state = _STATES.pop(graph, None)
  return state.calls if state is not None else []


def replicated():
  """The current replication if it has several towers, else None."""
  replication = _context.current_replication()
  if replication is None or replication.num_towers == 1:
    return None
  return replication


def scaled_loss(loss):
  replication = replicated()
  if replication is None:
    return loss
  return _aggregate.scale_loss(loss, replication.loss_reduction,
                               replication.fraction(), replication.size())


def transform_and_apply(grads_and_vars, transforms: "_transform.Pipeline",
                        apply_fn: Callable[[Any], Any]):
  """A TowerOptimizer's apply_gradients: the transforms, then `apply_fn`.

  Outside replication (or on one device) the transforms run on this
  device's gradients; in a tower the towers' gradients are summed first and
  the last tower applies them (see `gather_and_apply`).
  """
  replication = replicated()
  if replication is None:
    return apply_fn(transforms(transforms.prepare(grads_and_vars)))
  grads_and_vars = list(grads_and_vars)
  _transform.warn_if_clipped(grads_and_vars, replication.tower.index)
  return gather_and_apply(grads_and_vars,
                          lambda summed: apply_fn(transforms(summed)))


def gather_and_apply(grads_and_vars, apply: Callable[[List[Any]], Any]):
  """Records this tower's gradients; in the last tower applies their sums.

  The sums are applied with tower 0's `apply` (its optimizer object, whose
  slots and hooks are the model's) in tower 0's scopes. What towers before
  the last return runs after that apply, so whatever a tower orders after
  its train_op (an EMA of the weights, say) sees the updated variables.
  """
  replication = replicated()
  grads_and_vars = list(grads_and_vars)
  state = _gather_state(replication.graph)
  call = _Call(grads_and_vars, _context.Scopes.current(), apply, [])
  index = state.record(replication.tower.index, call)
  if not replication.is_last_tower:
    grads = [g for g, _ in grads_and_vars if g is not None]
    with tf.control_dependencies(tf.nest.flatten(grads, expand_composites=True)):
      call.done.append(tf.no_op(name="gather_gradients"))
    return call.done[0]
  calls = [_tower_call(state, tower, index, grads_and_vars)
           for tower in range(replication.num_towers)]
  with replication.scopes(calls[0].scopes):
    summed = _aggregate.sum_gradients([c.grads_and_vars for c in calls])
    applied = calls[0].apply(summed)
  applied_op = getattr(applied, "op", applied)
  for earlier in calls[:-1]:
    for op in earlier.done:
      # No public API adds a control input to an op once built.
      op._add_control_input(applied_op)  # pylint: disable=protected-access
  return applied


def _variable_names(grads_and_vars):
  return [v.op.name for _, v in grads_and_vars]


def _tower_call(state: _GatherState, tower: int, index: int, last_grads_and_vars):
  """Tower `tower`'s `index`-th call, checked against the last tower's."""
  calls = state.calls[tower] if tower < len(state.calls) else []
  if index >= len(calls):
    raise ValueError(
        f"Tower {tower} made {len(calls)} TowerOptimizer.apply_gradients "
        f"calls but the last tower made at least {index + 1}; every tower must "
        "make the same optimizer calls in the same order.")
  call = calls[index]
  if _variable_names(call.grads_and_vars) != _variable_names(last_grads_and_vars):
    raise ValueError(
        f"Optimizer call {index} of tower {tower} updates variables "
        f"{_variable_names(call.grads_and_vars)} but the last tower's updates "
        f"{_variable_names(last_grads_and_vars)}; every tower must make the "
        "same optimizer calls on the same variables in the same order.")
  return call
