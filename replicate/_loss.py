"""The whole batch's loss, from the towers' losses.

One device averages a weighted loss over the whole batch's denominator: the
weights' sum, the number of non-zero weights or of elements. The towers'
losses are combined so that the result is exactly that value. A loss that
adds several scalar terms (`get_total_loss()`, a head's loss plus its
`regularization_losses`) is combined term by term:

- a term that reads none of the towers' inputs (a regularizer of the
  shared variables) is the same in every tower and counts once: tower 0's,
  whatever the reduction;
- with Reduction.SUM the towers' terms are added;
- a weighted mean built by `tf.compat.v1.losses` or a Keras loss (a
  `DivNoNan` named `value`: the sum of weighted losses over the
  denominator) becomes the towers' numerators summed over their
  denominators summed, so masks whose valid counts are far from
  proportional to the shards still give one device's loss;
- every other averaging term (a `tf.reduce_mean`, say) is weighted by its
  tower's share of the batch.

A tower computing on a phantom row (a batch smaller than the towers, see
`_split`) adds nothing. Towers whose losses add different numbers of terms
are combined as whole losses. The combined loss is built once per set of
tower losses, on the consolidation device, and is both what the merged
EstimatorSpec reports and what `TowerOptimizer` differentiates.
"""

from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from replicate import _aggregate
from replicate import _inputs
from replicate._context import Replication

_ADDS = frozenset(["AddN", "AddV2", "Add"])
_PASS = frozenset(["Identity"])


def combine(replication: Replication, losses: Sequence[Any]) -> tf.Tensor:
  """The whole batch's loss from each tower's (cached per set of losses)."""
  losses = [tf.convert_to_tensor(loss) for loss in losses]
  key = tuple(loss.ref() for loss in losses)
  if key not in replication.combined_losses:
    with tf.device(replication.hub), tf.name_scope("whole_batch_loss"):
      replication.combined_losses[key] = _combine(replication, losses)
  return replication.combined_losses[key]


def _combine(replication, losses: List[tf.Tensor]) -> tf.Tensor:
  terms = [_terms(loss) for loss in losses]
  if len({len(t) for t in terms}) != 1:
    terms = [[loss] for loss in losses]
  combined = [_combine_term(replication, [t[i] for t in terms])
              for i in range(len(terms[0]))]
  return combined[0] if len(combined) == 1 else tf.add_n(combined)


def _combine_term(replication, terms: List[tf.Tensor]) -> tf.Tensor:
  if replication.inputs and not _inputs.reads_batch(terms,
                                                    replication.inputs):
    # A regularizer: every tower computes the same value from the shared
    # variables, which one device counts once whatever the reduction.
    return tf.identity(terms[0])
  if _aggregate.is_sum(replication.loss_reduction):
    return _aggregate.real_sum(terms, replication.validity)
  ratios = [_ratio(term) for term in terms]
  if all(r is not None for r in ratios):
    numerator = _aggregate.real_sum([n for n, _ in ratios],
                                    replication.validity)
    denominator = _aggregate.real_sum([d for _, d in ratios],
                                      replication.validity)
    return tf.cast(tf.math.divide_no_nan(numerator, denominator),
                   terms[0].dtype)
  return tf.add_n([
      _aggregate.scale_loss(term, replication.loss_reduction,
                            replication.fraction(i), replication.size(i))
      for i, term in enumerate(terms)])


def _terms(loss: tf.Tensor) -> List[tf.Tensor]:
  """The scalar terms a loss adds up (itself, if it adds nothing)."""
  source = _skip_identities(loss)
  if source.op.type in _ADDS and all(
      t.shape.rank == 0 for t in source.op.inputs):
    return [term for t in source.op.inputs for term in _terms(t)]
  return [loss]


def _ratio(term: tf.Tensor) -> Optional[Tuple[tf.Tensor, tf.Tensor]]:
  """(sum of weighted losses, denominator) of a weighted-mean loss, or None."""
  op = _skip_identities(term).op
  if op.type == "Cast":
    op = _skip_identities(op.inputs[0]).op
  if op.type != "DivNoNan" or op.name.rsplit("/", 1)[-1] != "value":
    return None
  numerator, denominator = op.inputs
  if numerator.shape.rank != 0 or denominator.shape.rank != 0:
    return None
  return numerator, denominator


def _skip_identities(tensor: tf.Tensor) -> tf.Tensor:
  while tensor.op.type in _PASS:
    tensor = tensor.op.inputs[0]
  return tensor
