"""Summaries of per-batch scalars (the loss above all): the whole batch's.

TensorBoard shows tower 0's summaries, under the unwrapped names (later
towers' are left out of the SUMMARIES collection, see `_towers`). A scalar
summary of the loss (the canned heads' `loss`, a v1 head's `average_loss`,
a user's `tf.compat.v1.summary.scalar('loss', loss)`), of a weighted mean,
a ratio of sums or a sum over the batch would show tower 0's share; such a
summary is given the whole batch's value instead (see `_scalars`), keeping
its op, name and tag, so the Estimator still finds its `loss` summary and
`merge_all` sees no second tag. Summaries of anything else stay tower 0's.
"""

from typing import Any, Sequence

from absl import logging

from replicate import _scalars
from replicate._context import Replication

_SCALAR_SUMMARIES = frozenset(["ScalarSummary"])


def combine_scalar_summaries(replication: Replication, specs: Sequence[Any],
                             scalars: "_scalars.Scalars" = None):
  """Rewires tower 0's scalar summaries of per-batch scalars to the batch's."""
  scalars = scalars or _scalars.Scalars(replication, specs)
  for op in replication.tower_ops[0]:
    if op.type not in _SCALAR_SUMMARIES:
      continue
    whole = scalars.whole_batch(op.inputs[1])
    if whole is None:
      continue
    # Ops have no public way to change an input once built; a summary has
    # no gradient and no consumer but the summary writer, so nothing else
    # changes.
    op._update_input(1, whole)  # pylint: disable=protected-access
    logging.info("replicate: summary %s shows the whole batch's value",
                 op.name)
