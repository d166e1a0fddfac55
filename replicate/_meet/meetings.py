"""Meetings: calls of a model_fn that need every tower.

An optimizer call, gradients a model_fn takes itself, `batch_sum` and
`batch_concat` need every tower's value. The towers are built one after
another, tower 0 last (see `_towers.build`), so such a call is a meeting:

1. In a tower built before tower 0 the call records what the tower brings
   (its loss, its values) and hands back stand-ins of the result's
   structure and static shapes: an Identity of a placeholder for a
   tensor, a NoOp for an op. The tower's model_fn runs on to its end.
2. Tower 0 reaches the same call last. The calls are compared (the same
   kind, the same variables, in the same order in every tower, else a
   ValueError naming them); the batch reductions built so far are made
   the whole batch's (`_meet.rewiring`), so that the losses are; then the
   meeting is built once, in tower 0's own scopes and control dependencies, as
   the call is on one device, and tower 0 gets the real result.
3. Every other tower's stand-ins are wired to its share of the result: the
   placeholder's readers read the result; the NoOp runs after it.

A stand-in keeps what the tower's code gave the call (its name scope,
device and control dependencies: a write the model_fn made a control
dependency of the call still runs). Nothing of a meeting's result is
guessed for tower 0; the stand-ins of the other towers, whose values
besides their rows never run (see `_merge.specs`), take the structure the
result is expected to have, and are converted where it differs.
"""

from typing import (
    Any,
    Callable,
    Dict,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
)

from absl import logging
import tensorflow as tf

from replicate import _context
from replicate import _tf
from replicate._batch import row_kinds


class OpSpec(NamedTuple):
  """A stand-in for an Operation (or anything run for its effect)."""


class TensorSpec(NamedTuple):
  """A stand-in for a tensor: static shape, dtype and kind."""
  shape: tf.TensorShape
  dtype: tf.DType
  kind: Any = row_kinds.WHOLE


class SlicesSpec(NamedTuple):
  """A stand-in for an IndexedSlices gradient of a variable."""
  values: tf.TensorShape
  dtype: tf.DType
  dense_shape: Any


class SparseSpec(NamedTuple):
  """A stand-in for a SparseTensor: its dense shape's rank, values' dtype."""
  rank: int
  dtype: tf.DType


OP = OpSpec()
Spec = Any  # a nest of OpSpec, TensorSpec, SlicesSpec and None


class _Call(NamedTuple):
  kind: str
  signature: Any
  value: Any
  standins: Any  # towers built before tower 0: what they were handed
  entries: Any  # and what to wire


