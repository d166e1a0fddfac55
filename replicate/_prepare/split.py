"""Splitting a batch of features and labels into one shard per tower.

Shards are taken along dimension 0, in order, with sizes that differ by at
most one, so concatenating the towers' outputs gives the input order back.
Tensors, SparseTensors and RaggedTensors (both split by rows) and any nest
of them are supported. Where static shapes cannot show that every leaf has
the same batch size, runtime checks on the consolidation device say which
leaves differ, before anything is split.

A non-empty batch smaller than the number of towers leaves towers without
examples. Many model_fns cannot take zero rows (TensorFlow's linear feature
columns fail to reshape an empty SparseTensor), though one device never
sees zero rows unless the batch is empty; so such a tower is handed one
phantom row instead, a copy of the batch's last row, and marked not
`valid`: whatever it computes is left out of the losses, predictions,
metrics and model-state writes (see `_batch.sums.gate`).

Python lists that are values (`{'age': [[10.], [20.]]}`) are converted to
tensors first, as feature columns and heads convert them on one device
(see `_prepare.leaves`). A SparseTensor's shard is as wide as the batch.
"""

import itertools
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from replicate._prepare import leaves as _leaves

Size = Union[int, tf.Tensor]


class Shards(NamedTuple):
  """The per-tower inputs and the share of the batch each tower holds."""
  features: List[Any]
  labels: List[Any]
  sizes: List[Size]  # examples per tower (ints when the batch is static)
  fractions: List[Any]  # size / batch size: floats, or float64 tensors
  valid: List[Any]  # False for a phantom row's tower: bools or tensors


def _paths(structure: Any, prefix: str) -> List[str]:
  """Names of the leaves of `structure`, in `tf.nest.flatten` order."""
  if isinstance(structure, dict):
    return [
        p for key in sorted(structure)
        for p in _paths(structure[key], f"{prefix}[{key!r}]")
    ]
  if isinstance(structure, (list, tuple)):
    return [
        p for i, item in enumerate(structure)
        for p in _paths(item, f"{prefix}[{i}]")
    ]
  return [prefix]


def _as_tensor(path: str, value: Any) -> Any:
  if value is None or isinstance(value,
                                 (tf.Tensor, tf.SparseTensor, tf.RaggedTensor)):
    return value
  if isinstance(value, tf.compat.v1.SparseTensorValue):
    return tf.SparseTensor.from_value(value)
  if isinstance(value, tf.compat.v1.ragged.RaggedTensorValue):
    return tf.RaggedTensor.from_nested_row_splits(value.flat_values,
                                                  value.nested_row_splits)
  try:
    return tf.convert_to_tensor(value)
  except (TypeError, ValueError) as e:
    raise TypeError(
        f"`{path}` of type {type(value).__name__} cannot be split across "
        f"towers ({e}); pass Tensors, SparseTensors, RaggedTensors or nests "
        "of them.") from None


def _scalar_message(path: str, value: Any = None) -> str:
  shown = "" if value is None else f" (its value: {value})"
  return (f"`{path}` is a scalar and has no batch dimension to split across "
          f"towers{shown}; give every feature and label a leading batch "
          "dimension (one row per example).")


def _static_batch_size(path: str, tensor: Any) -> Optional[int]:
  shape = tensor.shape
  if isinstance(tensor, tf.SparseTensor):
    known = tf.get_static_value(tensor.dense_shape)
    if known is not None:
      shape = tf.TensorShape(known)
  if shape.rank == 0:
    raise ValueError(_scalar_message(path, tf.get_static_value(tensor)))
  if shape.rank is None:
    return None
  return tf.compat.dimension_value(shape[0])


def _rank_check(path: str, leaf: Any) -> tf.Operation:
  """A runtime check that a leaf of unknown rank is not a scalar."""
  rank = (
      tf.size(leaf.dense_shape)
      if isinstance(leaf, tf.SparseTensor) else tf.rank(leaf))
  return tf.debugging.Assert(
      rank > 0, [_scalar_message(path)], name="check_rank")


