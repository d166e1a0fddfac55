"""Whole-batch values inside a tower: `batch_sum` and `batch_concat`.

A tower holds only its shard of the batch; a model that needs a value of
the whole batch asks for it here. Each call is a meeting (`_meet.meetings`):
tower 0, the last to make it, adds or concatenates the towers' values once
on the consolidation device and every tower gets the result, so gradients
flow back to every tower that contributed. A value that is already the
whole batch's (every batch reduction is, see `_meet.rewiring`: the count of a
masked mean's valid tokens, say) is one device's value as it is: on one
device both functions return it unchanged. A tower computing on a phantom
row (a batch smaller than the towers, see `_prepare.split`) contributes nothing.
"""

from typing import Any, List, Optional, Sequence, Union

import tensorflow as tf

from replicate import _context
from replicate._batch import row_kinds
from replicate._batch import sums
from replicate._meet import combining
from replicate._meet import meetings


def _tower_replication(what: str) -> Optional[_context.Replication]:
  """The replication of the tower being built; None outside one, or with
  one tower.

  Raises:
    ValueError: called inside a tf.cond / tf.while_loop / tf.function body
      of a tower, where other towers' values cannot be reached.
  """
  replication = _context.current_replication()
  if replication is None or replication.num_towers == 1 or (replication.tower
                                                            is None):
    return None
  graph = tf.compat.v1.get_default_graph()
  if graph is not replication.graph:
    raise ValueError(
        f"replicate.{what} was called inside a tf.cond, tf.while_loop or "
        "tf.function of a tower, where the other towers' values cannot be "
        "reached; call it outside (e.g. give Keras layers a Python bool "
        "`training=`).")
  return replication


def _flat(structure: Any) -> List[Any]:
  return tf.nest.flatten(structure, expand_composites=False)


def batch_sum(x: Any) -> Any:
  """The sum over every tower of the tower's `x`, in every tower.

  Every reduction over the batch already has the whole batch's value in
  every tower, so a model written as for one device needs no call: a
  masked mean `tf.reduce_sum(xent * mask) / tf.reduce_sum(mask)` is one
  device's. This adds up a value that stays each tower's; a value that
  already is the whole batch's (`tf.reduce_sum(mask)`) is returned as it
  is, as on one device.

  Differentiable: each tower's `x` gets the gradient of the sum. Outside
  `replicate_model_fn`, and with one tower, it returns `x` unchanged.

  Args:
    x: a Tensor, or a nest of Tensors, of the same shape in every tower.

  Returns:
    The sum over the towers, with the structure of `x`.

  Raises:
    TypeError: `x` holds a SparseTensor or RaggedTensor.
    ValueError: the call is inside a tf.cond / tf.while_loop body of a
      tower.
  """
  replication = _tower_replication("batch_sum")
  if replication is None:
    return x

  def build(values: List[Any]) -> List[Any]:
    with _context.outside(replication, "batch_sum"), \
        tf.device(replication.meeting_device):
      summed = [_whole_sum(replication, parts) for parts in zip(*values)]
    return [tf.nest.pack_sequence_as(x, summed)] * len(values)

  components = [_as_summable(t) for t in _flat(x)]
  flat = replication.meetings.meet(
      "replicate.batch_sum",
      components,
      build,
      lambda value: tf.nest.pack_sequence_as(
          x, [meetings.tensor_spec(t) for t in value]),
      signature=[t.dtype.name for t in components])
  return flat


def _whole_sum(replication: _context.Replication,
               parts: Sequence[tf.Tensor]) -> tf.Tensor:
  """The whole batch's value: tower 0's where it is already, else the sum."""
  if row_kinds.shares_value(replication.rewiring.kind(parts[0])):
    return tf.identity(replication.rewiring.resolve(parts[0]))
  return sums.real_sum(parts, replication.validity)