class Meetings:
  """The meetings of one replicated model_fn call, tower by tower."""

  def __init__(self, replication: _context.Replication) -> None:
    self._replication = replication
    self._calls: Dict[int, List[_Call]] = {
        i: [] for i in range(replication.num_towers)
    }
    # A stand-in's placeholder -> the tensors its tower brought the call.
    self._brought: Dict[tf.Operation, List[tf.Tensor]] = {}

  def meet(self,
           kind: str,
           value: Any,
           build: Callable[[List[Any]], List[Any]],
           spec: Callable[[Any], Spec],
           signature: Any = None) -> Any:
    """This tower's result of the meeting `kind`.

    Args:
      kind: what the call is, for errors (e.g. "Adam.minimize").
      value: what this tower brings.
      build: called once, by tower 0, with every tower's value (in tower
        order); returns every tower's result (tower order).
      spec: `spec(value)`: the structure of the result a tower built
        before tower 0 gets stand-ins of.
      signature: what must be the same in every tower's call.
    """
    replication = self._replication
    assert replication.tower is not None  # its callers meet in a tower
    index = replication.tower.index
    calls = self._calls[index]
    position = len(calls)
    if index != 0:
      with replication.library():
        standins, entries = _standins(spec(value), kind, replication)
      calls.append(_Call(kind, signature, value, standins, entries))
      brought = [
          t for t in tf.nest.flatten(value, expand_composites=True)
          if isinstance(t, tf.Tensor)
      ]
      for entry in entries:
        if entry.holder is not None:
          self._brought[entry.holder.op] = brought
      return standins
    replication.views.share_imported()
    others = self._others_at(position, kind, signature)
    calls.append(_Call(kind, signature, value, None, None))
    replication.rewiring.advance()
    values = [
        value if i == 0 else others[i].value
        for i in range(replication.num_towers)
    ]
    replication.meeting_depth += 1
    try:
      with replication.library():
        results = build(values)
    finally:
      replication.meeting_depth -= 1
    with replication.library():
      for i in range(1, replication.num_towers):
        _wire(others[i].standins, others[i].entries, results[i], replication)
        _pair_rows(replication, results[0], others[i].standins, i)
    logging.info("replicate: %s met the %d towers", kind,
                 replication.num_towers)
    return results[0]

  def _others_at(self, position: int, kind: str,
                 signature: Any) -> Dict[int, _Call]:
    """Every other tower's call at `position`; they must match tower 0's."""
    others: Dict[int, _Call] = {}
    for index in range(1, self._replication.num_towers):
      calls = self._calls[index]
      if position >= len(calls):
        raise ValueError(
            f"Tower 0 made call {position + 1} that needs every tower, "
            f"{kind}, but tower {index} made only {len(calls)} such calls "
            f"({_listed(calls)}); every tower must make the same optimizer "
            "calls, tf.gradients calls and replicate.batch_sum / "
            "batch_concat calls in the same order (a model_fn that calls an "
            "optimizer in one tower only, e.g. behind a Python counter of "
            "its calls, cannot be replicated).")
      call = calls[position]
      if call.kind != kind or call.signature != signature:
        raise ValueError(
            f"The towers made different calls that need every tower: call "
            f"{position + 1} of tower {index} is {call.kind}"
            f"{_signature(call.signature)} but tower 0's is {kind}"
            f"{_signature(signature)}; every tower must make the same "
            "optimizer calls on the same variables, tf.gradients calls and "
            "replicate.batch_sum / batch_concat calls in the same order.")
      others[index] = call
    return others

  def check_complete(self) -> None:
    """After tower 0: no tower made a meeting call tower 0 did not."""
    made = len(self._calls[0])
    for index in range(1, self._replication.num_towers):
      calls = self._calls[index]
      if len(calls) > made:
        extra = calls[made]
        raise ValueError(
            f"Tower {index} made {len(calls)} calls that need every tower "
            f"but tower 0 made {made}: tower {index}'s {extra.kind} has no "
            "counterpart in tower 0; every tower must make the same "
            "optimizer calls, tf.gradients calls and replicate.batch_sum / "
            "batch_concat calls in the same order (e.g. not behind a "
            "Python counter of the model_fn's calls).")

  def count(self, kinds: Sequence[str] = ()) -> int:
    """How many meetings tower 0 made (of `kinds`' prefixes, if given)."""
    return sum(1 for call in self._calls[0]
               if not kinds or call.kind.startswith(tuple(kinds)))

  def brought(self, op: tf.Operation) -> List[tf.Tensor]:
    """What a tower brought to the call whose stand-in placeholder `op` is
    (what the call's result is computed from), or nothing."""
    return self._brought.get(op, [])

  def standin_kinds(self, index: int) -> Dict[Any, Any]:
    """Kinds of the stand-ins tower `index` was handed, by tensor ref."""
    kinds: Dict[Any, Any] = {}
    for call in self._calls[index]:
      for entry in call.entries or ():
        if isinstance(entry.standin, tf.Tensor):
          kinds[entry.standin.ref()] = entry.kind
    return kinds


def _pair_rows(replication: _context.Replication, result0: Any, standins: Any,
               index: int) -> None:
  """Tells the rewiring which stand-in of tower `index` is tower 0's result."""
  pairs: List[Tuple[Any, Any]] = []
  _pairs(standins, result0, pairs)
  for standin, real in pairs:
    if isinstance(standin, tf.Tensor) and isinstance(real, tf.Tensor):
      replication.rewiring.pair(real, index, standin)


def _listed(calls: Sequence[_Call]) -> str:
  return ", ".join(c.kind for c in calls) or "none"


def _signature(signature: Any) -> str:
  return "" if signature is None else f" of {signature}"


class _Entry(NamedTuple):
  """A stand-in leaf: the tensor or op handed out, its placeholder, kind."""
  standin: Any
  holder: Optional[tf.Tensor]
  kind: Any


def _standins(spec: Spec, kind: str,
              replication: _context.Replication) -> Tuple[Any, List[_Entry]]:
  """Stand-ins for a result of structure `spec`, and their entries.

  Leaves of `spec` that are no specs (variables, None, Python values) are
  handed out as they are.
  """
  entries: List[_Entry] = []

  def tensor(shape: tf.TensorShape, dtype: tf.DType,
             leaf_kind: Any) -> tf.Tensor:
    with _context.outside(replication):
      holder = tf.compat.v1.placeholder(dtype, shape, name="standin")
    standin = tf.identity(holder, name="standin")
    entries.append(_Entry(standin, holder, leaf_kind))
    return standin

  def make(leaf: Any) -> Any:
    if isinstance(leaf, OpSpec):
      op = tf.no_op(name="standin")
      entries.append(_Entry(op, None, row_kinds.WHOLE))
      return op
    if isinstance(leaf, TensorSpec):
      return tensor(leaf.shape, leaf.dtype, leaf.kind)
    if isinstance(leaf, SlicesSpec):
      values = tensor(leaf.values, leaf.dtype, row_kinds.WHOLE)
      indices = tensor(
          tf.TensorShape([leaf.values[0]]), tf.int64, row_kinds.WHOLE)
      shape = (None if leaf.dense_shape is None else tf.constant(
          leaf.dense_shape, tf.int64))
      return tf.IndexedSlices(values, indices, shape)
    if isinstance(leaf, SparseSpec):
      return tf.SparseTensor(
          tensor(tf.TensorShape([None, leaf.rank]), tf.int64, row_kinds.WHOLE),
          tensor(tf.TensorShape([None]), leaf.dtype, row_kinds.WHOLE),
          tensor(tf.TensorShape([leaf.rank]), tf.int64, row_kinds.WHOLE))
    if isinstance(leaf, list):
      return [make(item) for item in leaf]
    if isinstance(leaf, tuple) and not hasattr(leaf, "_fields"):
      return tuple(make(item) for item in leaf)
    if isinstance(leaf, dict):
      return {key: make(item) for key, item in leaf.items()}
    return leaf

  with tf.name_scope(_scope_name(kind)):
    standins = make(spec)
  return standins, entries