def _dynamic_batch_size(path: str, leaf: Any) -> tf.Tensor:
  """The size of dimension 0 as an int64 scalar, once a leaf's rank is known."""
  checks = [_rank_check(path, leaf)] if leaf.shape.rank is None else []
  with tf.control_dependencies(checks):
    if isinstance(leaf, tf.SparseTensor):
      return tf.identity(leaf.dense_shape[0])
    if isinstance(leaf, tf.RaggedTensor):
      return leaf.nrows(out_type=tf.int64)
    return tf.shape(leaf, out_type=tf.int64)[0]


def _size_check(path: str, size: tf.Tensor, reference_path: str,
                reference: Size) -> tf.Operation:
  """A runtime check that leaf `path` has the batch size of another leaf."""
  return tf.debugging.Assert(
      tf.equal(size, reference), [
          f"Batch size of `{path}`:", size,
          f"differs from that of `{reference_path}`:", reference,
          "; every feature and label must have the same size in dimension 0 to "
          "be split across towers: batch them together in the input_fn, e.g. "
          "with one Dataset.batch over (features, labels)."
      ],
      name="check_batch")


def _batch_size(
    named_leaves: Sequence[Tuple[str, Any]]) -> Tuple[Size, List[tf.Operation]]:
  """The batch size shared by all leaves, and the checks that they share it.

  Returns:
    The size (an int if any leaf knows it statically, else an int64 scalar)
    and the runtime checks (none when static shapes show that every leaf
    has that size) that must run before the leaves are split.
  """
  static = {path: _static_batch_size(path, leaf) for path, leaf in named_leaves}
  known = {path: size for path, size in static.items() if size is not None}
  if len(set(known.values())) > 1:
    listed = ", ".join(f"`{p}`: {s}" for p, s in known.items())
    raise ValueError(
        f"Features and labels have different batch sizes ({listed}); every "
        "tensor must have the same size in dimension 0 to be split across "
        "towers.")
  unknown = [(path, leaf) for path, leaf in named_leaves if static[path] is None
            ]
  if known:
    reference_path, reference = next(iter(known.items()))
  else:
    reference_path, leaf = unknown.pop(0)
    reference = _dynamic_batch_size(reference_path, leaf)
  checks = [
      _size_check(path, _dynamic_batch_size(path, leaf), reference_path,
                  reference) for path, leaf in unknown
  ]
  return reference, checks


def shard_sizes(batch_size: Size, num_shards: int) -> List[Size]:
  """Sizes of `num_shards` in-order shards that differ by at most one.

  The larger shards come first, so tower 0 (whose update ops change the
  model's state) has an example whenever the batch has one.
  """
  if isinstance(batch_size, int):
    base, extra = divmod(batch_size, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]
  batch_size = tf.cast(batch_size, tf.int64)
  base = batch_size // num_shards
  extra = batch_size % num_shards
  return [base + tf.cast(i < extra, tf.int64) for i in range(num_shards)]


class _Window(NamedTuple):
  """The rows a tower reads: `size` rows from row `start`."""
  start: Size
  size: Size


def _windows(sizes: List[Size], batch_size: Size) -> List[_Window]:
  """The rows each tower reads: its shard, or one phantom row.

  A tower whose shard is empty while the batch is not (only possible when
  the batch is smaller than the number of towers) reads the batch's last
  row instead; with an empty batch every tower reads its empty shard.
  Python ints where the sizes are, so static shapes stay static.
  """
  starts = [0] + list(itertools.accumulate(sizes[:-1]))
  if isinstance(batch_size, int):
    return [
        _Window(min(start, batch_size -
                    1), 1) if batch_size and not size else _Window(start, size)
        for start, size in zip(starts, sizes)
    ]
  batch_size = tf.cast(batch_size, tf.int64)
  last = tf.maximum(batch_size - 1, 0)
  at_least = tf.minimum(batch_size, 1)  # one row, unless there is none
  return [_Window(0, sizes[0])] + [
      _Window(tf.minimum(start, last), tf.maximum(size, at_least))
      for start, size in zip(starts[1:], sizes[1:])
  ]


def _tiled(sizes: List[Size], batch_size: Size) -> bool:
  """Whether the shards are known to tile the batch, phantom rows none."""
  return isinstance(batch_size, int) and not 0 < batch_size < len(sizes)


