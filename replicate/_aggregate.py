"""Loss reductions, a tower's share of the loss, and gradient sums.

`scale_loss` weights one tower's averaging loss by its share of the batch
(what `_loss` does for a loss it cannot see the denominator of);
`sum_gradients` adds gradients the towers computed themselves (not through
`TowerOptimizer.compute_gradients`), as Reduction.SUM asks.
"""

from typing import Any, List, Sequence, Tuple

import tensorflow as tf

from replicate import _transform

_Reduction = tf.compat.v1.losses.Reduction

# Keras' reduction names mapped to tf.compat.v1.losses.Reduction.
_KERAS_REDUCTIONS = {
    "sum": _Reduction.SUM,
    "sum_over_batch_size": _Reduction.SUM_OVER_BATCH_SIZE,
    "auto": _Reduction.SUM_OVER_BATCH_SIZE,
}


def validate_loss_reduction(loss_reduction) -> str:
  """Returns the reduction as a `tf.compat.v1.losses.Reduction` value."""
  value = getattr(loss_reduction, "value", loss_reduction)
  value = _KERAS_REDUCTIONS.get(value, value)
  if value == _Reduction.NONE or value == "none":
    raise ValueError(
        "loss_reduction=Reduction.NONE is not supported: towers need a scalar "
        "loss to combine; pass Reduction.SUM, or an averaging reduction such "
        "as Reduction.SUM_BY_NONZERO_WEIGHTS (the default).")
  if value not in _Reduction.all():
    choices = ", ".join(r for r in _Reduction.all() if r != _Reduction.NONE)
    raise ValueError(
        f"loss_reduction={loss_reduction!r} is not a loss reduction; pass one "
        f"of tf.compat.v1.losses.Reduction: {choices}.")
  return value


def is_sum(loss_reduction: str) -> bool:
  """Whether the reduction adds (rather than averages) over the batch."""
  return loss_reduction == _Reduction.SUM


def gate(value, valid):
  """`value` where `valid`, else zeros (not `value * 0`, which keeps NaN).

  `valid` is a python bool (True adds no op) or a scalar bool tensor. A
  value gated off still has a zero gradient, not None, so that every tower
  hands its optimizer calls the same gradients.
  """
  if valid is True:
    return value
  value = tf.convert_to_tensor(value)
  return tf.where(valid, value, tf.zeros_like(value))


def real_sum(values, valid):
  """Sum of the towers' `values`, a tower computing on a phantom row as zero.

  `valid[i]` is tower i's flag (True, False or a bool tensor; see `gate`).
  """
  return tf.add_n([gate(value, ok) for value, ok in zip(values, valid)
                   if ok is not False])


def scale_loss(loss, loss_reduction: str, fraction, size):
  """Weights one tower's loss by its share of the batch.

  A tower without examples (`fraction` 0: none, or a phantom row, see
  _split) contributes zero, whatever the reduction, even where its own loss
  is NaN (a mean over nothing), and still has zero rather than no
  gradients. When the whole batch is empty, tower 0 holds all of it
  (`fraction` 1): its loss, NaN included, is then one device's, and so are
  its gradients.
  """
  holds_examples = fraction > 0
  if is_sum(loss_reduction):
    return gate(loss, holds_examples)
  loss = tf.convert_to_tensor(loss)
  weighted = loss * share_in(fraction, loss.dtype)
  if isinstance(size, int) and size > 0:
    return weighted
  return gate(weighted, holds_examples)


def share_in(fraction, dtype: tf.DType) -> tf.Tensor:
  """A tower's share of the batch as a `dtype` scalar, rounded once.

  A Python float (a double) becomes a `dtype` constant directly: `tf.cast`
  would first make it a float32 tensor, which leaves a float64 loss
  float32-accurate. A tensor share (float64, see `_split._fractions`) is
  cast.
  """
  if isinstance(fraction, (int, float)):
    return tf.constant(fraction, dtype)
  return tf.cast(fraction, dtype)


def _sum_device(grads: Sequence[Any], variable) -> str:
  """The variable's device, or the towers' host where that is another task.

  A variable on a parameter server (another job or task than the towers,
  e.g. under Estimator's replica_device_setter in a TF_CONFIG cluster) gets
  one summed gradient over the network instead of one per tower.
  """
  variable_spec = tf.DeviceSpec.from_string(variable.device)
  tower_spec = tf.DeviceSpec.from_string(grads[0].device)
  task = lambda spec: (spec.job, spec.replica, spec.task)
  if task(variable_spec) == task(tower_spec):
    return variable.device
  return tower_spec.replace(device_type="CPU", device_index=0).to_string()


def _sum_one(grads: Sequence[Any], variable):
  """Sums one variable's gradients; IndexedSlices stay sparse.

  The towers' IndexedSlices are concatenated and their duplicate rows summed,
  so that a norm or clip of the rows (Keras' `clipnorm`, a gradient
  transform) sees the same rows as one device.
  """
  if len(grads) == 1 and not isinstance(grads[0], tf.IndexedSlices):
    return grads[0]
  with tf.device(_sum_device(grads, variable)):
    if all(isinstance(g, tf.IndexedSlices) for g in grads):
      return _transform.merge_duplicate_rows(tf.IndexedSlices(
          values=tf.concat([g.values for g in grads], axis=0),
          indices=tf.concat([g.indices for g in grads], axis=0),
          dense_shape=grads[0].dense_shape))
    return tf.add_n([tf.convert_to_tensor(g) for g in grads])


def sum_gradients(
    tower_grads_and_vars: Sequence[Sequence[Tuple[Any, tf.Variable]]]
) -> List[Tuple[Any, tf.Variable]]:
  """Sums, per variable, the gradients every tower computed.

  `tower_grads_and_vars[i]` is what tower i passed to `apply_gradients`;
  the towers must list the same variables in the same order. Variables
  that no tower has a gradient for are left out.
  """
  summed = []
  with tf.name_scope("gradient_sum"):
    for pairs in zip(*tower_grads_and_vars):
      variable = pairs[0][1]
      grads = [g for g, _ in pairs if g is not None]
      if grads:
        summed.append((_sum_one(grads, variable), variable))
  return summed
