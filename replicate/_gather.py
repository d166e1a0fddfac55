"""TowerOptimizer calls across towers: one device's gradients, one update.

`compute_gradients` (and Keras' `get_gradients` / `minimize`) is a meeting
point of the towers (see `_lockstep`): once every tower has built its loss,
the towers' losses are combined into the whole batch's loss (`_loss`) and
differentiated once, each gradient op on its forward op's device, and every
tower gets that one device's gradient. Code between `compute_gradients` and
`apply_gradients` (clipping, multipliers, summaries) then computes what it
would on one device. `apply_gradients` is a meeting point too: tower 0's
gradients are applied once, where tower 0 made the call, and every tower
gets that update op as its own.
"""

from typing import Any, Callable, Sequence

import tensorflow as tf

from replicate import _aggregate
from replicate import _context
from replicate import _inputs
from replicate import _lockstep
from replicate import _loss
from replicate import _transform

_COMPUTE = "TowerOptimizer.compute_gradients"
_APPLY = "TowerOptimizer.apply_gradients"


def replicated():
  """The current replication if it has several towers, else None."""
  replication = _context.current_replication()
  if replication is None or replication.num_towers == 1:
    return None
  return replication


def whole_batch_gradients(loss, compute: Callable[[Any, bool], Any],
                          variables=None):
  """`compute(loss)` on one device; in a tower, on the whole batch's loss.

  Args:
    loss: the tower's loss, as the model_fn passed it.
    compute: `compute(loss, replicated)` returns gradients (as the
      optimizer returns them); in towers, tower 0's runs once, on the
      combined loss of every tower, with `replicated` True (colocate the
      gradient ops with their forward ops).
    variables: the variables the call differentiates for, if it names
      them: every tower must name the same.

  Returns:
    What `compute` returned, the same for every tower.

  Raises:
    ValueError: the towers name different variables.
  """
  replication = replicated()
  if replication is None:
    return compute(loss, False)

  def combine(calls):
    check_same_variables("TowerOptimizer call", [n for _, n in calls])
    combined = _loss.combine(replication, [l for l, _ in calls])
    result = compute(combined, True)
    replication.whole_batch_gradients.update(
        t.ref() for t in tf.nest.flatten(result, expand_composites=True)
        if isinstance(t, tf.Tensor))
    return [result] * len(calls)

  names = None if variables is None else [
      v.op.name for v in tf.nest.flatten(variables)]
  return _lockstep.meet(_COMPUTE, (loss, names), combine)


def require_gradients(grads, variables):
  """Keras' own error for a variable without a gradient, as on one device."""
  for grad, variable in zip(grads, variables):
    if grad is None:
      raise ValueError(
          f"Variable {variable} has `None` for gradient. Please make sure "
          "that all of your ops have a gradient defined (i.e. are "
          "differentiable).")


def one_device_slices(grads_and_vars):
  """Sparse gradients with the rows one device's would have.

  A lookup that takes unique ids (`embedding_lookup_sparse`, feature
  columns) gives one device one row per id of the whole batch; each tower
  looks up its shard's ids, so the whole batch's gradient has a row per
  tower for ids several shards share. Those are summed into one, in order
  of first appearance, as one device's `unique` orders them. Lookups of
  ids as given keep every row, as on one device.
  """
  return [(_transform.merge_duplicate_rows(grad)
           if isinstance(grad, tf.IndexedSlices) and _looks_up_unique_ids(
               variable) else grad, variable)
          for grad, variable in grads_and_vars]


def _looks_up_unique_ids(variable) -> bool:
  handle = getattr(variable, "handle", None)
  handle = handle if isinstance(handle, tf.Tensor) else variable.op.outputs[0]
  gathers = [op for op in _readers(handle)
             if op.type in ("ResourceGather", "Gather", "GatherV2")]
  return bool(gathers) and all(
      _source_type(op.inputs[1]) == "Unique" for op in gathers)


def _readers(tensor):
  """The ops reading `tensor`, through Identity ops (a ref variable's read)."""
  readers, pending = [], list(tensor.consumers())
  while pending:
    op = pending.pop()
    if op.type == "Identity":
      pending.extend(op.outputs[0].consumers())
    else:
      readers.append(op)
  return readers


def _source_type(tensor) -> str:
  while tensor.op.type in ("Identity", "Cast") and tensor.op.inputs:
    tensor = tensor.op.inputs[0]
  return tensor.op.type


