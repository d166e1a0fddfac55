"""Loss reductions as names, and the gating of towers without examples.

`validate_loss_reduction` checks `replicate_model_fn`'s `loss_reduction`;
`gate` and `real_sum` keep a tower computing on a phantom row (see
`_prepare.split`) out of a sum; `share_in` is a tower's share of the batch.
"""

from typing import Any, Iterable, Union

import tensorflow as tf

_Reduction = tf.compat.v1.losses.Reduction

# Keras' reduction names mapped to tf.compat.v1.losses.Reduction.
_KERAS_REDUCTIONS = {
    "sum": _Reduction.SUM,
    "sum_over_batch_size": _Reduction.SUM_OVER_BATCH_SIZE,
    "auto": _Reduction.SUM_OVER_BATCH_SIZE,
    "none": _Reduction.NONE,
}


def validate_loss_reduction(loss_reduction: Any) -> str:
  """Returns the reduction as a `tf.compat.v1.losses.Reduction` value.

  Raises:
    TypeError: `loss_reduction` is not a string or a Keras reduction.
    ValueError: it names no reduction.
  """
  value = getattr(loss_reduction, "value", loss_reduction)
  if not isinstance(value, str):
    raise TypeError(
        f"loss_reduction={loss_reduction!r} is of type "
        f"{type(loss_reduction).__name__}, not a loss reduction; pass one of "
        "tf.compat.v1.losses.Reduction (or leave the default).")
  value = _KERAS_REDUCTIONS.get(value, value)
  if value not in _Reduction.all():
    raise ValueError(
        f"loss_reduction={loss_reduction!r} is not a loss reduction; pass one "
        f"of tf.compat.v1.losses.Reduction: {', '.join(_Reduction.all())}.")
  return value


def gate(value: Any, valid: Union[bool, tf.Tensor]) -> Any:
  """`value` where `valid`, else zeros (not `value * 0`, which keeps NaN).

  `valid` is a python bool (True adds no op) or a scalar bool tensor. A
  value gated off still has a zero gradient, not None, so that every tower
  hands its optimizer calls the same gradients.
  """
  if valid is True:
    return value
  value = tf.convert_to_tensor(value)
  return tf.where(valid, value, tf.zeros_like(value))


def real_sum(values: Iterable[Any],
             valid: Iterable[Union[bool, tf.Tensor]]) -> tf.Tensor:
  """Sum of the towers' `values`, a tower computing on a phantom row as zero.

  `valid[i]` is tower i's flag (True, False or a bool tensor; see `gate`).
  """
  return tf.add_n(
      [gate(value, ok) for value, ok in zip(values, valid) if ok is not False])


def share_in(fraction: Union[float, tf.Tensor], dtype: tf.DType) -> tf.Tensor:
  """A tower's share of the batch as a `dtype` scalar, rounded once.

  A Python float (a double) becomes a `dtype` constant directly: `tf.cast`
  would first make it a float32 tensor, which leaves a float64 loss
  float32-accurate. A tensor share (float64, see `_prepare.split._fractions`) is
  cast.
  """
  if isinstance(fraction, (int, float)):
    return tf.constant(fraction, dtype)
  return tf.cast(fraction, dtype)
