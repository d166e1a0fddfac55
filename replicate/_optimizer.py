"""TowerOptimizer: gathers every tower's gradients and applies their sum once.

In towers 0..N-2 `apply_gradients` records the gradients and returns an op
that depends on them; in the last tower it sums each variable's gradients
over the towers and applies the sums with the wrapped optimizer, in the
scopes tower 0 made the same call in, so that slot variables are named as
without replication. Both `tf.compat.v1.train.Optimizer`s and Keras legacy
optimizers (which the v2 canned estimators require) are wrapped.
"""

import weakref
from typing import Any, Callable, List, NamedTuple, Union

import tensorflow as tf

from replicate import _aggregate
from replicate import _towers

_Optimizer = tf.compat.v1.train.Optimizer
_KerasOptimizer = tf.keras.optimizers.legacy.Optimizer


class _Call(NamedTuple):
  grads_and_vars: List[Any]
  scopes: _towers.Scopes


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


def _replicated():
  """The current replication if it has several towers, else None."""
  replication = _towers.current_replication()
  if replication is None or replication.num_towers == 1:
    return None
  return replication


def _scaled(loss):
  replication = _replicated()
  if replication is None:
    return loss
  return _aggregate.scale_loss(loss, replication.loss_reduction,
                               replication.fraction(), replication.size())


def _gather_and_apply(grads_and_vars, apply: Callable[[List[Any]], Any]):
  """Records this tower's gradients; in the last tower applies their sums."""
  replication = _replicated()
  grads_and_vars = list(grads_and_vars)
  state = _gather_state(replication.graph)
  index = state.record(replication.tower.index,
                       _Call(grads_and_vars, _towers.Scopes.current()))
  if not replication.is_last_tower:
    grads = [g for g, _ in grads_and_vars if g is not None]
    with tf.control_dependencies(tf.nest.flatten(grads, expand_composites=True)):
      return tf.no_op(name="gather_gradients")
  calls = [_tower_call(state, tower, index, grads_and_vars)
           for tower in range(replication.num_towers)]
  with replication.scopes(calls[0].scopes):
    summed = _aggregate.sum_gradients([c.grads_and_vars for c in calls])
    return apply(summed)


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


class _PerGraph:
  """An optimizer given directly, or built once per graph by a function."""

  def __init__(self, optimizer_or_fn, expected_types, what: str):
    if isinstance(optimizer_or_fn, expected_types):
      self._fixed, self._fn = optimizer_or_fn, None
    elif callable(optimizer_or_fn):
      self._fixed, self._fn = None, optimizer_or_fn
    else:
      raise ValueError(
          f"TowerOptimizer got {optimizer_or_fn!r}; pass {what} or a function "
          "of no arguments that returns one.")
    self._types, self._what = expected_types, what
    self._built = weakref.WeakKeyDictionary()

  @property
  def is_lazy(self) -> bool:
    return self._fixed is None

  def get(self):
    if self._fixed is not None:
      return self._fixed
    graph = tf.compat.v1.get_default_graph()
    if graph not in self._built:
      optimizer = self._fn()
      if not isinstance(optimizer, self._types):
        raise ValueError(
            f"The optimizer function given to TowerOptimizer returned "
            f"{optimizer!r}; it must return {self._what}.")
      self._built[graph] = optimizer
    return self._built[graph]