def _as_summable(value: Any) -> tf.Tensor:
  if isinstance(value, (tf.SparseTensor, tf.RaggedTensor)):
    raise TypeError(
        f"replicate.batch_sum got a {type(value).__name__}, whose shape "
        "differs from tower to tower; sum it to a dense tensor in the tower "
        "first (e.g. tf.sparse.reduce_sum), or concatenate it with "
        "replicate.batch_concat.")
  return tf.convert_to_tensor(value)


def _concat(parts: Sequence[Any]) -> Any:
  if isinstance(parts[0], tf.SparseTensor):
    # Shards of a variable-length feature differ in width (see _prepare.split).
    return tf.sparse.concat(
        axis=0, sp_inputs=list(parts), expand_nonconcat_dims=True)
  return tf.concat(list(parts), axis=0)


def _as_concatenable(path_value: Any) -> Any:
  if isinstance(path_value, (tf.SparseTensor, tf.RaggedTensor)):
    return path_value
  value = tf.convert_to_tensor(path_value)
  if value.shape.rank == 0:
    raise ValueError(
        f"replicate.batch_concat got a scalar ({value.name}), which has no "
        "batch dimension to concatenate; pass per-example values, or use "
        "replicate.batch_sum for partial sums.")
  return value


def batch_concat(x: Any) -> Any:
  """Every tower's `x`, concatenated along axis 0 in batch order.

  What one device sees of a per-example value: e.g. the whole batch's
  embeddings for a contrastive loss with in-batch negatives,

      all_embeddings = replicate.batch_concat(embeddings)
      logits = tf.matmul(embeddings, all_embeddings, transpose_b=True)

  (this tower's rows are then rows `offset .. offset + n` of the result;
  `replicate.batch_concat(tf.range(n))` style bookkeeping, or labels
  concatenated the same way, say which). Differentiable: each tower gets
  the gradient of its own rows. Outside `replicate_model_fn`, and with one
  tower, it returns `x` unchanged.

  Args:
    x: a Tensor, SparseTensor or RaggedTensor with a batch dimension, or a
      nest of them.

  Returns:
    The concatenation over the towers, with the structure of `x`.

  Raises:
    TypeError: `x` holds a RaggedTensor.
    ValueError: `x` has a scalar, or the call is inside a tf.cond /
      tf.while_loop body of a tower.
  """
  replication = _tower_replication("batch_concat")
  if replication is None:
    return x

  def build(values: List[Any]) -> List[Any]:
    with _context.outside(replication, "batch_concat"), \
        tf.device(replication.meeting_device):
      joined = [_whole_rows(replication, parts) for parts in zip(*values)]
    return [tf.nest.pack_sequence_as(x, joined)] * len(values)

  components = [_as_concatenable(t) for t in _flat(x)]
  return replication.meetings.meet(
      "replicate.batch_concat",
      components,
      build,
      lambda value: tf.nest.pack_sequence_as(x,
                                             [_concat_spec(t) for t in value]),
      signature=[t.dtype.name for t in components])


def _concat_spec(
    tensor: Any) -> Union[meetings.SparseSpec, meetings.TensorSpec]:
  if isinstance(tensor, tf.SparseTensor):
    return meetings.SparseSpec(
        tensor.shape.rank or
        tf.compat.dimension_value(tensor.dense_shape.shape[0]),
        tensor.values.dtype)
  if isinstance(tensor, tf.RaggedTensor):
    raise TypeError(
        f"replicate.batch_concat got a {type(tensor).__name__}; concatenate "
        "its dense form (tf.sparse.to_dense, RaggedTensor.to_tensor) or its "
        "values.")
  return meetings.TensorSpec(
      tf.TensorShape([None]).concatenate(tensor.shape[1:]), tensor.dtype)


def _whole_rows(replication: _context.Replication, parts: Sequence[Any]) -> Any:
  """One device's value: the towers' rows in order, or the value itself."""
  first = parts[0]
  kind = replication.rewiring.kind(
      first.values if isinstance(first, tf.SparseTensor) else first)
  if row_kinds.shares_value(kind):
    if isinstance(first, tf.SparseTensor):
      return first
    return tf.identity(replication.rewiring.resolve(first))
  return _concat(combining.real_rows(parts, replication))