def transform_and_apply(grads_and_vars, transforms: "_transform.Pipeline",
                        apply_fn: Callable[[Any], Any]):
  """A TowerOptimizer's apply_gradients: the transforms, then `apply_fn`.

  Outside replication (or on one device) the transforms run on this
  device's gradients. In a tower, the towers meet: tower 0 applies the
  whole batch's gradients once, in its own scopes, and every tower returns
  that update.
  """
  replication = replicated()
  if replication is None:
    return apply_fn(transforms(transforms.prepare(grads_and_vars)))
  grads_and_vars = list(grads_and_vars)
  state = {}

  def combine(towers_grads_and_vars):
    check_same_variables("TowerOptimizer.apply_gradients",
                          [_variable_names(p) for p in towers_grads_and_vars])
    pairs = _whole_batch_pairs(replication, towers_grads_and_vars)
    state["pairs"] = pairs
    return [state] * len(towers_grads_and_vars)

  shared = _lockstep.meet(_APPLY, grads_and_vars, combine)
  if replication.tower.index == 0:
    with replication.scopes(_context.Scopes.current()):
      shared["applied"] = apply_fn(
          transforms(transforms.prepare(shared["pairs"])))
    replication.apply_calls += 1
  return shared["applied"]


def _variable_names(grads_and_vars):
  return [v.op.name for _, v in grads_and_vars]


def check_same_variables(call: str, names_per_tower: Sequence[Any]):
  """Every tower's call must name the variables tower 0's names."""
  first = names_per_tower[0]
  for tower, names in enumerate(names_per_tower[1:], start=1):
    if names != first:
      raise ValueError(
          f"{call} of tower {tower} updates variables {names} but tower 0's "
          f"updates {first}; every tower must make the same optimizer calls "
          "on the same variables in the same order.")


def _whole_batch_pairs(replication, towers_grads_and_vars):
  """Per variable, the gradient one device would apply.

  A gradient of the whole batch's loss (`compute_gradients`, or the
  model_fn's own `tf.gradients` of a scalar, see `_own_gradients`), or one
  the model_fn computed from it (clipped, scaled), is the same in every
  tower: tower 0's is applied. So is one that reads no batch input (e.g.
  computed from the variables alone). Any other is its tower's share of a
  gradient taken per tower (e.g. `tf.gradients` with `grad_ys`, or of
  per-example losses): under Reduction.SUM the shares add up to one
  device's gradient and are summed; under an averaging reduction they do
  not, which is an error naming the fix.
  """
  derived = _derived_from(replication.whole_batch_gradients,
                          [g for g, _ in towers_grads_and_vars[0]])
  pairs = []
  for index, (grad, variable) in enumerate(towers_grads_and_vars[0]):
    if grad is None or _is_derived(grad, derived) or (
        replication.inputs and not _inputs.reads_batch(
            _components(grad), replication.inputs)):
      pairs.append((grad, variable))
      continue
    if not _aggregate.is_sum(replication.loss_reduction):
      raise ValueError(
          f"The gradient for {variable.op.name} handed to apply_gradients "
          "was taken in each tower, not of the whole batch's loss (e.g. "
          "tf.gradients or GradientTape.gradient with grad_ys / "
          "output_gradients, of a non-scalar target, or inside a "
          f"tf.function); under loss_reduction={replication.loss_reduction!r} "
          "the towers' gradients do not add up to one device's. Take it with "
          "the optimizer's compute_gradients (or tf.gradients / "
          "tape.gradient of the scalar loss, nothing else given), or use "
          "Reduction.SUM with a loss that sums over the batch.")
    grads = [tower[index][0] for tower in towers_grads_and_vars]
    pairs.extend(_aggregate.sum_gradients([[(g, variable)] for g in grads]))
  return pairs


def _components(grad):
  return [grad.values, grad.indices] if isinstance(
      grad, tf.IndexedSlices) else [grad]


def _op(grad) -> tf.Operation:
  return (grad.values if isinstance(grad, tf.IndexedSlices) else grad).op


def _is_derived(grad, derived) -> bool:
  return _op(grad) in derived


def _derived_from(sources, targets) -> set:
  """The ops between `sources` (tensor refs) and `targets`, sources included."""
  target_ops = {_op(g) for g in targets if g is not None}
  derived = set()
  pending = [ref.deref().op for ref in sources]
  while pending:
    op = pending.pop()
    if op in derived:
      continue
    derived.add(op)
    if op in target_ops:
      continue
    pending.extend(c for out in op.outputs for c in out.consumers())
  return derived