class TowerOptimizer(_Optimizer):
  """Wraps an optimizer so that replicated towers apply one summed update.

  Use it wherever the model_fn builds its optimizer:

      opt = replicate.TowerOptimizer(tf.compat.v1.train.AdamOptimizer(1e-3))
      train_op = opt.minimize(loss, tf.compat.v1.train.get_global_step())

  Inside `replicate_model_fn` with several towers, `compute_gradients`
  weights the tower's loss by its share of the batch (for averaging loss
  reductions) and the last tower's `apply_gradients` applies the gradients
  summed over all towers. Outside, or with one tower, it passes every call
  straight to the wrapped optimizer. Gradients computed without
  `compute_gradients` (e.g. `tf.gradients`) are not weighted: pass them
  only with Reduction.SUM.

  A Keras legacy optimizer (`tf.keras.optimizers.legacy.*`, what the v2
  canned estimators take) gives a Keras optimizer that does the same through
  `get_updates` / `get_gradients` / `apply_gradients`.

  Args:
    optimizer_or_optimizer_fn: a `tf.compat.v1.train.Optimizer` or a
      `tf.keras.optimizers.legacy.Optimizer`, or a function of no arguments
      returning one; the function is called once per graph, when the
      optimizer is first needed.

  Raises:
    ValueError: the argument is neither an optimizer nor callable.
  """

  def __new__(cls, optimizer_or_optimizer_fn=None, *args, **kwargs):
    del args, kwargs
    if cls is TowerOptimizer and isinstance(optimizer_or_optimizer_fn,
                                            _KerasOptimizer):
      return _KerasTowerOptimizer(optimizer_or_optimizer_fn)
    return super().__new__(cls)

  def __init__(self, optimizer_or_optimizer_fn: Union[
      _Optimizer, _KerasOptimizer, Callable[[], Any]]):
    self._wrapped = _PerGraph(
        optimizer_or_optimizer_fn, (_Optimizer, _KerasOptimizer),
        "a tf.compat.v1.train.Optimizer or tf.keras.optimizers.legacy."
        "Optimizer")
    name = ("TowerOptimizer" if self._wrapped.is_lazy
            else optimizer_or_optimizer_fn.get_name())
    super().__init__(use_locking=False, name=name)

  def __call__(self):
    """Builds the optimizer now, as canned estimators do with callables.

    Returns this TowerOptimizer for a v1 optimizer, or a Keras TowerOptimizer
    wrapping what the function returned for a Keras one.
    """
    optimizer = self._wrapped.get()
    if isinstance(optimizer, _KerasOptimizer):
      return _KerasTowerOptimizer(optimizer)
    return self

  @property
  def optimizer(self) -> _Optimizer:
    """The wrapped optimizer (for a function, the one built for this graph)."""
    optimizer = self._wrapped.get()
    if isinstance(optimizer, _KerasOptimizer):
      raise ValueError(
          f"TowerOptimizer's function returned Keras optimizer {optimizer!r} "
          "where a tf.compat.v1.train.Optimizer is used; pass the Keras "
          "optimizer itself, or call the TowerOptimizer to get its Keras "
          "wrapper.")
    return optimizer

  def compute_gradients(self, loss, *args, **kwargs):
    """Gradients of the tower's loss, weighted by its share of the batch."""
    return self.optimizer.compute_gradients(_scaled(loss), *args, **kwargs)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Records the tower's gradients; the last tower applies their sum."""
    optimizer = self.optimizer
    if _replicated() is None:
      return optimizer.apply_gradients(grads_and_vars, global_step, name)
    return _gather_and_apply(
        grads_and_vars,
        lambda summed: optimizer.apply_gradients(summed, global_step, name))

  def get_slot(self, *args, **kwargs):
    """Forwards to the wrapped optimizer."""
    return self.optimizer.get_slot(*args, **kwargs)

  def get_slot_names(self, *args, **kwargs):
    """Forwards to the wrapped optimizer."""
    return self.optimizer.get_slot_names(*args, **kwargs)

  def variables(self):
    """Forwards to the wrapped optimizer."""
    return self.optimizer.variables()


class _KerasTowerOptimizer(_KerasOptimizer):
  """TowerOptimizer for a Keras legacy optimizer (see TowerOptimizer).

  The v2 canned heads call `get_updates(loss, variables)` and set
  `iterations` to the global step in every tower; the wrapped optimizer's
  iterations advance once per step, in the last tower's apply.
  """

  def __init__(self, optimizer: _KerasOptimizer):
    super().__init__(name=optimizer._name)  # pylint: disable=protected-access
    self._wrapped_keras = optimizer

  @property
  def optimizer(self) -> _KerasOptimizer:
    """The wrapped Keras optimizer."""
    return self._wrapped_keras

  @property
  def iterations(self):
    """The wrapped optimizer's iteration counter."""
    return self._wrapped_keras.iterations

  @iterations.setter
  def iterations(self, variable):
    # Every tower of a canned model_fn sets the same global step.
    if self._wrapped_keras._iterations is not variable:  # pylint: disable=protected-access
      self._wrapped_keras.iterations = variable

  def get_gradients(self, loss, params):
    """Gradients of the tower's loss, weighted by its share of the batch."""
    return self._wrapped_keras.get_gradients(_scaled(loss), params)

  def get_updates(self, loss, params):
    """The update op: this tower's gradients, summed and applied once."""
    grads = self.get_gradients(loss, params)
    return [self.apply_gradients(zip(grads, params))]

  def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
    """Keras' minimize on the scaled loss, then the gathered apply."""
    grads_and_vars = self._wrapped_keras._compute_gradients(  # pylint: disable=protected-access
        _scaled(loss), var_list=var_list, grad_loss=grad_loss, tape=tape)
    return self.apply_gradients(grads_and_vars, name=name)

  def apply_gradients(self, grads_and_vars, name=None, **kwargs):
    """Records the tower's gradients; the last tower applies their sum."""
    optimizer = self._wrapped_keras
    if _replicated() is None:
      return optimizer.apply_gradients(grads_and_vars, name=name, **kwargs)
    return _gather_and_apply(
        grads_and_vars,
        lambda summed: optimizer.apply_gradients(summed, name=name, **kwargs))

  def get_slot(self, var, slot_name):
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.get_slot(var, slot_name)

  def get_slot_names(self):
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.get_slot_names()

  def variables(self):
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.variables()

  @property
  def weights(self):
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.weights

  def get_config(self):
    """Forwards to the wrapped optimizer."""
    return self._wrapped_keras.get_config()
