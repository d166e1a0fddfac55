"""The whole batch's values of the towers' batch reductions, by construction.

Every op that reduces over the batch's rows (`_batch.rows`: sums, means,
extrema, products, norms, a matmul contracting the rows, segment sums, ...)
gets, in every tower, the whole batch's value: each tower's partial (the same op
on the tower's rows; the tower's own op where it built one, a copy of tower 0's
where it did not) is combined once on the consolidation device, and every reader
of the op's output in every tower reads the combination. A mean combines the
partial sums and counts. What is computed from such values (ratios, scaled
terms, masked means, a loss, a metric's update) is then one device's in every
tower, whatever its algebraic form: nothing is recognised by pattern.

So are the other events `_batch.rows` reports: a shard's size read as a value
gets the whole batch's size, positions of the tower's rows read as values
the whole batch's positions (both built by `_meet.whole_counts`); an op that
mixes rows and cannot be split (`tf.py_func`) runs once on the towers'
rows concatenated; batch normalization's kernel in training normalises
with the whole batch's statistics (`_batch_norm.whole_batch`).

Tower 0 is built last; its ops are analysed as far as they exist whenever
a meeting needs the whole batch's values (`advance`), and once more after
the tower (`finish`). The other towers are analysed once, complete; their
events must have counterparts in tower 0's (towers building different
models are refused).
"""

import collections
import re
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from absl import logging
import tensorflow as tf

from replicate import _context
from replicate import _graph
from replicate import _tf
from replicate._batch import flow_rules
from replicate._batch import row_kinds
from replicate._batch import rows as _rows
from replicate._batch_norm import whole_batch
from replicate._meet import combining
from replicate._meet import whole_counts

_SUFFIX = re.compile(r"_\d+$")


def _normalized(relative: str) -> str:
  return "/".join(_SUFFIX.sub("", part) for part in relative.split("/"))


class _Index:
  """A tower's ops by (name without uniquifying suffixes, type), in order."""

  def __init__(self) -> None:
    self.groups: Dict[Tuple[str, str], List[tf.Operation]] = (
        collections.defaultdict(list))

  def add(self, op: tf.Operation, relative: str) -> None:
    self.groups[(_normalized(relative), op.type)].append(op)


