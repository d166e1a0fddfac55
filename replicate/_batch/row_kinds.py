"""What a tower's tensor holds (its kind), and what the towers must do
about an op (its event): the vocabulary of `_batch.rows`.
"""

from typing import (
    Any,
    FrozenSet,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import tensorflow as tf


class _Whole:
  """The kind of a value every tower shares with one device."""

  def __repr__(self):
    return "WHOLE"


class _Shard:
  """The kind of a per-tower statistic asked for (sync_batch_norm=False)."""

  def __repr__(self):
    return "SHARD"


WHOLE = _Whole()

SHARD = _Shard()


class Rows(NamedTuple):
  """The tower's rows of one device's tensor, cut along `axis`."""
  axis: int


class Size(NamedTuple):
  """An integer computed from the shard's size.

  `entries`: for a vector, the positions holding batch-derived values (None:
  unknown); a scalar has `scalar` True.
  """
  scalar: bool
  entries: Optional[FrozenSet[int]] = None


class Local(NamedTuple):
  """A per-tower value that is not one device's: `op` made it, `why`."""
  op: str
  why: str


class Listed(NamedTuple):
  """A TensorList (or TensorArray flow) of elements with rows on `axis`."""
  axis: int


class Like(NamedTuple):
  """The kind of `tensor` (a gradient with respect to it, say)."""
  tensor: Any


Kind = Union[_Whole, _Shard, Rows, Size, Local, Listed]


class Reduction(NamedTuple):
  """`op` reduces rows; the whole batch's value combines the towers' by
  `combine` ('sum', 'mean', 'max', 'min', 'prod', 'all', 'any', 'norm')."""
  op: tf.Operation
  combine: str
  axis: int  # the rows axis of the reduced input


class SizeUse(NamedTuple):
  """`op` reads a shard size (`op.inputs[index]`) as a value."""
  op: tf.Operation
  index: int


class Mixing(NamedTuple):
  """`op` mixes rows and cannot be split: it runs once on the whole batch.

  `kinds`: its outputs' kinds when it does (rows are handed back to the
  towers, other values are the whole batch's).
  """
  op: tf.Operation
  kinds: Tuple[Any, ...] = ()


class FusedNorm(NamedTuple):
  """A fused batch-norm kernel in training on the tower's rows."""
  op: tf.Operation


Event = Union[Reduction, SizeUse, Mixing, FusedNorm]


def is_rows(kind) -> bool:
  return isinstance(kind, Rows)


def is_local(kind) -> bool:
  return isinstance(kind, Local)


def shares_value(kind) -> bool:
  """Whether a tensor of this kind is one device's value in every tower."""
  return kind is WHOLE


def join(kinds: Sequence[Kind]) -> Kind:
  """One kind for values that may be any of `kinds` (branches, loop)."""
  kinds = [k for k in kinds if k is not None]
  if not kinds:
    return WHOLE
  locals_ = [k for k in kinds if is_local(k)]
  if locals_:
    return locals_[0]
  distinct = []
  for k in kinds:
    if k not in distinct:
      distinct.append(k)
  if len(distinct) == 1:
    return distinct[0]
  non_whole = [k for k in distinct if k is not WHOLE]
  if len(non_whole) == 1 and not isinstance(non_whole[0], Size):
    return non_whole[0]
  if all(isinstance(k, Size) or k is WHOLE for k in distinct):
    return Size(scalar=all(k.scalar for k in distinct if isinstance(k, Size)))
  return Local("", f"is one of {distinct} by a condition")


def first_rows(kinds) -> Optional[Rows]:
  for kind in kinds:
    if isinstance(kind, Rows):
      return kind
  return None


def any_local(kinds) -> Optional[Local]:
  for kind in kinds:
    if is_local(kind):
      return kind
  return None


def same_for_outputs(op, kind) -> List[Kind]:
  return [kind] * len(op.outputs)
