"""What a tower's tensor holds (its kind), and what the towers must do
about an op (its event): the vocabulary of `_batch.rows`.
"""

from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    FrozenSet,
    Iterable,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Union,
)

import tensorflow as tf

if TYPE_CHECKING:
  from typing_extensions import TypeGuard


class _Whole:
  """The kind of a value every tower shares with one device."""

  def __repr__(self) -> str:
    return "WHOLE"


class _Shard:
  """The kind of a per-tower statistic asked for (sync_batch_norm=False)."""

  def __repr__(self) -> str:
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

# What a tensor the tower did not compute may be declared (`rows.TowerRows`).
Source = Union[Kind, Like]


class Reduction(NamedTuple):
  """`op` reduces rows; the whole batch's value combines the towers' by
  `combine` ('sum', 'mean', 'max', 'min', 'prod', 'all', 'any', 'norm')."""
  op: tf.Operation
  combine: str
  axis: int  # the rows axis of the reduced input


class SizeUse(NamedTuple):
  """`op` reads a shard size (`op.inputs[index]`) as a value."""
  op: tf.Operation
  # Shadows tuple.index; the name is read in _meet.rewiring (not renamed).
  index: int  # type: ignore[assignment]


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


class Context(Protocol):
  """What a rule reports to and asks of its run (`rows._Context`)."""

  # Whether an op's statistics are asked to stay the tower's.
  per_tower: Callable[[tf.Operation], bool]

  def needs_every_tower(self, op: tf.Operation, event: Optional[Event],
                        kind: Kind, why: str) -> Kind:
    """An op needing every tower's rows: an event, or in a body a mark."""

  def reduce(self, op: tf.Operation, combine: str, axis: int) -> Kind:
    """A batch reduction: the whole batch's value once rewired."""

  def function_kinds(self, op: tf.Operation,
                     kinds: Sequence[Kind]) -> Optional[List[Kind]]:
    """A call's output kinds; a body needing every tower runs once."""


# A rule: an op, its inputs' kinds and the run's context -> its outputs' kinds.
Rule = Callable[[tf.Operation, Sequence[Kind], Context], Sequence[Kind]]


def is_rows(kind: Kind) -> "TypeGuard[Rows]":
  return isinstance(kind, Rows)


def is_local(kind: Kind) -> "TypeGuard[Local]":
  return isinstance(kind, Local)


def without_rows(op: tf.Operation,
                 kinds: Sequence[Kind]) -> Optional[List[Kind]]:
  """`op`'s output kinds where its inputs leave no rows to follow: all
  WHOLE (WHOLE outputs), or one Local (that Local); None otherwise."""
  if all(k is WHOLE for k in kinds):
    return same_for_outputs(op, WHOLE)
  local = any_local(kinds)
  if local:
    return same_for_outputs(op, local)
  return None


def non_row(kind: Kind) -> Kind:
  """The kind of a value computed from one value of `kind`, not rows: a
  Local or SHARD value stays what it is; anything else is WHOLE."""
  return kind if is_local(kind) or kind is SHARD else WHOLE


def shares_value(kind: Kind) -> bool:
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


def first_rows(kinds: Iterable[Kind]) -> Optional[Rows]:
  for kind in kinds:
    if isinstance(kind, Rows):
      return kind
  return None


def any_local(kinds: Iterable[Kind]) -> Optional[Local]:
  for kind in kinds:
    if is_local(kind):
      return kind
  return None


def same_for_outputs(op: tf.Operation, kind: Kind) -> List[Kind]:
  return [kind] * len(op.outputs)
