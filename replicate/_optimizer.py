"""TowerOptimizer: gathers every tower's gradients and applies their sum once.

In towers 0..N-2 `apply_gradients` records the gradients and returns an op
that depends on them; in the last tower it sums each variable's gradients
over the towers and applies the sums with the wrapped optimizer, under tower
0's scopes so that slot variables are named as without replication.
"""

import weakref
from typing import Any, Callable, List, Union

import tensorflow as tf

from replicate import _aggregate
from replicate import _towers

_Optimizer = tf.compat.v1.train.Optimizer


class _GatherState:
  """Gradients recorded in one graph: per tower, one list per call."""

  def __init__(self):
    self.calls: List[List[Any]] = []

  def record(self, tower_index: int, grads_and_vars) -> int:
    while len(self.calls) <= tower_index:
      self.calls.append([])
    self.calls[tower_index].append(list(grads_and_vars))
    return len(self.calls[tower_index]) - 1


_STATES: "weakref.WeakKeyDictionary[tf.Graph, _GatherState]" = (
    weakref.WeakKeyDictionary())


def gather_state(graph: tf.Graph) -> _GatherState:
  """This graph's gathering state, created on first use."""
  if graph not in _STATES:
    _STATES[graph] = _GatherState()
  return _STATES[graph]


def clear_gather_state(graph: tf.Graph) -> List[List[Any]]:
  """Forgets the graph's recorded gradients; returns them, per tower."""
  state = _STATES.pop(graph, None)
  return state.calls if state is not None else []


def _variable_names(grads_and_vars):
  return [v.op.name for _, v in grads_and_vars]


class TowerOptimizer(_Optimizer):
  """Wraps an optimizer so that replicated towers apply one summed update.

  Use it wherever the model_fn builds its optimizer:

      opt = replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(1e-3))
      train_op = opt.minimize(loss, tf.compat.v1.train.get_global_step())

  Inside `replicate_model_fn` with several towers, `compute_gradients`
  weights the tower's loss by its share of the batch (for averaging loss
  reductions) and the last tower's `apply_gradients` applies the gradients
  summed over all towers. Outside, or with one tower, it passes every call
  straight to the wrapped optimizer.

  Args:
    optimizer_or_optimizer_fn: a `tf.compat.v1.train.Optimizer`, or a
      function of no arguments returning one; the function is called once per
      graph, when the optimizer is first needed.

  Raises:
    ValueError: the argument is neither an optimizer nor callable.
  """

  def __init__(self, optimizer_or_optimizer_fn: Union[
      _Optimizer, Callable[[], _Optimizer]]):
    if isinstance(optimizer_or_optimizer_fn, _Optimizer):
      self._fixed = optimizer_or_optimizer_fn
      self._optimizer_fn = None
      name = optimizer_or_optimizer_fn.get_name()
    elif callable(optimizer_or_optimizer_fn):
      self._fixed = None
      self._optimizer_fn = optimizer_or_optimizer_fn
      name = "TowerOptimizer"
    else:
      raise ValueError(
          f"TowerOptimizer got {optimizer_or_optimizer_fn!r}; pass a "
          "tf.compat.v1.train.Optimizer or a function of no arguments that "
          "returns one.")
    super().__init__(use_locking=False, name=name)
    self._built = weakref.WeakKeyDictionary()

  @property
  def optimizer(self) -> _Optimizer:
    """The wrapped optimizer (for a function, the one built for this graph)."""
    if self._fixed is not None:
      return self._fixed
    graph = tf.compat.v1.get_default_graph()
    if graph not in self._built:
      optimizer = self._optimizer_fn()
      if not isinstance(optimizer, _Optimizer):
        raise ValueError(
            f"The optimizer function given to TowerOptimizer returned "
            f"{optimizer!r}; it must return a tf.compat.v1.train.Optimizer.")
      self._built[graph] = optimizer
    return self._built[graph]

  def compute_gradients(self, loss, *args, **kwargs):
    """Gradients of the tower's loss, weighted by its share of the batch."""
    replication = _towers.current_replication()
    if replication is not None and replication.num_towers > 1:
      loss = _aggregate.scale_loss(
          loss, replication.loss_reduction, replication.fraction(),
          replication.size())
    return self.optimizer.compute_gradients(loss, *args, **kwargs)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Records the tower's gradients; the last tower applies their sum."""
    replication = _towers.current_replication()
    if replication is None or replication.num_towers == 1:
      return self.optimizer.apply_gradients(grads_and_vars, global_step, name)
    grads_and_vars = list(grads_and_vars)
    state = gather_state(replication.graph)
    tower = replication.tower.index
    call = state.record(tower, grads_and_vars)
    if not replication.is_last_tower:
      grads = [g for g, _ in grads_and_vars if g is not None]
      with tf.control_dependencies(tf.nest.flatten(grads, expand_composites=True)):
        return tf.no_op(name="gather_gradients")
    towers = [_call(state, i, call, grads_and_vars)
              for i in range(replication.num_towers)]
    with replication.tower_zero_scope():
      summed = _aggregate.sum_gradients(towers)
      return self.optimizer.apply_gradients(summed, global_step, name)

  def get_slot(self, *args, **kwargs):
    """Forwards to the wrapped optimizer."""
    return self.optimizer.get_slot(*args, **kwargs)

  def get_slot_names(self, *args, **kwargs):
    """Forwards to the wrapped optimizer."""
    return self.optimizer.get_slot_names(*args, **kwargs)

  def variables(self):
    """Forwards to the wrapped optimizer."""
    return self.optimizer.variables()


def _call(state: _GatherState, tower: int, call: int, last_grads_and_vars):
  """Tower `tower`'s `call`-th gradients, checked against the last tower's."""
  calls = state.calls[tower] if tower < len(state.calls) else []
  if call >= len(calls):
    raise ValueError(
        f"Tower {tower} made {len(calls)} TowerOptimizer.apply_gradients "
        f"calls but the last tower made at least {call + 1}; every tower must "
        "make the same optimizer calls in the same order.")
  grads_and_vars = calls[call]
  if _variable_names(grads_and_vars) != _variable_names(last_grads_and_vars):
    raise ValueError(
        f"Optimizer call {call} of tower {tower} updates variables "
        f"{_variable_names(grads_and_vars)} but the last tower's updates "
        f"{_variable_names(last_grads_and_vars)}; every tower must make the "
        "same optimizer calls on the same variables in the same order.")
  return grads_and_vars