def _scope_name(kind: str) -> str:
  return "standin_" + "".join(c if c.isalnum() else "_" for c in kind)


def _pairs(standin: Any, real: Any, out: List[Tuple[Any, Any]]) -> None:
  """(stand-in leaf, real leaf) pairs, walking both structures together."""
  if isinstance(standin, (tf.Tensor, tf.Operation)):
    out.append((standin, real))
  elif isinstance(standin, tf.SparseTensor):
    parts = ([real.indices, real.values, real.dense_shape] if isinstance(
        real, tf.SparseTensor) else [None] * 3)
    for s, r in zip([standin.indices, standin.values, standin.dense_shape],
                    parts):
      out.append((s, r))
  elif isinstance(standin, tf.IndexedSlices):
    if isinstance(real, tf.IndexedSlices):
      out.append((standin.values, real.values))
      out.append((standin.indices, real.indices))
    else:
      out.append((standin.values, _AsSlices(real, "values")))
      out.append((standin.indices, _AsSlices(real, "indices")))
  elif isinstance(standin, (list, tuple)) and not hasattr(standin, "_fields"):
    reals = list(real) if isinstance(real, (list, tuple)) else []
    reals += [None] * (len(standin) - len(reals))
    for s, r in zip(standin, reals):
      _pairs(s, r, out)
  elif isinstance(standin, dict):
    for key, item in standin.items():
      _pairs(item, real.get(key) if isinstance(real, dict) else None, out)


def _wire(standins: Any, entries: Sequence[_Entry], result: Any,
          replication: _context.Replication) -> None:
  """Makes a tower's stand-ins read (or wait for) its result."""
  holders = {id(e.standin): e.holder for e in entries}
  pairs: List[Tuple[Any, Any]] = []
  _pairs(standins, result, pairs)
  for standin, real in pairs:
    if isinstance(standin, tf.Operation):
      targets = [
          getattr(r, "op", r)
          for r in (real if isinstance(real, (list, tuple)) else [real])
      ]
      for target in targets:
        if isinstance(target, tf.Operation) and (target.graph is standin.graph):
          _tf.add_control_input(standin, target)
      continue
    holder = holders.get(id(standin))
    if holder is None:
      continue
    if real is None:
      with _context.outside(replication):
        real = tf.zeros_like(holder)
    real = _compatible(real, holder, replication)
    if real is not None:
      _tf.rewire(holder, real)


class _AsSlices(NamedTuple):
  """A dense result where the stand-in was an IndexedSlices' part."""
  dense: Any
  part: str


def _compatible(real: Any, holder: tf.Tensor,
                replication: _context.Replication) -> Optional[tf.Tensor]:
  """`real` in a form the placeholder's readers can read, or None."""
  with _context.outside(replication):
    if isinstance(real, _AsSlices):
      dense = tf.convert_to_tensor(real.dense)
      if real.part == "values":
        real = dense
      else:
        real = tf.range(tf.shape(dense, out_type=tf.int64)[0])
    elif isinstance(real, tf.IndexedSlices):
      real = tf.convert_to_tensor(real)
    elif isinstance(real, tf.Operation) or not tf.is_tensor(real):
      return None
    if real.graph is not holder.graph:
      return None
    if real.dtype != holder.dtype:
      real = tf.cast(real, holder.dtype)
    if not real.shape.is_compatible_with(holder.shape):
      real = tf.compat.v1.placeholder_with_default(
          real,
          tf.TensorShape(None) if holder.shape.rank is None else [None] *
          holder.shape.rank)
  return real


def tensor_spec(tensor: Any, kind: Any = row_kinds.WHOLE) -> TensorSpec:
  """The spec of a result shaped like `tensor`."""
  tensor = tf.convert_to_tensor(tensor)
  return TensorSpec(tensor.shape, tensor.dtype, kind)