def _valid(sizes: List[Size]) -> List[Any]:
  """Per tower: whether it holds real examples (python bool where known).

  Tower 0 always does: it holds the whole batch when the batch is empty.
  """
  return [True] + [
      size > 0 if isinstance(size, int) else tf.greater(
          size, 0, name=f"valid_{index}")
      for index, size in enumerate(sizes[1:], start=1)
  ]


def _split_dense(tensor: tf.Tensor, sizes: List[Size], windows: List[_Window],
                 tiled: bool) -> List[tf.Tensor]:
  """tf.split where the shards tile the batch statically, else slices."""
  if tiled:
    return tf.split(tensor, sizes, axis=0)
  return [tensor[w.start:w.start + w.size] for w in windows]


def _split_sparse(sparse: tf.SparseTensor,
                  windows: List[_Window]) -> List[tf.SparseTensor]:
  """Row slices of a SparseTensor, each as wide as the batch.

  A shard keeps the batch's extent in every dimension after the first, as
  one device sees it: a variable-length feature is as wide as the batch's
  longest row, which is what the towers compute too (a maximum of lengths
  is a batch reduction: the whole batch's, see `_meet.rewiring`).
  """
  trailing = sparse.dense_shape[1:]
  static = tf.get_static_value(sparse.dense_shape)
  shards = []
  for window in windows:
    start = tf.concat([[tf.cast(window.start, tf.int64)],
                       tf.zeros_like(trailing)],
                      axis=0)
    extent = tf.concat([[tf.cast(window.size, tf.int64)], trailing], axis=0)
    shard = tf.sparse.slice(sparse, start, extent)
    if static is not None and isinstance(window.size, int):
      shape = tf.constant(np.concatenate([[window.size], static[1:]]), tf.int64)
    else:
      shape = extent
    shards.append(tf.SparseTensor(shard.indices, shard.values, shape))
  return shards


def padded_to_widest(tensors: List[tf.Tensor]) -> List[tf.Tensor]:
  """The towers' per-row outputs padded with zeros to the widest's extents.

  Shards of a variable-length SparseTensor are as wide as their own rows
  (see `_split_sparse`), so per-step outputs computed from them (a
  densified feature times a weight, a masked RNN's sequence) differ in
  width from tower to tower; one device's batch is as wide as the widest
  shard, and pads with what the model computes there (zeros for those
  two). Tensors whose dimensions after the first are static and alike, and
  RaggedTensors, are returned as they are.
  """
  first = tensors[0].shape
  if not all(isinstance(t, tf.Tensor) for t in tensors) or (
      first.rank is None or
      first.rank < 2) or (first[1:].is_fully_defined() and
                          all(t.shape[1:] == first[1:] for t in tensors)):
    return list(tensors)
  shapes = [tf.shape(t, out_type=tf.int64) for t in tensors]
  widest = tf.reduce_max(tf.stack(shapes), axis=0)
  padded = []
  for tensor, shape in zip(tensors, shapes):
    after = tf.concat([[0], widest[1:] - shape[1:]], axis=0)
    padded.append(
        tf.pad(
            tensor,
            tf.stack([tf.zeros_like(after), after], 1),
            constant_values=tf.zeros((), tensor.dtype)))
  return padded


def _split_ragged(ragged: tf.RaggedTensor,
                  windows: List[_Window]) -> List[tf.RaggedTensor]:
  """Row slices; python ints where the sizes are, so shapes stay static."""
  return [ragged[w.start:w.start + w.size] for w in windows]


def _split_leaf(leaf: Any, sizes: List[Size], windows: List[_Window],
                tiled: bool) -> List[Any]:
  if leaf is None:
    return [None] * len(sizes)
  if isinstance(leaf, tf.SparseTensor):
    return _split_sparse(leaf, windows)
  if isinstance(leaf, tf.RaggedTensor):
    return _split_ragged(leaf, windows)
  return _split_dense(leaf, sizes, windows, tiled)


