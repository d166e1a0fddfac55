"""Splitting a batch of features and labels into one shard per tower.

Shards are taken along dimension 0, in order, with sizes that differ by at
most one, so concatenating the towers' outputs gives the input order back.
Tensors, SparseTensors (split by rows) and any nest of them are supported.
"""

from typing import Any, List, NamedTuple, Union

import tensorflow as tf

Size = Union[int, tf.Tensor]


class Shards(NamedTuple):
  """The per-tower inputs and the share of the batch each tower holds."""
  features: List[Any]
  labels: List[Any]
  sizes: List[Size]       # examples per tower (ints when the batch is static)
  fractions: List[Any]    # size / batch size: floats, or float32 tensors


def _paths(structure, prefix):
  """Names of the leaves of `structure`, in `tf.nest.flatten` order."""
  if isinstance(structure, dict):
    return [p for key in sorted(structure)
            for p in _paths(structure[key], f"{prefix}[{key!r}]")]
  if isinstance(structure, (list, tuple)):
    return [p for i, item in enumerate(structure)
            for p in _paths(item, f"{prefix}[{i}]")]
  return [prefix]


def _as_tensor(path, value):
  if value is None or isinstance(value, (tf.Tensor, tf.SparseTensor)):
    return value
  if isinstance(value, tf.compat.v1.SparseTensorValue):
    return tf.SparseTensor.from_value(value)
  try:
    return tf.convert_to_tensor(value)
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"`{path}` of type {type(value).__name__} cannot be split across "
        f"towers ({e}); pass Tensors, SparseTensors or nests of them.") from None


def _static_batch_size(path, tensor):
  shape = tensor.shape
  if isinstance(tensor, tf.SparseTensor):
    known = tf.get_static_value(tensor.dense_shape)
    if known is not None:
      shape = tf.TensorShape(known)
  if shape.rank == 0:
    raise ValueError(
        f"`{path}` is a scalar and has no batch dimension to split across "
        "towers; give every feature and label a leading batch dimension.")
  if shape.rank is None:
    return None
  return tf.compat.dimension_value(shape[0])


def _dynamic_batch_size(tensor):
  if isinstance(tensor, tf.SparseTensor):
    return tensor.dense_shape[0]
  return tf.shape(tensor, out_type=tf.int64)[0]


def _batch_size(named_leaves):
  """The batch size (int if static, else int64 scalar) shared by all leaves."""
  static = {path: _static_batch_size(path, leaf) for path, leaf in named_leaves}
  known = {path: size for path, size in static.items() if size is not None}
  if len(set(known.values())) > 1:
    listed = ", ".join(f"`{p}`: {s}" for p, s in known.items())
    raise ValueError(
        f"Features and labels have different batch sizes ({listed}); every "
        "tensor must have the same size in dimension 0 to be split across "
        "towers.")
  if known:
    return next(iter(known.values()))
  return _dynamic_batch_size(named_leaves[0][1])


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


def _split_dense(tensor, sizes):
  if all(isinstance(s, int) for s in sizes):
    return tf.split(tensor, sizes, axis=0)
  return tf.split(tensor, tf.stack(sizes), num=len(sizes), axis=0)


def _split_sparse(sparse, sizes):
  shards = []
  offset = tf.constant(0, tf.int64)
  trailing = sparse.dense_shape[1:]
  for size in sizes:
    size = tf.cast(size, tf.int64)
    start = tf.concat([[offset], tf.zeros_like(trailing)], axis=0)
    extent = tf.concat([[size], trailing], axis=0)
    shards.append(tf.sparse.slice(sparse, start, extent))
    offset += size
  return shards


def _split_leaf(leaf, sizes):
  if leaf is None:
    return [None] * len(sizes)
  if isinstance(leaf, tf.SparseTensor):
    return _split_sparse(leaf, sizes)
  return _split_dense(leaf, sizes)


def _fractions(sizes, batch_size):
  if isinstance(batch_size, int):
    return [size / batch_size if batch_size else 0.0 for size in sizes]
  total = tf.cast(batch_size, tf.float32)
  return [tf.math.divide_no_nan(tf.cast(size, tf.float32), total)
          for size in sizes]


def split_batch(features, labels, num_shards: int) -> Shards:
  """Splits `features` and `labels` into `num_shards` row-aligned shards.

  Raises:
    ValueError: a leaf is a scalar or not a tensor, or the leaves disagree on
      the batch size.
  """
  structure = (features, labels)
  leaves = tf.nest.flatten(structure)
  paths = _paths(features, "features") + _paths(labels, "labels")
  leaves = [_as_tensor(p, leaf) for p, leaf in zip(paths, leaves)]
  named = [(p, leaf) for p, leaf in zip(paths, leaves) if leaf is not None]
  if not named:
    raise ValueError(
        "features and labels hold no tensor to split across towers; pass at "
        "least one feature with a batch dimension.")
  batch_size = _batch_size(named)
  sizes = shard_sizes(batch_size, num_shards)
  split_leaves = [_split_leaf(leaf, sizes) for leaf in leaves]
  towers = [tf.nest.pack_sequence_as(structure, [s[i] for s in split_leaves])
            for i in range(num_shards)]
  return Shards(features=[f for f, _ in towers],
                labels=[l for _, l in towers],
                sizes=sizes,
                fractions=_fractions(sizes, batch_size))