class Rewiring:
  """Makes the towers' batch reductions the whole batch's (see above)."""

  def __init__(self, replication: _context.Replication) -> None:
    self._replication = replication
    self._analyses: Dict[int, _rows.TowerRows] = {}
    self._indexes: Dict[int, _Index] = {}
    self._taken: Dict[int, Set[Any]] = collections.defaultdict(set)
    self._ops: Dict[int, Dict[tf.Operation, tf.Operation]] = (
        collections.defaultdict(dict))
    self._tensors: Dict[int, Dict[Any, Any]] = collections.defaultdict(dict)
    self._handled: Dict[int, Set[Any]] = collections.defaultdict(set)
    self._counts = whole_counts.WholeCounts(replication, self.kind,
                                            self.counterpart, self._copy)
    # Other towers' tensors given a replacement: ref -> what readers read.
    self._substituted: Dict[Any, tf.Tensor] = {}
    self._done0 = 0
    self._started = False
    # Tower 0's tensors given the whole batch's value: ref -> (tensor, the
    # replacement, the combination's ops that keep reading the tensor).
    self._replaced: Dict[Any, Tuple[tf.Tensor, tf.Tensor, List[Any]]] = {}
    # Tower 0's calls writing model state that read the whole batch.
    self._in_place: Set[tf.Operation] = set()

  # ------------------------------------------------------------ analysis

  def kind(self, tensor: Any, index: int = 0) -> Any:
    """The kind (`_batch.row_kinds`) of tower `index`'s `tensor` so far."""
    analysis = self._analyses.get(index)
    return row_kinds.WHOLE if analysis is None else analysis.kind(tensor)

  def reads_whole_batch(self, op: tf.Operation) -> bool:
    """Whether tower 0's `op` was made to run on the whole batch's rows
    (a call writing model state, `_whole_batch_in_place`)."""
    return op in self._in_place

  def resolve(self, tensor: Any) -> Any:
    """What a tower's readers of `tensor` read where it was given the whole
    batch's value (or, run on the whole batch, the tower's rows of it).

    A batch reduction's output keeps its partial value; its readers read
    the whole batch's. Code holding the tensor itself (the loss a model_fn
    returns, hands to an optimizer or fetches in a hook; a tower's
    predictions) gets that here.
    """
    if not isinstance(tensor, tf.Tensor):
      return tensor
    found = self._replaced.get(tensor.ref())
    if found is not None:
      return found[1]
    return self._substituted.get(tensor.ref(), tensor)

  def _substitute(self, tensor: tf.Tensor, replacement: tf.Tensor) -> None:
    """A tower's `tensor` reads as `replacement` (see `substitute`)."""
    self._substituted[tensor.ref()] = substitute(tensor, replacement)[0]

  def replacements(self) -> Dict[str, tf.Tensor]:
    """Tensor name -> its whole batch's value, for every replaced tensor."""
    return {t.name: whole for t, whole, _ in self._replaced.values()}

  def _replace(self, tensor: tf.Tensor, replacement: tf.Tensor) -> None:
    """Tower 0's `tensor` reads, now and later, as `replacement`."""
    replacement, keep = substitute(tensor, replacement)
    self._replaced[tensor.ref()] = (tensor, replacement, keep)

  def declare(self, tensor: tf.Tensor, kind: Any, index: int = 0) -> None:
    """Records the kind of a meeting's result handed to tower `index`."""
    self._analysis(index).declare({tensor.ref(): kind})

  def pair(self, tensor0: tf.Tensor, index: int, tensor: tf.Tensor) -> None:
    """Records that tower `index`'s `tensor` is tower 0's `tensor0`'s."""
    self._tensors[index][tensor0.ref()] = tensor

  def _analysis(self, index: int) -> _rows.TowerRows:
    if index not in self._analyses:
      replication = self._replication
      declared = _rows.declared_inputs(replication.inputs[index] if index <
                                       len(replication.inputs) else ())
      if replication.meetings is not None:
        declared.update(replication.meetings.standin_kinds(index))
      self._analyses[index] = _rows.TowerRows(declared,
                                              replication.is_per_tower)
    return self._analyses[index]

  def _start(self) -> None:
    """Analyses the towers built before tower 0, and pairs their inputs."""
    self._started = True
    replication = self._replication
    inputs0 = tf.nest.flatten(replication.inputs[0], expand_composites=True)
    for index in range(1, replication.num_towers):
      analysis = self._analysis(index)
      ops = replication.model_ops(index)
      analysis.run(ops)
      index_ = _Index()
      prefix = replication.tower_prefix(index)
      own = f"tower_{index}"
      for op in ops:
        if op.name.startswith(prefix):
          # Keras layers built in a Keras model carry the scope they were
          # declared in too (dnn/tower_1/hiddenlayer_0/...), and a TensorFlow
          # op on Keras tensors becomes a layer named after the op
          # (tf_op_layer_tower_1/Relu).
          relative = "/".join(part for part in op.name[len(prefix):].replace(
              f"tf_op_layer_{own}/", "tf_op_layer_").split("/") if part != own)
          index_.add(op, relative)
      self._indexes[index] = index_
      flat = tf.nest.flatten(replication.inputs[index], expand_composites=True)
      for t0, t in zip(inputs0, flat):
        if t0 is not None and t is not None:
          self._tensors[index][t0.ref()] = t

  def advance(self) -> None:
    """Makes tower 0's reductions built so far the whole batch's."""
    replication = self._replication
    if not self._started:
      self._start()
    ops = replication.model_ops(0, since=self._done0)
    self._done0 = replication.graph.version
    if not ops:
      return
    new = set(ops)
    for tensor, replacement, _ in self._replaced.values():
      # The model's readers built since the tensor was replaced read the
      # replacement (the library's, a gradient of the op, keep its own).
      _tf.rewire(tensor, replacement,
                 [op for op in tensor.consumers() if op not in new])
    prefix = replication.tower_prefix(0)
    for op in ops:
      relative = op.name[len(prefix):] if op.name.startswith(prefix) else (
          op.name)
      self._match(op, relative)
    events = self._analysis(0).run(ops)
    with replication.library(), _context.outside(replication), \
        tf.device(replication.meeting_device):
      for event in events:
        self._handle(event)

  def finish(self, specs: Sequence[Any] = ()) -> None:
    """After tower 0: every event handled, every tower's matched, and the
    towers' models compared (see `_check_same_rows`)."""
    self.advance()
    if specs:
      self._check_same_rows()
    for index in range(1, self._replication.num_towers):
      for event in self._analyses[index].events:
        if event.op in self._handled[index] or not _has_readers(event.op):
          continue
        raise ValueError(
            f"Tower {index} built {event.op.type} op {event.op.name!r}, which "
            f"{_describe(event)}, but tower 0 built no such op; every tower "
            "must build the same model (a model_fn whose Python code builds "
            "a different model in each call cannot be replicated).")

  def _check_same_rows(self) -> None:
    """Every op of a tower computing rows has its counterpart in tower 0.

    A model_fn whose Python code builds a different model in each call (an
    extra layer in one tower) computes different rows in each tower: not
    one device's model. Tower 0 may build more (summaries of its own).
    """
    for index in range(1, self._replication.num_towers):
      analysis = self._analyses[index]
      taken = self._taken[index]
      for op in self._replication.model_ops(index):
        if op in taken or not any(
            isinstance(analysis.kind(t), row_kinds.Rows) and t.consumers()
            for t in op.outputs):
          continue
        raise ValueError(
            f"Towers 0 and {index} built different models: tower {index} "
            f"computes rows with {op.type} op {op.name!r}, which tower 0 has "
            "no counterpart of; every tower must build the same model (a "
            "model_fn whose Python code builds a different model in each "
            "call, e.g. an extra layer in one tower, cannot be replicated).")

  # ------------------------------------------------------------ matching

  def _match(self, op0: tf.Operation, relative: str) -> None:
    """Finds each tower's op for tower 0's `op0` (same name, type, order)."""
    key = (_normalized(relative), op0.type)
    for index in range(1, self._replication.num_towers):
      group = self._indexes[index].groups.get(key, ())
      taken = self._taken[index]
      for op in group:
        if op in taken:
          continue
        if self._inputs_agree(op0, op, index):
          taken.add(op)
          self._ops[index][op0] = op
          for t0, t in zip(op0.outputs, op.outputs):
            self._tensors[index].setdefault(t0.ref(), t)
          break

  def _inputs_agree(self, op0: tf.Operation, op: tf.Operation,
                    index: int) -> bool:
    if len(op0.inputs) != len(op.inputs):
      return False
    known = self._tensors[index]
    for t0, t in zip(op0.inputs, op.inputs):
      mapped = known.get(t0.ref())
      # Reading tower 0's own tensor (a variable shared after it was built,
      # `_towers.views`) agrees too.
      if mapped is not None and mapped is not t and t is not t0:
        return False
    return True

  def counterpart(self, tensor0: tf.Tensor, index: int) -> tf.Tensor:
    """Tower `index`'s tensor for tower 0's `tensor0` (copied if missing)."""
    if index == 0:
      return tensor0
    found = self._tensors[index].get(tensor0.ref())
    if found is not None:
      return found
    if row_kinds.shares_value(self.kind(tensor0)):
      return tensor0
    op0 = tensor0.op
    if op0.type in ("Placeholder", "VarHandleOp",
                    "VariableV2") or (not op0.inputs):
      raise ValueError(
          f"Tower {index} has no counterpart of tower 0's {tensor0.name}, "
          "which holds tower 0's rows; every tower must build the same "
          "model.")
    copy = self._copy(op0, [self.counterpart(t, index) for t in op0.inputs],
                      self._replication.placed[index])
    for t0, t in zip(op0.outputs, copy.outputs):
      self._tensors[index][t0.ref()] = t
    return copy.outputs[tensor0.value_index]

  def _copy(self,
            op: tf.Operation,
            inputs: Sequence[tf.Tensor],
            device: Optional[str],
            name: Optional[str] = None) -> tf.Operation:
    attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
    if "output_shapes" in attrs:
      # A call copied onto other rows: its outputs' sizes are not the
      # tower's it was built with.
      attrs["output_shapes"] = _tf.unknown_shapes_attr(
          op.get_attr("output_shapes"))
    with tf.device(device):
      copy = op.graph.create_op(
          op.type,
          list(inputs), [t.dtype for t in op.outputs],
          name=name or op.name.replace("/", "_") + "_part",
          attrs=attrs)
    _tf.copy_gradient_function(op, copy)
    return copy

  # ------------------------------------------------------------ events

  def _handle(self, event: row_kinds.Event) -> None:
    if isinstance(event, row_kinds.Reduction):
      self._reduction(event)
    elif isinstance(event, row_kinds.SizeUse):
      self._size_use(event)
    elif isinstance(event, row_kinds.PositionUse):
      self._position_use(event)
    elif isinstance(event, row_kinds.Mixing):
      self._mixing(event)
    elif isinstance(event, row_kinds.FusedNorm):
      self._fused_norm(event)

  def _towers_op(self, op0: tf.Operation, index: int) -> Optional[tf.Operation]:
    op = self._ops[index].get(op0)
    if op is not None:
      self._handled[index].add(op)
    return op

  def _reduction(self, event: row_kinds.Reduction) -> None:
    replication = self._replication
    op0 = event.op
    with tf.name_scope(_scope(op0, "whole_batch")):
      if event.combine == "mean":
        whole = self._mean(op0, event.axis)
      else:
        partials = []
        for index in range(replication.num_towers):
          own = self._towers_op(op0, index) if index else op0
          if own is not None and self._inputs_are_counterparts(op0, own, index):
            partials.append(own.outputs[0])
          else:
            partials.append(
                self._copy(op0,
                           [self.counterpart(t, index) for t in op0.inputs],
                           replication.placed[index]).outputs[0])
        whole = combining.combine(event.combine, partials, replication.validity,
                                  replication.trainers)
    self._rewire_everywhere(op0, 0, whole)
    logging.vlog(1, "replicate: %s (%s over rows) is the whole batch's",
                 op0.name, event.combine)

  def _inputs_are_counterparts(self, op0: tf.Operation, op: tf.Operation,
                               index: int) -> bool:
    return index == 0 or all(self._tensors[index].get(t0.ref(), t0) is t or
                             row_kinds.shares_value(self.kind(t0))
                             for t0, t in zip(op0.inputs, op.inputs))

  def _mean(self, op0: tf.Operation, axis: int) -> tf.Tensor:
    """Sum of the towers' partial sums over the sum of their counts."""
    replication = self._replication
    data0, axes = op0.inputs[0], op0.inputs[1]
    keep = op0.get_attr("keep_dims")
    dtype = data0.dtype
    compute = tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype
    sums, counts = [], []
    for index in range(replication.num_towers):
      data = self.counterpart(data0, index)
      with tf.device(replication.placed[index]):
        values = tf.cast(data, compute) if compute != dtype else data
        total = tf.reduce_sum(values, axes, keepdims=keep)
        count = tf.cast(tf.size(data, out_type=tf.int64), compute) / tf.cast(
            tf.maximum(tf.size(total, out_type=tf.int64), 1), compute)
      sums.append(total)
      counts.append(count)
    validity = replication.validity
    total = combining.combine("sum", sums, validity, replication.trainers)
    count = combining.combine("sum", counts, validity, replication.trainers)
    if compute.is_integer:
      whole = tf.math.truncatediv(total, count)
    else:
      whole = total / count
    return tf.cast(whole, dtype) if compute != dtype else whole

  def _rewire_everywhere(self, op0: tf.Operation, output_index: int,
                         whole: tf.Tensor) -> None:
    self._replace(op0.outputs[output_index], whole)
    for index in range(1, self._replication.num_towers):
      op = self._ops[index].get(op0)
      if op is not None:
        self._handled[index].add(op)
        self._substitute(op.outputs[output_index], whole)

  def _size_use(self, event: row_kinds.SizeUse) -> None:
    op0, position = event.op, event.index
    tensor0 = op0.inputs[position]
    whole = self._counts.size(tensor0)
    if op0.inputs[position] is not tensor0:
      return
    _tf.update_input(op0, position, whole)
    for index in range(1, self._replication.num_towers):
      op = self._towers_op(op0, index)
      if op is not None:
        _tf.update_input(op, position, whole)

  def _position_use(self, event: row_kinds.PositionUse) -> None:
    """Every tower's op reads its rows' positions in the whole batch."""
    self._within_trainer(event, "reads positions of rows in the batch")
    op0, position = event.op, event.index
    tensor0 = op0.inputs[position]
    wholes = [
        self._counts.positions(tensor0, index)
        for index in range(self._replication.num_towers)
    ]
    _tf.update_input(op0, position, wholes[0])
    self.declare(wholes[0], row_kinds.Rows(self.kind(tensor0).axis))
    for index in range(1, self._replication.num_towers):
      self._tensors[index][wholes[0].ref()] = wholes[index]
      op = self._towers_op(op0, index)
      if op is not None:
        _tf.update_input(op, position, wholes[index])

  def _within_trainer(self, event: row_kinds.Event, what: str) -> None:
    """Raises ValueError on a cluster of trainers only: the op would need
    the other trainers' rows, not only their sums."""
    if self._replication.trainers is None:
      return
    raise ValueError(
        f"{event.op.type} op {event.op.name!r} {what}: on a TF_CONFIG cluster "
        "of trainers only (no ps job) replicate combines the trainers' "
        "batch reductions (sums, counts, extrema), not their rows, so it "
        "cannot be the global batch's. Add a ps job to the cluster, or "
        "compute it from reductions (batch norm: fused=False).")

  def whole_size(self, tensor0: tf.Tensor) -> tf.Tensor:
    """The whole batch's value of tower 0's shard-size tensor `tensor0`."""
    return self._counts.size(tensor0)

  def _mixing(self, event: row_kinds.Mixing) -> None:
    """The op runs once, on every tower's rows concatenated in order."""
    self._within_trainer(event, "mixes the batch's rows")
    replication = self._replication
    op0 = event.op
    place: Optional[combining.Place]
    inputs, place, extent = [], None, None
    for tensor in op0.inputs:
      kind = self.kind(tensor)
      if isinstance(kind, row_kinds.Rows):
        parts = [
            self.counterpart(tensor, index)
            for index in range(replication.num_towers)
        ]
        whole, placing = combining.concatenated(replication, parts, kind.axis)
        if place is None:
          place = placing
          with tf.device(replication.meeting_device):
            extent = tf.shape(whole, out_type=tf.int64)[kind.axis]
        inputs.append(whole)
      elif isinstance(kind, row_kinds.Size):
        inputs.append(self._counts.size(tensor))
      elif row_kinds.shares_value(kind):
        inputs.append(tensor)
      elif _lists_rows(kind) and _list_source(tensor) is not None:
        rows, listed = self._whole_list(tensor)
        if listed is not None:
          if place is None:
            place = listed
            with tf.device(replication.meeting_device):
              extent = tf.shape(rows, out_type=tf.int64)[0]
          rows = self._list_of(tensor, rows)
        inputs.append(rows)
      else:
        raise ValueError(
            f"{op0.type} op {op0.name!r} mixes the batch's rows (it runs "
            "once on the whole batch) but reads a value of each tower's own "
            f"({tensor.name}: {kind}); compute it from the batch's rows, or "
            "run the model_fn unreplicated.")
    if _writes_state(op0) and not any(
        isinstance(k, row_kinds.Rows) for k in event.kinds):
      self._whole_batch_in_place(op0, inputs)
      return
    once = self._copy(
        op0,
        inputs,
        replication.meeting_device,
        name=op0.name.replace("/", "_") + "_whole_batch")
    for position, (output, kind) in enumerate(zip(once.outputs, event.kinds)):
      if event.guessed and extent is not None and output.dtype != tf.variant:
        output = _guess_checked(op0, position, output, kind, extent)
      # A loop's list of rows comes out where it went in.
      carried = op0.type in ("While", "StatelessWhile") and _lists_rows(
          self.kind(op0.inputs[position]))
      source = _list_source(op0.inputs[position]) if carried else None
      if place is not None and source is not None:
        self._place_list(op0, position, output, source, place)
      elif isinstance(kind, row_kinds.Rows) and place is not None:
        rows = place(output, kind.axis)
        original = op0.outputs[position]
        self._replace(original, rows[0])
        # What tower 0's readers read now holds its rows; each tower's
        # counterpart of it is its rows.
        read = self._replaced[original.ref()][1]
        self.declare(read, kind)
        for index in range(1, replication.num_towers):
          op = self._towers_op(op0, index)
          if op is not None:
            self._substitute(op.outputs[position], rows[index])
          self._tensors[index][original.ref()] = rows[index]
          self._tensors[index][read.ref()] = rows[index]
      else:
        self._rewire_everywhere(op0, position, output)
    logging.info("replicate: %s (%s) runs once on the whole batch", op0.name,
                 op0.type)

  def _whole_list(
      self, tensor0: tf.Tensor) -> Tuple[tf.Tensor, Optional[combining.Place]]:
    """The whole batch's version of tower 0's list of its rows (a loop's
    elements or its accumulator, `_list_source`): for a list made from the
    rows, the rows concatenated (and how to hand them back); for one
    reserved for as many elements as rows, the list for the whole batch."""
    replication = self._replication
    maker = _graph.look_through(tensor0).op
    if maker.type == "TensorListSetItem":
      # An element set before the loop (a scan's initial value): the whole
      # batch's list with that element set.
      base, place = self._whole_list(maker.inputs[0])
      if place is not None:
        base = self._list_of(maker.inputs[0], base)
      if not row_kinds.shares_value(self.kind(maker.inputs[2])):
        raise ValueError(
            f"{maker.name!r} sets an element of a list of the rows to a value "
            f"of each tower's own ({maker.inputs[2].name}); compute it from "
            "the batch's rows, or run the model_fn unreplicated.")
      with tf.device(replication.meeting_device):
        return tf.raw_ops.TensorListSetItem(
            input_handle=base, index=maker.inputs[1],
            item=maker.inputs[2]), None
    if maker.type == "TensorListFromTensor":
      parts = [
          self.counterpart(maker.inputs[0], index)
          for index in range(replication.num_towers)
      ]
      whole, place = combining.concatenated(replication, parts, 0)
      return whole, place
    with tf.device(replication.meeting_device):
      return tf.raw_ops.TensorListReserve(
          element_shape=maker.inputs[0],
          num_elements=tf.cast(self._counts.size(maker.inputs[1]), tf.int32),
          element_dtype=maker.get_attr("element_dtype")), None

  def _list_of(self, tensor0: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
    """A list of `rows`, made as tower 0's list of its rows was made."""
    maker = _list_source(tensor0)
    assert maker is not None
    with tf.device(self._replication.meeting_device):
      return tf.raw_ops.TensorListFromTensor(
          tensor=rows, element_shape=maker.inputs[1])

  def _place_list(self, op0: tf.Operation, position: int, output: tf.Tensor,
                  maker: tf.Operation, place: combining.Place) -> None:
    """Each tower's readers of a loop's list of rows (`op0`'s output
    `position`, run once on the whole batch) read a list of its own rows."""
    element_shape = maker.inputs[1] if maker.type == (
        "TensorListFromTensor") else maker.inputs[0]
    with tf.device(self._replication.meeting_device):
      stacked = tf.raw_ops.TensorListStack(
          input_handle=output,
          element_shape=element_shape,
          element_dtype=maker.get_attr("element_dtype"))
    for index, rows in enumerate(place(stacked, 0)):
      with tf.device(self._replication.placed[index]):
        listed = tf.raw_ops.TensorListFromTensor(
            tensor=rows, element_shape=element_shape)
      if index == 0:
        self._replace(op0.outputs[position], listed)
        continue
      op = self._towers_op(op0, index)
      if op is not None:
        self._substitute(op.outputs[position], listed)
      self._tensors[index][op0.outputs[position].ref()] = listed

  def _whole_batch_in_place(self, op0: tf.Operation,
                            inputs: Sequence[tf.Tensor]) -> None:
    """A call writing model state (a Keras metric's `update_state`) runs
    once, as tower 0's op reading the whole batch: the op the spec names
    writes once per step, as on one device. The other towers' calls are
    left unread (no step runs them); their readers read tower 0's. Where
    tower 0 holds the batch's only rows (the others are on phantom rows),
    its inputs are the whole batch's as they stand."""
    self._in_place.add(op0)
    for position, (tensor, whole) in enumerate(zip(op0.inputs, inputs)):
      if whole is not tensor:
        _tf.update_input(op0, position, whole)
    for index in range(1, self._replication.num_towers):
      op = self._towers_op(op0, index)
      if op is not None:
        for own, output in zip(op.outputs, op0.outputs):
          self._substitute(own, output)
    logging.info(
        "replicate: %s (%s) writes model state: it runs once, on the whole "
        "batch", op0.name, op0.type)

  def _fused_norm(self, event: row_kinds.FusedNorm) -> None:
    self._within_trainer(event, "is a fused batch norm in training")
    replication = self._replication
    op0 = event.op
    ops = [op0] + [
        self._towers_op(op0, index)
        for index in range(1, replication.num_towers)
    ]
    inputs = [
        self.counterpart(op0.inputs[0], index)
        for index in range(replication.num_towers)
    ]
    rows, statistics = whole_batch.whole_batch(replication, op0, inputs)
    for index, (op, tower_rows) in enumerate(zip(ops, rows)):
      if op is None:
        self._tensors[index][op0.outputs[0].ref()] = tower_rows
        continue
      if index == 0:
        self._replace(op.outputs[0], tower_rows)
        for position, value in enumerate(statistics, start=1):
          self._replace(op.outputs[position], value)
      else:
        self._substitute(op.outputs[0], tower_rows)
        for position, value in enumerate(statistics, start=1):
          self._substitute(op.outputs[position], value)
      self._tensors[index][op0.outputs[0].ref()] = tower_rows
    for index, (relu, tower_relu) in whole_batch.relu_once(replication, rows):
      if index == 0:
        self._replace(relu.outputs[0], tower_relu)
      else:
        self._substitute(relu.outputs[0], tower_relu)


def _lists_rows(kind: row_kinds.Kind) -> bool:
  return isinstance(kind,
                    row_kinds.Listed) and kind.axis == row_kinds.ROWS_LISTED


def _list_source(tensor: tf.Tensor) -> Optional[tf.Operation]:
  """The op that made the list of rows `tensor` (through copies and
  elements set): one from the rows (`TensorListFromTensor`) or reserved for
  as many elements as the rows (`TensorListReserve`), or None."""
  op = _graph.look_through(tensor).op
  while op.type == "TensorListSetItem":
    op = _graph.look_through(op.inputs[0]).op
  if op.type in ("TensorListFromTensor", "TensorListReserve"):
    return op
  return None


def _writes_state(op: tf.Operation) -> bool:
  """Whether function call `op` may write a resource it reads (an input
  TensorFlow does not mark read-only: a variable its body assigns)."""
  try:
    read_only = set(op.get_attr("_read_only_resource_inputs"))
  except ValueError:
    return False
  return any(t.dtype == tf.resource and i not in read_only
             for i, t in enumerate(op.inputs))


def _guess_checked(op0: tf.Operation, position: int, output: tf.Tensor,
                   kind: row_kinds.Kind, rows: tf.Tensor) -> tf.Tensor:
  """`output` of an op with no rule, run once on the whole batch of `rows`
  rows, once the run has checked the kind its shape suggested: a row per
  example where it is handed back as rows; where it is taken whole (its
  rank unknown), no row per example on its first axis."""
  shape = tf.concat([tf.shape(output, out_type=tf.int64), [-1]], 0)
  fix = ("give the output a static shape that says which it is "
         "(Tensor.set_shape or tf.ensure_shape), or, if the op computes each "
         "row from the same row, add its type to the graph collection "
         f"{flow_rules.PER_ROW_COLLECTION!r}")
  if isinstance(kind, row_kinds.Rows):
    ok = tf.equal(shape[kind.axis], rows)
    what = (f"took it to hold a row per example on axis {kind.axis}, as its "
            "shape suggests, but it holds another number")
  else:
    ok = tf.logical_not(
        tf.logical_and(tf.greater(rows, 1), tf.equal(shape[0], rows)))
    what = ("took it to be one value, its rank being unknown, but it holds "
            "a row per example")
  message = (f"replicate ran {op0.type} op {op0.name!r} once on the whole "
             f"batch (no rule says how it treats rows) and {what} of its "
             f"output {position} (extents, rows):")
  check = tf.debugging.Assert(ok, [message, shape, rows, "Fix:", fix])
  with tf.control_dependencies([check]):
    return tf.identity(output)


def substitute(tensor: tf.Tensor,
               replacement: tf.Tensor) -> Tuple[tf.Tensor, List[tf.Operation]]:
  """Every reader of `tensor` reads `replacement`; returns (what they read,
  the ops of the combination that keep reading `tensor`).

  The op that made `tensor` may have waited for something (the model_fn's
  control dependencies: a check, an update); its readers still do.
  """
  op = tensor.op
  if op.control_inputs:
    with tf.device(op.device), tf.control_dependencies(op.control_inputs):
      replacement = tf.identity(replacement, name=op.name + "_whole_batch_read")
  keep = _readers_within(replacement)
  _tf.rewire(tensor, replacement, keep)
  return replacement, keep


def _has_readers(op: tf.Operation) -> bool:
  return any(t.consumers() for t in op.outputs)


def _describe(event: row_kinds.Event) -> str:
  if isinstance(event, row_kinds.Reduction):
    return "reduces over the batch's rows"
  if isinstance(event, row_kinds.SizeUse):
    return "reads the batch's size"
  if isinstance(event, row_kinds.Mixing):
    return "mixes the batch's rows"
  return "normalises over the batch's rows"


def _scope(op: tf.Operation, what: str) -> str:
  return f"{op.name}_{what}/"


def _readers_within(tensor: tf.Tensor) -> List[tf.Operation]:
  """The ops computing `tensor` that read the tensors being replaced.

  The combination reads the partials (which may be the very outputs being
  rewired): those reads stay. Found as `tensor`'s ancestors within the
  combination (ops built by `_meet.combining.combine`, a few levels).
  """

  def within(op: tf.Operation) -> List[tf.Operation]:
    if "whole_batch" in op.name or op.name.endswith("_part"):
      return _graph.input_ops(op)
    return []

  return list(_graph.walk([tensor.op], within, limit=4096))