def _fractions(sizes: List[Size], batch_size: Size) -> List[Any]:
  """Each tower's share of the batch; tower 0 holds all of an empty batch.

  So the shares always add up to one, and with an empty batch tower 0's
  loss (a mean over nothing: NaN, as on one device) is the whole batch's.
  Python floats where the batch is static, else float64 tensors: both are
  the correctly rounded double, so a float64 loss weighted by them is
  float64-exact and a float32 one rounds them once.
  """
  if isinstance(batch_size, int):
    if not batch_size:
      return [1.0] + [0.0] * (len(sizes) - 1)
    return [size / batch_size for size in sizes]
  total = tf.cast(batch_size, tf.float64)
  fractions = [
      tf.math.divide_no_nan(tf.cast(size, tf.float64), total) for size in sizes
  ]
  fractions[0] = tf.where(total > 0, fractions[0], tf.constant(1.0, tf.float64))
  return fractions


def _opaque(tensor: tf.Tensor) -> tf.Tensor:
  """`tensor` with its size in dimension 0 known at run time only."""
  shape = tensor.shape
  if shape.rank:
    shape = tf.TensorShape([None]).concatenate(shape[1:])
  return tf.compat.v1.placeholder_with_default(tensor, shape)


def _unfolded(shard: Any) -> Any:
  """A shard as the model_fn sees it: its size in dimension 0 unknown.

  A tower's code that reads the shard's size when built (`x.shape[0]`,
  `tf.ones_like(x)` and `tf.shape(x)` of a static shape, which TensorFlow
  folds into constants; shape inference from a constant shard's values)
  would compute with its shard's size where one device computes with the
  whole batch's, silently. Unknown when built, the size is a tensor of the
  step, which the towers' batch reductions make the whole batch's where it
  is read as a value (`_meet.rewiring`). Dimensions after the first stay static.
  """
  if shard is None:
    return None
  if isinstance(shard, tf.SparseTensor):
    return tf.SparseTensor(
        _opaque(shard.indices), _opaque(shard.values),
        tf.compat.v1.placeholder_with_default(shard.dense_shape,
                                              shard.dense_shape.shape))
  if isinstance(shard, tf.RaggedTensor):
    return tf.RaggedTensor.from_nested_row_splits(
        _opaque(shard.flat_values),
        [_opaque(splits) for splits in shard.nested_row_splits],
        validate=False)
  return _opaque(shard)


def split_batch(features: Any, labels: Any, num_shards: int) -> Shards:
  """Splits `features` and `labels` into `num_shards` row-aligned shards.

  A tower left without examples by a non-empty batch gets one phantom row
  (the batch's last) and `valid` False; its `sizes` entry stays 0.

  Raises:
    ValueError: a leaf is a scalar or not a tensor (a Python list of
      numbers or strings is one tensor, see `_prepare.leaves`), or the leaves'
      static shapes disagree on the batch size (dynamic sizes that disagree fail
      the runtime checks, naming the leaves and their sizes).
  """
  features = _leaves.as_tensors(features, "features")
  labels = _leaves.as_tensors(labels, "labels")
  structure = (features, labels)
  leaves = tf.nest.flatten(structure)
  paths = _paths(features, "features") + _paths(labels, "labels")
  leaves = [_as_tensor(p, leaf) for p, leaf in zip(paths, leaves)]
  named = [(p, leaf) for p, leaf in zip(paths, leaves) if leaf is not None]
  if not named:
    raise ValueError(
        "features and labels hold no tensor to split across towers; pass at "
        "least one feature with a batch dimension.")
  batch_size, checks = _batch_size(named)
  sizes = shard_sizes(batch_size, num_shards)
  with tf.control_dependencies(checks):
    windows = _windows(sizes, batch_size)
    tiled = _tiled(sizes, batch_size)
    split_leaves = [[
        _unfolded(shard) for shard in _split_leaf(leaf, sizes, windows, tiled)
    ] for leaf in leaves]
  towers = [
      tf.nest.pack_sequence_as(structure, [s[i]
                                           for s in split_leaves])
      for i in range(num_shards)
  ]
  return Shards(
      features=[f for f, _ in towers],
      labels=[label for _, label in towers],
      sizes=sizes,
      fractions=_fractions(sizes, batch_size),
      valid=_valid(sizes))
