"""Gradients of mirrored variables summed between the tower devices.

Under MIRRORED (`_merge.mirrored`) every tower device keeps a copy of each
trained variable and applies the same update to it, so each device needs
the whole batch's gradient. While a meeting differentiates the whole
batch's loss, `tf.gradients` hands each variable's gradient terms (one per
read of it, each on its tower's device) to `summed_between_towers` instead
of adding them on the variable's device: each device adds its own terms,
and a ring all-reduce sums those partial sums between the devices, so each
device sends and receives 2(N-1)/N of the gradient's bytes, the minimum.
Small gradients are packed into one flat buffer per dtype, packs closed in
the order the gradients are computed, so a pack's transfers start as soon
as its last gradient exists. The ring is built from TensorFlow's own ops
(split, add, identity, concat), each on one device: the transfers are the
graph's own sends and receives, visible in its partition graphs, and work
on any device (GPUs, virtual CPUs, soft placement). Each chunk is summed
once, by one device, and copied to the others: every device gets the same
bits. Sparse gradients (IndexedSlices) are gathered instead, each device
concatenating every tower's rows in the order one device would.
"""

import contextlib
import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence

from absl import logging
import tensorflow as tf

from replicate import _context
from replicate import _tf
from replicate._prepare import devices as _devices

# A pack is closed once it holds this many bytes.
PACK_BYTES = 4 << 20

GRADIENT_TERMS = _tf.Patches("gradient terms of mirrored variables",
                             _tf.install_gradient_terms)


@dataclasses.dataclass
class MirroredGradient:
  """One variable's gradient, summed between the tower devices.

  Attributes:
    variable: the variable's handle op (its VarHandleOp).
    seen: what the gradient's users were given (a Tensor or IndexedSlices
      on tower 0's device).
    per_tower: per tower, the same gradient on the tower's device (tower
      0's is the tensor behind `seen`).
  """
  variable: tf.Operation
  seen: Any
  per_tower: List[Any]


@dataclasses.dataclass
class _Pending:
  variable: tf.Operation
  partials: List[Any]  # per tower: a Tensor, IndexedSlices or None
  placeholders: List[tf.Tensor]
  seen: Any


class _GradientSums:
  """Collects the terms of mirrored variables' gradients, then sums them."""

  def __init__(self, replication: _context.Replication) -> None:
    self._replication = replication
    self._pending: List[_Pending] = []
    self._towers = {
        _devices.device_key(device)[3:]: index
        for index, device in enumerate(replication.devices)
    }

  def _tower(self, term: Any) -> int:
    tensor = term.values if isinstance(term, tf.IndexedSlices) else term
    return self._towers.get(_devices.device_key(tensor.op.device)[3:], 0)

  def _eligible(self, op: tf.Operation) -> bool:
    replication = self._replication
    if op.type != "VarHandleOp" or op.graph is not replication.graph:
      return False
    if _devices.device_key(op.device) != _devices.device_key(
        replication.placed[0]):
      return False
    shape = tf.TensorShape(op.get_attr("shape"))
    return shape.is_fully_defined()

  def __call__(self, op: tf.Operation, terms: List[Any]) -> Optional[Any]:
    """The stand-in for `op`'s summed gradient, or None to leave it to TF."""
    terms = [t for t in terms if t is not None]
    if not terms or not self._eligible(op):
      return None
    if not all(isinstance(t, (tf.Tensor, tf.IndexedSlices)) for t in terms):
      return None
    replication = self._replication
    devices = replication.placed
    sparse = all(isinstance(t, tf.IndexedSlices) for t in terms)
    dtype = tf.as_dtype(op.get_attr("dtype"))
    shape = tf.TensorShape(op.get_attr("shape"))
    graph = replication.graph
    by_tower: Dict[int, List[Any]] = {}
    for term in terms:
      by_tower.setdefault(self._tower(term), []).append(term)
    partials: List[Any] = [None] * replication.num_towers
    with graph.control_dependencies(None), \
        graph.colocate_with(None, ignore_existing=True):
      if sparse:
        # Rows stay rows: each tower's in the order tf.gradients has them.
        partials = list(terms)
      else:
        for index, own in sorted(by_tower.items()):
          with tf.device(devices[index]):
            dense = [tf.convert_to_tensor(t) for t in own]
            partials[index] = dense[0] if len(dense) == 1 else tf.math.add_n(
                dense)
      with tf.device(devices[0]), tf.name_scope(op.name + "_all_reduced"):
        if sparse:
          values = tf.compat.v1.placeholder(
              dtype,
              tf.TensorShape([None]).concatenate(shape[1:]))
          indices = tf.compat.v1.placeholder(terms[0].indices.dtype, [None])
          seen: Any = tf.IndexedSlices(
              tf.identity(values), tf.identity(indices), terms[0].dense_shape)
          placeholders = [values, indices]
        else:
          value = tf.compat.v1.placeholder(dtype, shape)
          seen = tf.identity(value)
          placeholders = [value]
    self._pending.append(_Pending(op, partials, placeholders, seen))
    return seen

  def finish(self) -> None:
    """Builds the all-reduces and wires the stand-ins to tower 0's sums."""
    if not self._pending:
      return
    replication = self._replication
    # Inside the meeting, whose ops are the library's already.
    with _context.outside(replication, "all_reduce"):
      dense = [
          p for p in self._pending if not isinstance(p.seen, tf.IndexedSlices)
      ]
      for pack in _packs(dense):
        self._reduce(pack)
      for pending in self._pending:
        if isinstance(pending.seen, tf.IndexedSlices):
          self._gather(pending)
    logging.info(
        "replicate: %d gradients summed between %d tower devices (%d dense "
        "in packs of up to %d bytes, %d gathered as rows)", len(self._pending),
        replication.num_towers, len(dense), PACK_BYTES,
        len(self._pending) - len(dense))
    self._pending = []

  def _reduce(self, pack: List[_Pending]) -> None:
    replication = self._replication
    devices = replication.placed
    shapes = [
        tf.TensorShape(p.variable.get_attr("shape")).as_list() for p in pack
    ]
    sizes = [int(tf.TensorShape(s).num_elements()) for s in shapes]
    dtype = tf.as_dtype(pack[0].variable.get_attr("dtype"))
    flats = []
    for index, device in enumerate(devices):
      with tf.device(device):
        parts = [
            tf.zeros([size], dtype) if p.partials[index] is None else
            tf.reshape(p.partials[index], [-1]) for p, size in zip(pack, sizes)
        ]
        flats.append(parts[0] if len(parts) == 1 else tf.concat(parts, 0))
    summed = ring_all_reduce(flats, devices)
    per_tower: List[List[tf.Tensor]] = []
    for flat, device in zip(summed, devices):
      with tf.device(device):
        pieces = [flat] if len(pack) == 1 else tf.split(flat, sizes)
        per_tower.append(
            [tf.reshape(piece, shape) for piece, shape in zip(pieces, shapes)])
    for position, pending in enumerate(pack):
      tensors = [own[position] for own in per_tower]
      _tf.rewire(pending.placeholders[0], tensors[0])
      self._replication.mirrored_gradients.append(
          MirroredGradient(pending.variable, pending.seen, tensors))

  def _gather(self, pending: _Pending) -> None:
    terms = [t for t in pending.partials if t is not None]
    per_tower = []
    for device in self._replication.placed:
      with tf.device(device):
        values = tf.concat([t.values for t in terms], 0) if len(terms) > 1 \
            else tf.identity(terms[0].values)
        indices = tf.concat([t.indices for t in terms], 0) if len(terms) > 1 \
            else tf.identity(terms[0].indices)
      per_tower.append(
          tf.IndexedSlices(values, indices, pending.seen.dense_shape))
    _tf.rewire(pending.placeholders[0], per_tower[0].values)
    _tf.rewire(pending.placeholders[1], per_tower[0].indices)
    self._replication.mirrored_gradients.append(
        MirroredGradient(pending.variable, pending.seen, per_tower))


