"""The towers' values brought together: partials combined, rows concatenated.

A batch reduction's partials (one per tower) combine into the whole batch's
value (`combine`); the towers' rows concatenate, in order, into the whole
batch's and split back into each tower's (`concatenated`); merged outputs
keep only the rows computed on real examples (`real_rows`). A tower left
without an example (a batch smaller than the number of towers) computes on
a phantom row, which adds nothing here: left out when the graph is built,
or gated when it runs (the batch size is dynamic).
"""

from typing import Any, Callable, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from replicate import _context
from replicate._batch import sums as _sums


def combine(how: str,
            values: Sequence[tf.Tensor],
            validity: Sequence[Any],
            trainers: Any = None) -> tf.Tensor:
  """The towers' partial `values` combined, towers on phantom rows left out;
  with `trainers` (`_meet.trainers.Trainers`), every trainer's too."""
  kept = [(v, ok) for v, ok in zip(values, validity) if ok is not False]
  if how in ("sum", "norm"):
    gated = [
        _sums.gate(tf.square(v) if how == "norm" else v, ok) for v, ok in kept
    ]
    total = gated[0] if len(gated) == 1 else tf.add_n(gated)
    if trainers is not None:
      total = trainers.combine("sum", total)
    return tf.sqrt(total) if how == "norm" else total
  neutral: Callable[[tf.DType], Any] = {
      "max": _lowest,
      "min": _highest,
      "prod": lambda d: 1,
      "all": lambda d: True,
      "any": lambda d: False
  }[how]
  combined = None
  for value, ok in kept:
    if ok is not True:
      value = tf.where(
          ok, value,
          tf.fill(
              tf.shape(value), tf.constant(neutral(value.dtype), value.dtype)))
    if combined is None:
      combined = value
    elif how == "max":
      combined = tf.maximum(combined, value)
    elif how == "min":
      combined = tf.minimum(combined, value)
    elif how == "prod":
      combined = combined * value
    elif how == "all":
      combined = tf.logical_and(combined, value)
    else:
      combined = tf.logical_or(combined, value)
  if trainers is not None:
    combined = trainers.combine(how, combined)
  return combined


def _lowest(dtype: tf.DType) -> Any:
  return -np.inf if dtype.is_floating else dtype.min


def _highest(dtype: tf.DType) -> Any:
  return np.inf if dtype.is_floating else dtype.max


# `place(output, out_axis)`: each tower's rows of a whole batch's output.
Place = Callable[[tf.Tensor, int], List[tf.Tensor]]


def concatenated(replication: _context.Replication,
                 parts: Sequence[tf.Tensor],
                 axis: int = 0) -> Tuple[tf.Tensor, Place]:
  """The towers' rows along `axis`, in order, and how to hand rows back.

  Returns (the whole batch's tensor, place): `place(output, out_axis)` ->
  each tower's rows of an output with the same rows along `out_axis`. A
  tower on a phantom row adds none; it gets the output's last row back
  (its phantom row's original), so its shapes stay as built.
  """
  validity = replication.validity
  counts = []
  kept = []
  for part, valid in zip(parts, validity):
    size = tf.compat.dimension_value(
        part.shape[axis]) if (part.shape.rank is not None) else None
    size = tf.shape(part)[axis] if size is None else size
    if valid is False:
      counts.append(0)
      continue
    if valid is not True:
      size = tf.where(valid, size, 0)
      extent = tf.tensor_scatter_nd_update(tf.shape(part), [[axis]], [size])
      part = tf.slice(part, tf.zeros_like(extent), extent)
    counts.append(size)
    kept.append(part)
  whole = kept[0] if len(kept) == 1 else tf.concat(kept, axis)

  def place(output: tf.Tensor, out_axis: int) -> List[tf.Tensor]:
    sizes = [c for c, ok in zip(counts, validity) if ok is not False]
    pieces = iter([output] if len(sizes) == 1 else tf.split(
        output,
        tf.stack([tf.cast(c, tf.int64) for c in sizes]) if any(
            isinstance(c, tf.Tensor) for c in sizes) else sizes, out_axis))
    rows = []
    for ok in validity:
      if ok is True:
        rows.append(next(pieces))
        continue
      last = tf.gather(
          output, [tf.shape(output, out_type=tf.int64)[out_axis] - 1],
          axis=out_axis)
      if ok is False:
        rows.append(last)
      else:
        # A phantom row known when the graph runs: its original's row.
        piece = next(pieces)
        rows.append(tf.cond(ok, lambda p=piece: p, lambda r=last: r))
    return rows

  return whole, place


def real_rows(tensors: Sequence[tf.Tensor],
              replication: _context.Replication,
              examples: bool = False) -> List[tf.Tensor]:
  """The towers' rows (axis 0) without those computed on phantom rows.

  A tower known to hold a phantom row is left out; one that may (the batch
  size is dynamic) keeps all its rows or none; with `examples` (a row per
  example: predictions), its first `size` rows.
  """
  kept = []
  for index, (tensor, valid) in enumerate(zip(tensors, replication.validity)):
    if valid is True:
      kept.append(tensor)
    elif valid is not False and examples:
      size = tf.cast(replication.size(index), tf.int64)
      if isinstance(tensor, tf.SparseTensor):
        kept.append(
            tf.sparse.slice(tensor, tf.zeros_like(tensor.dense_shape),
                            tf.concat([[size], tensor.dense_shape[1:]], 0)))
      else:
        kept.append(tensor[:size])
    elif valid is not False:
      if isinstance(tensor, tf.SparseTensor):
        kept.append(
            tf.sparse.slice(
                tensor, tf.zeros_like(tensor.dense_shape),
                tf.concat([[tf.where(valid, tensor.dense_shape[0], 0)],
                           tensor.dense_shape[1:]], 0)))
      else:
        kept.append(tensor[:tf.where(valid, tf.shape(tensor)[0], 0)])
  return kept
