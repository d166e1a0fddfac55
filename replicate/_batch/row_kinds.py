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
  """The tower's rows of one device's tensor, cut along `axis`; `order`:
  the op that put them in another order than one device's (rows joined
  along the rows: the towers' pieces interleave), or None."""
  axis: int
  order: Optional[str] = None


class Size(NamedTuple):
  """An integer computed from the shard's size.

  `entries`: for a vector, the positions holding batch-derived values (None:
  unknown); a scalar has `scalar` True.
  """
  scalar: bool
  entries: Optional[FrozenSet[int]] = None


class Coordinates(NamedTuple):
  """Integer coordinates of entries of the tower's rows ([n, rank]: a
  sparse tensor's indices, `tf.where`'s): column 0 holds positions of the
  tower's rows, the others the entries' positions within them."""


class Positions(NamedTuple):
  """Integer rows holding positions of the tower's rows (`tf.range` of a
  rows count, and integer values computed from it): as indices into the
  tower's own rows they are one device's; read as values anywhere else
  they are made the whole batch's positions (`PositionUse`), which
  `whole` says they have (counted from 0 by 1 up to a count of rows)."""
  axis: int
  whole: bool = True


class Local(NamedTuple):
  """A per-tower value that is not one device's: `op` made it, `why`."""
  op: str
  why: str


class Listed(NamedTuple):
  """A TensorList (or TensorArray flow) of elements with rows on `axis`;
  `ROWS_LISTED` (axis -1): a list of the rows themselves (`tf.map_fn`)."""
  axis: int


ROWS_LISTED = -1

# Why a value in a loop body over a list of the rows is the tower's own:
# it is one of its rows (fine in the body; stacked, it is rows again).
ONE_ROW = "is one of the tower's rows, taken in a loop over them"


def one_row(op: tf.Operation) -> "Local":
  """The kind of an element of a list of the rows, taken by `op`."""
  return Local(op.name, ONE_ROW)


def is_one_row(kind: Any) -> bool:
  return isinstance(kind, Local) and kind.why == ONE_ROW


class Like(NamedTuple):
  """The kind of `tensor` (a gradient with respect to it, say)."""
  tensor: Any


Kind = Union[_Whole, _Shard, Rows, Size, Positions, Coordinates, Local, Listed]

# What a tensor the tower did not compute may be declared (`rows.TowerRows`).
Declared = Union[Kind, Like]


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


class PositionUse(NamedTuple):
  """`op` reads positions of the tower's rows (`op.inputs[index]`) as
  values: they must be the whole batch's positions."""
  op: tf.Operation
  # Shadows tuple.index, as SizeUse's.
  index: int  # type: ignore[assignment]


class Mixing(NamedTuple):
  """`op` mixes rows and cannot be split: it runs once on the whole batch.

  `kinds`: its outputs' kinds when it does (rows are handed back to the
  towers, other values are the whole batch's). `guessed`: the kinds come
  from the outputs' shapes, not from a rule proven against the op, so the
  run checks them (a row per example where rows are handed back).
  """
  op: tf.Operation
  kinds: Tuple[Any, ...] = ()
  guessed: bool = False


class FusedNorm(NamedTuple):
  """A fused batch-norm kernel in training on the tower's rows."""
  op: tf.Operation


Event = Union[Reduction, SizeUse, PositionUse, Mixing, FusedNorm]

# The mode of a run over a tower's own ops (not a function body's).
TOWER_OPS = "tower"


class Context(Protocol):
  """What a rule reports to and asks of its run (`rows._Context`)."""

  # TOWER_OPS for the tower's own ops; else a function body's.
  mode: str

  # Whether an op's statistics are asked to stay the tower's.
  per_tower: Callable[[tf.Operation], bool]
  # Inputs of the op at hand holding positions of the tower's own rows,
  # used as indices into them (passed to its rule as Rows).
  own_positions: FrozenSet[int]

  def needs_every_tower(self, op: tf.Operation, event: Optional[Event],
                        kind: Kind, why: str) -> Kind:
    """An op needing every tower's rows: an event, or in a body a mark."""

  def reduce(self, op: tf.Operation, combine: str, axis: int) -> Kind:
    """A batch reduction: the whole batch's value once rewired."""

  def whole_batch(self,
                  op: tf.Operation,
                  outputs: Sequence[Kind],
                  why: str,
                  guessed: bool = False) -> List[Kind]:
    """An op mixing rows, run once on the whole batch: its outputs' kinds
    (rows handed back to each tower where an output keeps the rows);
    `guessed`: kinds read off the outputs' shapes (see `Mixing`)."""

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
  local = any_local(kinds)
  if local:
    return local
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
  """A Local among `kinds`: one that is not one row of a loop over the
  rows first (a value mixing such a row with a tower's own value is the
  tower's own)."""
  found = None
  for kind in kinds:
    if is_local(kind):
      if not is_one_row(kind):
        return kind
      found = found or kind
  return found


def same_for_outputs(op: tf.Operation, kind: Kind) -> List[Kind]:
  return [kind] * len(op.outputs)


def rows_by_shape(op: tf.Operation, axis: int) -> List[Kind]:
  """The kinds of the outputs of an op with no rule, run once on the whole
  batch: rows where an output has an unknown extent on the rows `axis` (as
  the shards have), else one whole value. An unknown rank is taken to be
  a whole value; the run checks that it holds no row per example."""
  return [
      Rows(axis) if t.shape.rank is not None and t.shape.rank > axis and
      t.shape[axis] is None else WHOLE for t in op.outputs
  ]


# Why an output of Unique is the tower's own: its distinct values, which
# its rows' indices (the other output) point into.
TOWER_SET = "is the set of the tower's values"


def is_tower_set(kind: Any) -> bool:
  """Whether `kind` is the tower's own distinct values (or a value looked
  up by them), which the tower's rows' indices pick from as rows."""
  return isinstance(kind, Local) and kind.why == TOWER_SET
