"""Transforming the gradients right before the wrapped optimizer applies them.

A TowerOptimizer's `gradient_transform` runs once per step on the whole
batch's gradients, where tower 0 applies them, and on one device (or
outside `replicate_model_fn`) on that device's gradients, so both run the
same transform on the same values. Sparse gradients reach it with each row
once (duplicate indices summed), as a norm or a clip value needs them.
"""

from typing import Any, Callable, Iterable, List, Sequence, Tuple, Union

import tensorflow as tf

GradsAndVars = List[Tuple[Any, tf.Variable]]
GradientTransform = Callable[[GradsAndVars], GradsAndVars]
# What TowerOptimizer's `gradient_transform` takes: none, one, or a list.
GradientTransforms = Union[None, GradientTransform, Sequence[GradientTransform]]


def merge_duplicate_rows(grad: Any) -> Any:
  """An `IndexedSlices` with each row once, duplicates summed; others as given.

  The rows of an IndexedSlices stand for their sum; a norm, a clip value or
  an element-wise op of the rows is the dense gradient's only when no index
  repeats (the towers' slices, concatenated, repeat every row that more than
  one tower looked up).
  """
  if not isinstance(grad, tf.IndexedSlices):
    return grad
  indices, positions = tf.unique(grad.indices)
  values = tf.math.unsorted_segment_sum(grad.values, positions,
                                        tf.shape(indices)[0])
  return tf.IndexedSlices(values, indices, grad.dense_shape)


def clip_by_global_norm(clip_norm: float) -> GradientTransform:
  """A gradient transform scaling all gradients to a global norm <= clip_norm.

  See `TowerOptimizer.clip_by_global_norm`.
  """
  if not (isinstance(clip_norm,
                     (int, float)) or tf.is_tensor(clip_norm)) or (isinstance(
                         clip_norm, bool)):
    raise TypeError(
        f"clip_by_global_norm got clip_norm={clip_norm!r} of type "
        f"{type(clip_norm).__name__}; pass the largest global norm to apply, "
        "a positive number.")
  if isinstance(clip_norm, (int, float)) and not clip_norm > 0:
    raise ValueError(
        f"clip_by_global_norm got clip_norm={clip_norm!r}; pass the largest "
        "global norm to apply, a positive number.")

  def transform(grads_and_vars: GradsAndVars) -> GradsAndVars:
    grads = [g for g, _ in grads_and_vars]
    clipped, _ = tf.clip_by_global_norm(grads, clip_norm)
    return list(zip(clipped, [v for _, v in grads_and_vars]))

  return transform


class Pipeline:
  """A TowerOptimizer's gradient transforms (none, one or several in order)."""

  def __init__(self, gradient_transform: GradientTransforms) -> None:
    transforms: Tuple[GradientTransform, ...]
    if gradient_transform is None:
      transforms = ()
    elif callable(gradient_transform):
      transforms = (gradient_transform,)
    elif isinstance(gradient_transform, (list, tuple)) and all(
        callable(t) for t in gradient_transform):
      transforms = tuple(gradient_transform)
    else:
      raise TypeError(
          f"TowerOptimizer got gradient_transform={gradient_transform!r}; pass "
          "a function from a list of (gradient, variable) pairs to such a "
          "list, or a list of such functions.")
    self._transforms = transforms

  @property
  def active(self) -> bool:
    """Whether there is any transform to run."""
    return bool(self._transforms)

  def prepare(
      self, grads_and_vars: Iterable[Tuple[Any, tf.Variable]]
  ) -> Iterable[Tuple[Any, tf.Variable]]:
    """The gradients as the transforms get them, replicated or not.

    Without transforms they pass unchanged (the wrapper adds no ops); with
    them, variables without a gradient are left out and duplicate rows of
    sparse gradients summed.
    """
    if not self._transforms:
      return grads_and_vars
    return [
        (merge_duplicate_rows(g), v) for g, v in grads_and_vars if g is not None
    ]

  def __call__(
      self, grads_and_vars: Iterable[Tuple[Any, tf.Variable]]
  ) -> Iterable[Tuple[Any, tf.Variable]]:
    """Applies the transforms in order to the (summed) gradients."""
    for transform in self._transforms:
      result = transform(list(grads_and_vars))
      if result is None:
        raise ValueError(
            f"gradient_transform {transform!r} returned None; it must return "
            "the list of (gradient, variable) pairs to apply.")
      grads_and_vars = list(result)
    return grads_and_vars