def _packs(pending: Sequence[_Pending]) -> List[List[_Pending]]:
  """Gradients in the order they were computed, in packs of one dtype each
  closed once it holds `PACK_BYTES`."""
  open_packs: Dict[Any, List[_Pending]] = {}
  packs: List[List[_Pending]] = []
  for item in pending:
    dtype = tf.as_dtype(item.variable.get_attr("dtype"))
    pack = open_packs.setdefault(dtype, [])
    pack.append(item)
    size = sum(
        tf.TensorShape(p.variable.get_attr("shape")).num_elements() * dtype.size
        for p in pack)
    if size >= PACK_BYTES:
      packs.append(pack)
      open_packs[dtype] = []
  packs.extend(pack for pack in open_packs.values() if pack)
  return packs


def ring_all_reduce(flats: Sequence[tf.Tensor],
                    devices: Sequence[str]) -> List[tf.Tensor]:
  """The sum of `flats` (one 1-D tensor per device) on every device.

  A reduce-scatter then an all-gather around the ring of `devices`: each
  device sends and receives 2(N-1)/N of a buffer's bytes. Chunk c is added
  up in ring order starting at device c, and the finished chunk is copied
  around: every device gets the same bits.
  """
  n = len(flats)
  if n == 1:
    return list(flats)
  length = int(flats[0].shape[0])
  sizes = [length // n + (1 if c < length % n else 0) for c in range(n)]
  chunks: List[List[tf.Tensor]] = []
  for flat, device in zip(flats, devices):
    with tf.device(device):
      chunks.append(list(tf.split(flat, sizes)))
  for step in range(n - 1):
    for source in range(n):
      chunk = (source - step) % n
      target = (source + 1) % n
      with tf.device(devices[target]):
        chunks[target][chunk] = chunks[source][chunk] + chunks[target][chunk]
  done: List[Dict[int, tf.Tensor]] = [{} for _ in range(n)]
  for chunk in range(n):
    owner = (chunk + n - 1) % n
    done[owner][chunk] = chunks[owner][chunk]
  for step in range(n - 1):
    for chunk in range(n):
      source = (chunk + n - 1 + step) % n
      target = (source + 1) % n
      with tf.device(devices[target]):
        done[target][chunk] = tf.identity(done[source][chunk])
  summed = []
  for own, device in zip(done, devices):
    with tf.device(device):
      summed.append(tf.concat([own[c] for c in range(n)], 0))
  return summed


@contextlib.contextmanager
def summed_between_towers(replication: _context.Replication) -> Iterator[None]:
  """Inside, gradients of mirrored variables are summed between the tower
  devices (nothing changes unless the replication is mirrored)."""
  if not replication.mirrored or replication.summing:
    yield
    return
  sums = _GradientSums(replication)
  replication.summing = True
  try:
    with GRADIENT_TERMS.applied(), _tf.gradient_terms_summed_by(sums):
      yield
    sums.finish()
  finally:
    replication.summing = False
