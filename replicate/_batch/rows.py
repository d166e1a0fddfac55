"""Which tensors of a tower hold the tower's rows of the batch.

Each tower computes on its shard of the batch. Every tensor it builds is one
of these kinds:

- `WHOLE`: the same in every tower and equal to one device's value (a
  variable's value, a constant, a meeting's result, a batch reduction once
  it is rewired to the whole batch's value);
- `Rows(axis)`: the tower's part of one device's tensor, cut along `axis`
  (the inputs along axis 0, what per-row ops compute from them);
- `Size`: an integer computed from the shard's size (`tf.shape(x)[0]`): as
  an operand that shapes rows (a reshape, a fill) it is the tower's own,
  as a value (a mean's denominator) it must be the whole batch's;
- `SHARD`: a per-tower statistic the user asked for
  (`sync_batch_norm=False`): rows normalised with it stay rows;
- `Local`: a per-tower value that is none of these (a row picked by its
  position, rows mixed by an op that cannot be split): fine inside the
  tower, wrong wherever one device's value is needed;
- `Listed(axis)`: a TensorList (a loop's accumulator) of elements with rows
  on `axis`.

`TowerRows` finds the kinds by following the tower's ops in creation order
from its inputs, and records the events the replication must act on: batch
reductions (an op reducing rows to a value: `Reduction`), sizes used as
values (`SizeUse`), ops that mix rows and run once on the whole batch
(`Mixing`), batch normalization kernels in training (`FusedNorm`). Function
bodies (`tf.cond`, `tf.while_loop`, `tf.function`) are followed too; a
reduction inside one cannot be rewired and makes its outputs `Local`.
"""

from typing import (Any, Callable, Dict, FrozenSet, Iterable, List, NamedTuple,
                    Optional, Sequence, Tuple, Union)

import numpy as np
import tensorflow as tf
from absl import logging

from replicate import _tf
from replicate import _graph


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
  axis: int          # the rows axis of the reduced input


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


# ---------------------------------------------------------------- op tables

_REDUCTIONS = {"Sum": "sum", "Mean": "mean", "Max": "max", "Min": "min",
               "Prod": "prod", "All": "all", "Any": "any",
               "EuclideanNorm": "norm"}
_SEGMENT_REDUCTIONS = {"UnsortedSegmentSum": "sum",
                       "UnsortedSegmentMax": "max",
                       "UnsortedSegmentMin": "min",
                       "UnsortedSegmentProd": "prod"}

# Ops computing each output element from the inputs' elements at the same
# (broadcast) position.
_ELEMENTWISE = frozenset("""
Abs Acos Acosh Add AddN AddV2 Angle ApproximateEqual Asin Asinh Atan Atan2
Atanh BesselI0e BesselI1e Betainc BitwiseAnd BitwiseOr BitwiseXor Cast Ceil
CheckNumerics CheckNumericsV2 ClipByValue Complex ComplexAbs Conj Cos Cosh
DebugIdentity DebugIdentityV2 Digamma Div DivNoNan Elu Equal Erf Erfc Erfinv
Exp Expm1 Floor FloorDiv FloorMod Gelu Greater GreaterEqual Identity
Igamma Igammac Imag Inv Invert IsFinite IsInf IsNan LeakyRelu Less LessEqual
Lgamma Log Log1p LogicalAnd LogicalNot LogicalOr Maximum Minimum Mod Mul
MulNoNan Ndtri Neg NextAfter NotEqual OnesLike Polygamma Pow
PreventGradient Real RealDiv Reciprocal Relu Relu6 Rint Round Rsqrt Select
SelectV2 Selu Sigmoid Sign Sin Sinh Snapshot Softplus Softsign Sqrt Square
SquaredDifference StopGradient Sub Tan Tanh TruncateDiv TruncateMod Xdivy
Xlog1py Xlogy Zeta ZerosLike EnsureShape LeftShift RightShift
StringToHashBucketFast StringToHashBucketStrong StringToHashBucket
StringToNumber AsString StringLength Substr RegexReplace StaticRegexReplace
StringLower StringUpper StringStrip RegexFullMatch StaticRegexFullMatch
Bitcast BiasAdd BiasAddV1 LookupTableFindV2 LookupTableFind
""".split())

# Ops whose outputs keep the first input's rows on axis 0, each row computed
# from the same row (convolutions, pooling, per-example losses, ...).
_PER_ROW = frozenset("""
Conv2D Conv3D DepthwiseConv2dNative Conv2DBackpropInput Conv3DBackpropInputV2
MaxPool MaxPoolV2 AvgPool MaxPool3D AvgPool3D MaxPoolWithArgmax LRN
FractionalMaxPool FractionalAvgPool Dilation2D ResizeBilinear
ResizeNearestNeighbor ResizeBicubic ResizeArea ScaleAndTranslate
SparseSoftmaxCrossEntropyWithLogits SoftmaxCrossEntropyWithLogits
InTopK InTopKV2 MatrixDiagPart MatrixDiagPartV2 MatrixDiagPartV3 MatrixDiag
MatrixDiagV2 MatrixDiagV3 MatrixBandPart MatrixInverse Cholesky
MatrixDeterminant LogMatrixDeterminant MatrixSetDiag MatrixSetDiagV2
MatrixSetDiagV3 MatrixTriangularSolve MatrixSolve Qr Svd SelfAdjointEigV2
SpaceToBatchND BatchToSpaceND SpaceToDepth DepthToSpace ExtractImagePatches
Multinomial StatelessMultinomial AdjustContrastv2 AdjustHue AdjustSaturation
RGBToHSV HSVToRGB DecodeJpeg DecodePng DecodeImage EncodeJpeg
CropAndResize NonMaxSuppressionV3 ImageProjectiveTransformV3 QuantizeV2
FakeQuantWithMinMaxArgs FakeQuantWithMinMaxVars
""".split())

# Ops that only pass values through (each output like the same input).
_PASS_THROUGH = frozenset([
    "Identity", "IdentityN", "StopGradient", "PreventGradient", "Snapshot",
    "CheckNumerics", "CheckNumericsV2", "EnsureShape", "DebugIdentity",
    "Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
    "RefNextIteration", "RefIdentity", "Print"])

# Ops whose outputs say nothing a later op computes with.
_SINKS = frozenset([
    "NoOp", "Assert", "PrintV2", "MergeSummary", "StringFormat",
    "WriteScalarSummary", "WriteHistogramSummary", "WriteImageSummary",
    "WriteSummary", "WriteAudioSummary", "WriteRawProtoSummary"])

# Summaries of a value (TensorBoard's tf.compat.v1.summary.*).
_SUMMARIES = frozenset([
    "ScalarSummary", "HistogramSummary", "ImageSummary", "AudioSummary",
    "AudioSummaryV2", "TensorSummary", "TensorSummaryV2"])

# Ops that run Python on their inputs: rows mixed in ways nobody can split.
_PY_FUNCS = frozenset(["PyFunc", "PyFuncStateless", "EagerPyFunc"])

_FUSED_NORMS = frozenset(["FusedBatchNorm", "FusedBatchNormV2",
                          "FusedBatchNormV3"])

_RANDOM_FROM_SHAPE = frozenset([
    "RandomUniform", "RandomStandardNormal", "TruncatedNormal",
    "RandomUniformInt", "StatelessRandomUniform", "StatelessRandomNormal",
    "StatelessTruncatedNormal", "StatelessRandomUniformInt",
    "StatelessRandomUniformV2", "StatelessRandomNormalV2",
    "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
    "StatelessRandomUniformFullIntV2", "RandomGammaGrad", "Empty"])

# Integer ops through which a shard size stays a size (each entry a
# function of the sizes); anything else reading a size reads its value.
_SIZE_OPS = frozenset([
    "StridedSlice", "Slice", "Pack", "ConcatV2", "Concat", "Gather",
    "GatherV2", "Identity", "Cast", "Mul", "AddV2", "Add", "Sub", "FloorDiv",
    "FloorMod", "TruncateDiv", "Div", "Maximum", "Minimum", "Prod", "Sum",
    "Reshape", "ExpandDims", "Squeeze", "BroadcastArgs", "Neg", "Abs",
    "Unpack", "Max", "Min", "Range"])

# (op type, input index): inputs that give an op's output its shape; a size
# read there is the tower's own (its rows), not a value.
_SHAPE_ROLES = {
    "Reshape": (1,), "Fill": (0,), "Tile": (1,), "BroadcastTo": (1,),
    "Slice": (1, 2), "StridedSlice": (1, 2, 3), "Range": (0, 1, 2),
    "Pad": (1,), "PadV2": (1,), "MirrorPad": (1,), "OneHot": (1,),
    "UnsortedSegmentSum": (2,), "UnsortedSegmentMax": (2,),
    "UnsortedSegmentMin": (2,), "UnsortedSegmentProd": (2,),
    "ScatterNd": (2,), "SparseToDense": (1,), "SparseReshape": (1, 2),
    "SparseSlice": (2, 3, 4), "SparseFillEmptyRows": (2,),
    "SparseTensorDenseMatMul": (2,), "SparseReduceSum": (2,),
    "SparseReduceMax": (2,), "SparseSegmentSumWithNumSegments": (3,),
    "SparseSegmentMeanWithNumSegments": (3,),
    "SparseSegmentSqrtNWithNumSegments": (3,), "TensorListReserve": (0, 1),
    "TensorListFromTensor": (1,), "TensorListStack": (1,),
    "TensorListGetItem": (2,), "TensorListConcatV2": (1, 2),
    "TensorArrayV3": (0,), "ResizeBilinear": (1,),
    "ResizeNearestNeighbor": (1,), "ResizeBicubic": (1,), "ResizeArea": (1,),
    "Conv2DBackpropInput": (0,), "Conv2DBackpropFilter": (1,),
    "Conv3DBackpropInputV2": (0,), "RaggedTensorToTensor": (0,),
    "SplitV": (1,), "SparseSlice_": (), "BroadcastArgs": (0, 1),
    "BroadcastGradientArgs": (0, 1), "Bincount": (1,), "DenseBincount": (1,),
    "TensorScatterUpdate": (), "SparseAdd": (2, 5),
    "SparseDenseCwiseMul": (2,), "SparseDenseCwiseAdd": (2,),
    "SparseDenseCwiseDiv": (2,), "SparseSoftmax": (2,),
    "SparseSegmentSum": (), "SequenceMask": (1,), "Empty": (0,),
    "TensorListSetItem": (), "RandomShuffle": (),
}
for _type in _RANDOM_FROM_SHAPE:
  _SHAPE_ROLES.setdefault(_type, (0,))
del _type


# Ops a small integer vector built from constants may go through.
_FOLDABLE = frozenset([
    "Const", "Identity", "Tile", "ConcatV2", "Concat", "Pack", "Squeeze",
    "ExpandDims", "Reshape", "Cast", "Fill", "Range", "AddV2", "Add", "Sub",
    "Mul", "StridedSlice", "Slice", "Neg", "Maximum", "Minimum", "Prod",
    "Sum", "ZerosLike", "OnesLike"])


def _folded_ints(tensor, limit: int = 32) -> Optional[List[int]]:
  """An int vector computed from constants alone, evaluated; else None.

  `tf.get_static_value` folds a few ops only (not Tile or Squeeze, which
  MultiHead's logits slices are built with).
  """
  if not tensor.dtype.is_integer or tensor.shape.rank not in (0, 1):
    return None
  ops = {}
  for op in _graph.walk([tensor.op], _graph.input_ops):
    if op.type not in _FOLDABLE or len(ops) >= limit or op.control_inputs:
      return None
    ops[op.name] = op
  graph_def = tf.compat.v1.GraphDef()
  for op in sorted(ops.values(), key=lambda o: o.name):
    node = graph_def.node.add()
    node.CopyFrom(op.node_def)
    node.ClearField("device")
  with tf.Graph().as_default() as graph:
    tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
      value = session.run(graph.get_tensor_by_name(tensor.name))
  return [int(v) for v in np.reshape(value, [-1])]


def _partial_ints(tensor, depth: int = 0) -> Optional[List[Optional[int]]]:
  """The entries of an int vector known when built (None: not known).

  Follows constants, stacks, concatenations and slices of a static shape,
  as a new shape is usually written (`[v, -1]` joined to `tf.shape(x)[1:]`).
  """
  values = _static_ints(tensor)
  if values is not None:
    return values
  op = tensor.op
  if depth > 8 or tensor.shape.rank != 1:
    return None
  if op.type in ("Tile", "Squeeze", "Reshape", "ExpandDims"):
    values = _folded_ints(tensor)
    if values is not None:
      return values
  length = tensor.shape.num_elements()
  if op.type in ("ZerosLike", "OnesLike") and length is not None:
    return [0 if op.type == "ZerosLike" else 1] * length
  if op.type in ("Mul", "AddV2", "Add", "Sub") and length is not None:
    parts = []
    for part in op.inputs:
      found = (_static_ints(part) if part.shape.rank == 0 else
               _partial_ints(part, depth + 1))
      if found is None:
        return None
      parts.append(found * length if len(found) == 1 else found)
    apply = {"Mul": lambda a, b: a * b, "Sub": lambda a, b: a - b}.get(
        op.type, lambda a, b: a + b)
    return [None if a is None or b is None else apply(a, b)
            for a, b in zip(*parts)]
  if op.type == "Pack":
    return [(_static_ints(t) or [None])[0] for t in op.inputs]
  if op.type in ("ConcatV2", "Concat"):
    parts = op.inputs[:-1] if op.type == "ConcatV2" else op.inputs[1:]
    entries = []
    for part in parts:
      found = _partial_ints(part, depth + 1)
      if found is None:
        length = part.shape.num_elements()
        if length is None:
          return None
        found = [None] * length
      entries.extend(found)
    return entries
  length = tensor.shape.num_elements()
  return None if length is None else [None] * length


def _static_ints(tensor) -> Optional[List[int]]:
  value = tf.get_static_value(tensor)
  if value is None:
    return None
  return [int(v) for v in np.reshape(value, [-1])]


def _rank(tensor) -> Optional[int]:
  return tensor.shape.rank


def _axis_in(axis: int, rank: Optional[int]) -> Optional[int]:
  """`axis` as a non-negative index, or None where the rank is unknown."""
  if axis >= 0:
    return axis
  return None if rank is None else axis % rank


# How a run of the transfer functions treats what needs every tower.
TOWER = "tower"   # the tower's own ops: report events, to be rewired
BODY = "body"     # a function body run per tower: such ops are not allowed
WHOLE_BATCH = "whole batch"  # a body run once on the whole batch: fine


class _Context:
  """What one run of the transfer functions reports and knows."""

  def __init__(self, mode: str, per_tower: Callable[[tf.Operation], bool]):
    self.mode = mode
    self.per_tower = per_tower
    self.events: List[Event] = []
    # Inside a BODY: the first op needing every tower, if any.
    self.needs_towers: Optional[tf.Operation] = None

  @property
  def in_function(self) -> bool:
    return self.mode != TOWER

  def needs_every_tower(self, op, event: Optional[Event], kind: Kind,
                        why: str) -> Kind:
    """An op needing every tower's rows: an event, or in a body a mark."""
    if self.mode == TOWER:
      if event is not None:
        self.events.append(event)
      return kind
    if self.mode == WHOLE_BATCH:
      return kind
    if self.needs_towers is None:
      self.needs_towers = op
    return Local(op.name, why + " inside a tf.cond, tf.while_loop or "
                 "tf.function body run per tower")

  def reduce(self, op, combine: str, axis: int) -> Kind:
    """A batch reduction: the whole batch's value once rewired."""
    if self.per_tower(op):
      return SHARD
    return self.needs_every_tower(op, Reduction(op, combine, axis), WHOLE,
                                  "reduces rows")

  def value_of_size(self, op, index: int) -> Kind:
    return self.needs_every_tower(op, SizeUse(op, index), WHOLE,
                                  "reads the shard's size")

  def function_kinds(self, op, kinds) -> Optional[List[Kind]]:
    """A call's output kinds; a body needing every tower runs once."""
    if self.mode == WHOLE_BATCH:
      found = function_kinds(op, kinds, self.per_tower, WHOLE_BATCH)
      return None if found is None else found[0]
    found = function_kinds(op, kinds, self.per_tower, BODY)
    if found is None:
      return None
    outputs, inner = found
    if inner is None:
      return outputs
    if self.mode == BODY:
      if self.needs_towers is None:
        self.needs_towers = inner
      return outputs
    local = _any_local(kinds)
    if local:
      return [local] * len(op.outputs)
    static = [t.name for t, k in zip(op.inputs, kinds) if isinstance(k, Rows)
              and t.shape.rank is not None and t.shape[k.axis] is not None]
    if static:
      # Its bodies were traced for the tower's shard size: they cannot
      # run on the whole batch.
      return [Local(op.name, f"has {inner.type} op {inner.name!r} in its "
                    "body, which needs every tower's rows; replicate runs "
                    "such a call once on the whole batch, but this one was "
                    f"built for the shard's static size ({static[0]}): "
                    "compute it outside the tf.cond / tf.while_loop / "
                    "tf.function (e.g. give Keras layers a Python bool "
                    "`training`), or batch without drop_remainder")
              for _ in op.outputs]
    whole = function_kinds(op, kinds, self.per_tower, WHOLE_BATCH)[0]
    if any(is_local(k) for k in whole):
      return whole
    self.events.append(Mixing(op, tuple(whole)))
    logging.vlog(1, "replicate: %s runs once on the whole batch (%s %s)",
                 op.name, inner.type, inner.name)
    return whole


def _join(kinds: Sequence[Kind]) -> Kind:
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
    return Size(scalar=all(k.scalar for k in distinct
                           if isinstance(k, Size)))
  return Local("", f"is one of {distinct} by a condition")


def _elementwise(op, kinds: Sequence[Kind]) -> Kind:
  """The output kind of a broadcasting elementwise op."""
  out_rank = _rank(op.outputs[0]) if op.outputs else None
  axes, shard = set(), False
  for tensor, kind in zip(op.inputs, kinds):
    if is_local(kind):
      return kind
    if kind is SHARD:
      shard = True
    if isinstance(kind, Rows):
      in_rank = _rank(tensor)
      if out_rank is not None and in_rank is not None:
        axes.add(out_rank - in_rank + kind.axis)
      else:
        axes.add(kind.axis)
  if len(axes) > 1:
    return Local(op.name, f"combines rows cut along axes {sorted(axes)}")
  if axes:
    return Rows(axes.pop())
  return SHARD if shard else WHOLE


def _first_rows(kinds) -> Optional[Rows]:
  for kind in kinds:
    if isinstance(kind, Rows):
      return kind
  return None


def _any_local(kinds) -> Optional[Local]:
  for kind in kinds:
    if is_local(kind):
      return kind
  return None


def _same_for_outputs(op, kind) -> List[Kind]:
  return [kind] * len(op.outputs)


# ------------------------------------------------------- transfer functions

def _reduction(op, kinds, ctx):
  data, axes = op.inputs[0], op.inputs[1]
  kind = kinds[0]
  if is_local(kind) or kind is SHARD:
    return [kind]
  if not isinstance(kind, Rows):
    return [WHOLE]
  rank = _rank(data)
  values = _static_ints(axes)
  keep = op.get_attr("keep_dims")
  if values is None:
    # Axes computed at run time (all of them for an unknown rank).
    return [ctx.reduce(op, _REDUCTIONS[op.type], kind.axis)]
  reduced = {_axis_in(a, rank) for a in values}
  if None in reduced:
    reduced = set(values)
  if kind.axis in reduced:
    return [ctx.reduce(op, _REDUCTIONS[op.type], kind.axis)]
  if keep:
    return [kind]
  return [Rows(kind.axis - sum(1 for a in reduced if a < kind.axis))]


def _arg_reduction(op, kinds, ctx):
  kind = kinds[0]
  if not isinstance(kind, Rows):
    return [kind if is_local(kind) or kind is SHARD else WHOLE]
  axis = _static_ints(op.inputs[1])
  if axis is None or _axis_in(axis[0], _rank(op.inputs[0])) == kind.axis:
    return [Local(op.name, "takes the position of an extremum over rows")]
  return [Rows(kind.axis - (1 if axis[0] % (_rank(op.inputs[0]) or 1)
                            < kind.axis else 0))]


def _segment_reduction(op, kinds, ctx):
  data, ids, count = kinds[0], kinds[1], kinds[2]
  if isinstance(count, Size):
    return [Rows(0)]  # one segment per row
  local = _any_local([data, ids])
  if local:
    return [local]
  if isinstance(data, Rows) and data.axis == 0 or isinstance(ids, Rows):
    return [ctx.reduce(op, _SEGMENT_REDUCTIONS[op.type], 0)]
  if isinstance(data, Rows):
    return [Rows(data.axis)]
  return [SHARD if SHARD in (data, ids) else WHOLE]


def _sorted_segment(op, kinds, ctx):
  if any(k is not WHOLE for k in kinds[:2]):
    local = _any_local(kinds)
    return [local or Rows(0)]
  return [WHOLE]


def _matmul(op, kinds, ctx):
  a, b = kinds[0], kinds[1]
  local = _any_local([a, b])
  if local:
    return [local]
  ta = op.get_attr("transpose_a")
  tb = op.get_attr("transpose_b")
  a_rows = a.axis if isinstance(a, Rows) else None
  b_rows = b.axis if isinstance(b, Rows) else None
  a_contracted = a_rows is not None and a_rows == (0 if ta else 1)
  b_contracted = b_rows is not None and b_rows == (1 if tb else 0)
  if a_rows is not None and b_rows is not None:
    if a_contracted and b_contracted:
      return [ctx.reduce(op, "sum", a_rows)]
    return [Local(op.name, "multiplies rows by rows (e.g. a batch times its "
                  "own transpose)")]
  if a_rows is not None:
    return [Rows(0)] if not a_contracted else [
        Local(op.name, "contracts rows with a tensor without rows")]
  if b_rows is not None:
    return [Rows(1)] if not b_contracted else [
        Local(op.name, "contracts rows with a tensor without rows")]
  return [SHARD if SHARD in (a, b) else WHOLE]


def _batch_matmul(op, kinds, ctx):
  rows = [k for k in kinds[:2] if isinstance(k, Rows)]
  local = _any_local(kinds[:2])
  if local:
    return [local]
  out_rank = _rank(op.outputs[0])
  if not rows:
    return [SHARD if SHARD in kinds else WHOLE]
  axes = set()
  for tensor, kind in zip(op.inputs[:2], kinds[:2]):
    if isinstance(kind, Rows):
      rank = _rank(tensor)
      if rank is None or out_rank is None or kind.axis >= rank - 2:
        return [Local(op.name, "multiplies along the rows axis")]
      axes.add(out_rank - rank + kind.axis)
  if len(axes) != 1:
    return [Local(op.name, "multiplies rows cut along different axes")]
  return [Rows(axes.pop())]


def _einsum(op, kinds, ctx):
  local = _any_local(kinds)
  if local:
    return [local]
  equation = op.get_attr("equation").decode().replace(" ", "")
  if "..." in equation or "->" not in equation:
    return [_first_rows(kinds) and Local(op.name, "einsum with ellipsis over "
                                          "rows") or WHOLE]
  inputs, output = equation.split("->")
  letters = inputs.split(",")
  batch = set()
  for kind, spec in zip(kinds, letters):
    if isinstance(kind, Rows):
      if kind.axis >= len(spec):
        return [Local(op.name, "einsum over rows")]
      batch.add(spec[kind.axis])
  if not batch:
    return [SHARD if SHARD in kinds else WHOLE]
  if len(batch) > 1:
    return [Local(op.name, "einsum combining rows of different axes")]
  letter = batch.pop()
  carriers = [k for k, spec in zip(kinds, letters) if letter in spec]
  if not all(isinstance(k, Rows) for k in carriers):
    return [Local(op.name, "einsum of rows with a tensor without rows")]
  if letter in output:
    return [Rows(output.index(letter))]
  rows_inputs = [k for k in kinds if isinstance(k, Rows)]
  return [ctx.reduce(op, "sum", rows_inputs[0].axis)]


def _reshape(op, kinds, ctx):
  """Where the rows go: the entry of the new shape computed from the
  tower's size, else its -1, else the axis before which as many elements
  lie as before the rows in the input."""
  data, shape = kinds[0], kinds[1]
  if is_local(data):
    return [data]
  if isinstance(shape, Size):
    entries = shape.entries
    if isinstance(data, Rows) or data is WHOLE:
      return [Rows(min(entries) if entries else 0)]
  if not isinstance(data, Rows):
    return [data]
  values = _partial_ints(op.inputs[1])
  if values is not None and (None not in values or values.count(-1) == 1):
    before = op.inputs[0].shape[:data.axis].num_elements()
    if values.count(-1) == 1:
      position = values.index(-1)
      if before is not None and int(np.prod(values[:position])) == before:
        return [Rows(position)]
    elif before is not None:
      product = 1
      for position, value in enumerate(values):
        if product == before:
          return [Rows(position)]
        product *= value
    return [Local(op.name, f"reshapes rows cut along axis {data.axis} into "
                  f"shape {values}")]
  if data.axis == 0:
    return [Rows(0)]
  return [Local(op.name, f"reshapes rows cut along axis {data.axis}")]


def _transpose(op, kinds, ctx):
  kind = kinds[0]
  if not isinstance(kind, Rows):
    return [kind]
  perm = _static_ints(op.inputs[1])
  if perm is None:
    return [Local(op.name, "transposes rows by a permutation known at run "
                  "time")]
  return [Rows(perm.index(kind.axis))]


def _expand_dims(op, kinds, ctx):
  kind = kinds[0]
  if isinstance(kind, Size):
    return [kind]
  if not isinstance(kind, Rows):
    return [kind]
  axis = _static_ints(op.inputs[1])
  rank = _rank(op.outputs[0])
  if axis is None:
    return [Local(op.name, "expands dimensions at a run-time axis")]
  inserted = _axis_in(axis[0], rank)
  if inserted is None:
    return [Local(op.name, "expands dimensions of unknown rank")]
  return [Rows(kind.axis + (1 if inserted <= kind.axis else 0))]


def _squeeze(op, kinds, ctx):
  kind = kinds[0]
  if not isinstance(kind, Rows):
    return [kind]
  dims = list(op.get_attr("squeeze_dims"))
  rank = _rank(op.inputs[0])
  if not dims:
    if rank is None:
      return [Local(op.name, "squeezes a tensor of unknown rank")]
    dims = [i for i, d in enumerate(op.inputs[0].shape.as_list()) if d == 1]
  dims = {_axis_in(d, rank) for d in dims}
  if kind.axis in dims:
    return [Local(op.name, "squeezes the rows axis away")]
  return [Rows(kind.axis - sum(1 for d in dims if d is not None and
                               d < kind.axis))]


def _concat(op, kinds, ctx, axis_first=False):
  if axis_first:
    axis_tensor, values = op.inputs[0], list(zip(op.inputs[1:], kinds[1:]))
  else:
    axis_tensor, values = op.inputs[-1], list(zip(op.inputs[:-1],
                                                   kinds[:-1]))
  value_kinds = [k for _, k in values]
  local = _any_local(value_kinds)
  if local:
    return [local]
  if any(isinstance(k, Size) for k in value_kinds):
    return [_concat_sizes(values)]
  rows = {k.axis for k in value_kinds if isinstance(k, Rows)}
  if not rows:
    return [SHARD if SHARD in value_kinds else WHOLE]
  axis = _static_ints(axis_tensor)
  rank = _rank(op.outputs[0])
  if axis is None or len(rows) > 1:
    return [Local(op.name, "concatenates rows")]
  row_axis = rows.pop()
  if _axis_in(axis[0], rank) == row_axis and not all(
      isinstance(k, Rows) for k in value_kinds):
    return [Local(op.name, "concatenates rows with values of no rows")]
  # Along the rows: the tower's rows in another order (each row computed
  # from its own): per-row ops and reductions are unaffected.
  return [Rows(row_axis)]


def _concat_sizes(values) -> Size:
  entries, offset = set(), 0
  for tensor, kind in values:
    length = tensor.shape.num_elements()
    if length is None:
      return Size(False, None)
    if isinstance(kind, Size):
      if kind.entries is None and not kind.scalar:
        return Size(False, None)
      entries.update(offset + e for e in (kind.entries or {0}))
    offset += length
  return Size(False, frozenset(entries))


def _pack(op, kinds, ctx):
  local = _any_local(kinds)
  if local:
    return [local]
  if any(isinstance(k, Size) for k in kinds):
    if all(isinstance(k, Size) and k.scalar or k is WHOLE for k in kinds):
      return [Size(False, frozenset(i for i, k in enumerate(kinds)
                                    if isinstance(k, Size)))]
    return [Size(False, None)]
  rows = {k.axis for k in kinds if isinstance(k, Rows)}
  if not rows:
    return [SHARD if SHARD in kinds else WHOLE]
  if len(rows) > 1:
    return [Local(op.name, "stacks rows cut along different axes")]
  axis = op.get_attr("axis")
  rank = _rank(op.outputs[0])
  inserted = _axis_in(axis, rank)
  row_axis = rows.pop()
  if inserted is None:
    return [Local(op.name, "stacks at an unknown axis")]
  return [Rows(row_axis + (1 if inserted <= row_axis else 0))]


def _unpack(op, kinds, ctx):
  kind = kinds[0]
  if isinstance(kind, Size):
    entries = kind.entries
    return [Size(True) if entries is None or i in entries else WHOLE
            for i in range(len(op.outputs))]
  if not isinstance(kind, Rows):
    return _same_for_outputs(op, kind)
  axis = _axis_in(op.get_attr("axis"), _rank(op.inputs[0]))
  if axis == kind.axis:
    return _same_for_outputs(op, Local(op.name, "unstacks the rows"))
  return _same_for_outputs(op, Rows(kind.axis - (1 if axis is not None and
                                                  axis < kind.axis else 0)))


def _split(op, kinds, ctx):
  if op.type == "Split":
    axis_tensor, kind, value = op.inputs[0], kinds[1], op.inputs[1]
  else:
    axis_tensor, kind, value = op.inputs[2], kinds[0], op.inputs[0]
  if not isinstance(kind, Rows):
    return _same_for_outputs(op, kind)
  axis = _static_ints(axis_tensor)
  if axis is None or _axis_in(axis[0], _rank(value)) == kind.axis:
    return _same_for_outputs(op, Local(op.name, "splits the rows"))
  return _same_for_outputs(op, kind)


def _slice(op, kinds, ctx):
  """Slice(x, begin, size): rows stay where the rows axis is whole."""
  kind = kinds[0]
  if isinstance(kind, Size):
    return [_sliced_size(kind, _static_ints(op.inputs[1]),
                         _static_ints(op.inputs[2]))]
  if not isinstance(kind, Rows):
    return [kind]
  begin = _entry(op.inputs[1], kind.axis)
  size = _entry(op.inputs[2], kind.axis)
  if begin == 0 and (size == -1 or kinds[2] != WHOLE and size is None):
    return [kind]
  return [Local(op.name, "slices part of the rows")]


def _entry(tensor, index: int):
  """Entry `index` of an int vector if known when built."""
  values = _partial_ints(tensor)
  if values is not None and index < len(values):
    return values[index]
  return None


def _sliced_size(kind: Size, begin, size) -> Kind:
  if kind.scalar:
    return kind
  if kind.entries is None or begin is None or size is None:
    return Size(False, None)
  start = begin[0]
  stop = None if size[0] == -1 else start + size[0]
  picked = {e - start for e in kind.entries
            if e >= start and (stop is None or e < stop)}
  return Size(False, frozenset(picked)) if picked else WHOLE


def _strided_slice(op, kinds, ctx):
  kind = kinds[0]
  if isinstance(kind, Size):
    return [_strided_size(op, kind)]
  if not isinstance(kind, Rows):
    return [kind]
  mapping = _strided_mapping(op, _rank(op.inputs[0]))
  if mapping is None:
    return [Local(op.name, "slices rows with a run-time slice")]
  fate = mapping.get(kind.axis)
  if fate is None:
    return [Local(op.name, "picks single rows by position")]
  if fate in ("shrunk", "partial"):
    return [_picked_rows(op, kinds, ctx)]
  return [Rows(fate)]


def _picked_rows(op, kinds, ctx) -> Kind:
  """Rows picked by their position in the batch (`x[0]`, `x[:2]`,
  `tf.gather(x, 0)`): the whole batch's, picked once."""
  local = _any_local(kinds)
  if local or any(isinstance(k, (Size, Listed)) for k in kinds[1:]):
    return local or Local(op.name, "picks rows by the shard's size")
  return ctx.needs_every_tower(op, Mixing(op, (WHOLE,)), WHOLE,
                               "picks rows by position")


def _strided_mapping(op, rank) -> Optional[Dict[int, Any]]:
  """Input dim -> output dim, 'shrunk' or 'partial'; None if unknowable."""
  begin = _static_ints(op.inputs[1])
  end = _static_ints(op.inputs[2])
  strides = _static_ints(op.inputs[3])
  if strides is None:
    return None
  n = len(strides)
  masks = {name: op.get_attr(name) for name in (
      "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
      "shrink_axis_mask")}
  mapping, in_dim, out_dim = {}, 0, 0
  for i in range(n):
    bit = 1 << i
    if masks["ellipsis_mask"] & bit:
      if rank is None:
        return None
      following = sum(1 for j in range(i + 1, n)
                      if not masks["new_axis_mask"] & (1 << j))
      for _ in range(rank - in_dim - following):
        mapping[in_dim] = out_dim
        in_dim += 1
        out_dim += 1
      continue
    if masks["new_axis_mask"] & bit:
      out_dim += 1
      continue
    if masks["shrink_axis_mask"] & bit:
      mapping[in_dim] = "shrunk"
      in_dim += 1
      continue
    whole_begin = masks["begin_mask"] & bit or (
        begin is not None and begin[i] == 0)
    whole_end = masks["end_mask"] & bit
    if strides[i] == 1 and whole_begin and whole_end:
      mapping[in_dim] = out_dim
    elif strides[i] == 1 and whole_begin and end is not None and (
        end[i] >= 2**31 - 1):
      mapping[in_dim] = out_dim
    else:
      mapping[in_dim] = "partial"
    in_dim += 1
    out_dim += 1
  rest = (rank - in_dim) if rank is not None else None
  if rest is None:
    return mapping if all(d in mapping for d in range(in_dim)) else None
  for _ in range(rest):
    mapping[in_dim] = out_dim
    in_dim += 1
    out_dim += 1
  return mapping


def _strided_size(op, kind: Size) -> Kind:
  if kind.scalar:
    return kind
  begin = _static_ints(op.inputs[1])
  end = _static_ints(op.inputs[2])
  strides = _static_ints(op.inputs[3])
  length = op.inputs[0].shape.num_elements()
  if kind.entries is None or None in (begin, end, strides, length) or (
      len(strides) != 1 or op.get_attr("ellipsis_mask") or
      op.get_attr("new_axis_mask")):
    return Size(op.get_attr("shrink_axis_mask") == 1, None)
  start = 0 if op.get_attr("begin_mask") & 1 else begin[0]
  if start < 0:
    start += length
  if op.get_attr("shrink_axis_mask") & 1:
    return Size(True) if start in kind.entries else WHOLE
  stop = length if op.get_attr("end_mask") & 1 else min(end[0], length)
  if stop < 0:
    stop += length
  picked = [i for i, e in enumerate(range(start, stop, strides[0]))
            if e in kind.entries]
  return Size(False, frozenset(picked)) if picked else WHOLE


def _tile(op, kinds, ctx):
  data, multiples = kinds
  if is_local(data):
    return [data]
  if isinstance(data, Rows):
    value = _entry(op.inputs[1], data.axis)
    if value == 1:
      return [data]
    return [Local(op.name, "repeats the rows")]
  if isinstance(multiples, Size):
    entries = multiples.entries
    return [Rows(min(entries) if entries else 0)]
  return [data]


def _pad(op, kinds, ctx):
  kind = kinds[0]
  if not isinstance(kind, Rows):
    return [kind]
  paddings = tf.get_static_value(op.inputs[1])
  if paddings is not None and list(np.reshape(paddings[kind.axis], [-1])) == [
      0, 0]:
    return [kind]
  return [Local(op.name, "pads the rows axis")]


def _broadcast_to(op, kinds, ctx):
  data, shape = kinds
  if is_local(data):
    return [data]
  if isinstance(data, Rows):
    out_rank, in_rank = _rank(op.outputs[0]), _rank(op.inputs[0])
    if out_rank is None or in_rank is None:
      return [data]
    return [Rows(out_rank - in_rank + data.axis)]
  if isinstance(shape, Size):
    return [Rows(min(shape.entries) if shape.entries else 0)]
  return [data]


def _fill(op, kinds, ctx):
  dims, value = kinds
  if isinstance(dims, Size):
    return [Rows(min(dims.entries) if dims.entries else 0)]
  if is_local(value) or is_local(dims):
    return [value if is_local(value) else dims]
  return [value if value is SHARD else WHOLE]


def _from_shape(op, kinds, ctx):
  """Ops whose output has the shape their first input gives."""
  shape = kinds[0]
  if isinstance(shape, Size):
    return _same_for_outputs(op, Rows(min(shape.entries)
                                      if shape.entries else 0))
  local = _any_local(kinds)
  return _same_for_outputs(op, local or WHOLE)


def _range(op, kinds, ctx):
  if any(isinstance(k, Size) for k in kinds):
    return [Rows(0)]  # positions of the tower's rows (or entries)
  local = _any_local(kinds)
  return [local or WHOLE]


def _shape(op, kinds, ctx):
  outputs = []
  for tensor, kind in zip(op.inputs, kinds):
    if isinstance(kind, Rows):
      outputs.append(Size(False, frozenset([kind.axis])))
    elif isinstance(kind, Listed):
      outputs.append(Size(False, frozenset([kind.axis])))
    elif is_local(kind):
      outputs.append(Local(op.name, "is the shape of a per-tower value"))
    else:
      outputs.append(WHOLE)
  return outputs


def _size(op, kinds, ctx):
  kind = kinds[0]
  if isinstance(kind, (Rows, Listed)):
    return [Size(True)]
  if is_local(kind):
    return [kind]
  return [WHOLE]


def _gather(op, kinds, ctx):
  params, indices = kinds[0], kinds[1]
  if op.type == "GatherV2":
    axis = _static_ints(op.inputs[2])
    if axis is None:
      return [Local(op.name, "gathers along a run-time axis")]
    axis = _axis_in(axis[0], _rank(op.inputs[0]))
    batch_dims = op.get_attr("batch_dims")
  else:
    axis, batch_dims = 0, 0
  if isinstance(params, Size):
    return [_gathered_size(op, params)]
  if batch_dims:
    if isinstance(params, Rows) and params.axis == 0 or isinstance(
        indices, Rows) and indices.axis == 0:
      return [Rows(0)]
  if isinstance(indices, Rows):
    if isinstance(params, Rows) and params.axis != axis:
      return [Local(op.name, "gathers rows by rows")]
    return [Rows((axis or 0) + indices.axis)]
  if isinstance(params, Rows):
    if params.axis == axis:
      if is_local(indices):
        return [Local(op.name, "gathers rows by positions of the tower")]
      return [_picked_rows(op, kinds, ctx)]
    index_rank = _rank(op.inputs[1])
    if params.axis < (axis or 0):
      return [params]
    if index_rank is None:
      return [Local(op.name, "gathers with indices of unknown rank")]
    return [Rows(params.axis + index_rank - 1)]
  local = _any_local([params, indices])
  if local:
    return [local]
  return [SHARD if SHARD in (params, indices) else WHOLE]


def _gathered_size(op, params: Size) -> Kind:
  indices = _static_ints(op.inputs[1])
  if params.entries is None or indices is None:
    return Size(_rank(op.outputs[0]) == 0, None)
  if _rank(op.outputs[0]) == 0:
    return Size(True) if indices[0] in params.entries else WHOLE
  picked = [i for i, e in enumerate(indices) if e in params.entries]
  return Size(False, frozenset(picked)) if picked else WHOLE


def _gather_nd(op, kinds, ctx):
  params, indices = kinds
  if isinstance(indices, Rows) and indices.axis == 0:
    return [Rows(0)]
  if isinstance(params, Rows):
    batch_dims = op.get_attr("batch_dims") if "batch_dims" in [
        a.name for a in op.op_def.attr] else 0
    if batch_dims and params.axis == 0:
      return [Rows(0)]
    return [Local(op.name, "gathers rows by position")]
  local = _any_local(kinds)
  return [local or WHOLE]


def _resource_gather(op, kinds, ctx):
  indices = kinds[1]
  if isinstance(indices, Rows):
    return [Rows(indices.axis + op.get_attr("batch_dims"))]
  return [indices if is_local(indices) or indices is SHARD else WHOLE]


def _scatter_nd(op, kinds, ctx):
  indices, updates, shape = kinds
  if isinstance(shape, Size):
    return [Rows(min(shape.entries) if shape.entries else 0)]
  local = _any_local([indices, updates])
  if local:
    return [local]
  if isinstance(indices, Rows) or isinstance(updates, Rows):
    return [ctx.reduce(op, "sum", 0)]
  return [WHOLE]


def _where(op, kinds, ctx):
  if len(op.inputs) == 1:
    kind = kinds[0]
    if isinstance(kind, Rows):
      return [Rows(0)]  # coordinates of true entries, in row order
    return [kind if is_local(kind) else WHOLE]
  return [_elementwise(op, kinds)]


def _one_hot(op, kinds, ctx):
  kind = kinds[0]
  if not isinstance(kind, Rows):
    local = _any_local(kinds)
    return [local or (kind if kind is SHARD else WHOLE)]
  axis = op.get_attr("axis")
  rank = _rank(op.inputs[0])
  if axis == -1 or rank is None or axis > kind.axis:
    return [kind]
  return [Rows(kind.axis + 1)]


def _along_axis_input(axis_index: int, what: str):
  """Ops working along one axis given as an input (cumsum, reverse, ...)."""
  def transfer(op, kinds, ctx):
    kind = kinds[0]
    if not isinstance(kind, Rows):
      return _same_for_outputs(op, kind if is_local(kind) or kind is SHARD
                               else WHOLE)
    axes = _static_ints(op.inputs[axis_index])
    rank = _rank(op.inputs[0])
    if axes is None or kind.axis in {_axis_in(a, rank) for a in axes}:
      return _same_for_outputs(op, Local(op.name, what))
    return _same_for_outputs(op, kind)
  return transfer


def _last_axis(what: str):
  """Ops working along the last axis (softmax, top_k)."""
  def transfer(op, kinds, ctx):
    kind = kinds[0]
    if not isinstance(kind, Rows):
      local = _any_local(kinds)
      return _same_for_outputs(op, local or (kind if kind is SHARD
                                             else WHOLE))
    rank = _rank(op.inputs[0])
    if rank is None or kind.axis == rank - 1:
      return _same_for_outputs(op, Local(op.name, what))
    return _same_for_outputs(op, kind)
  return transfer


def _per_row(op, kinds, ctx):
  """Every output keeps the rows (axis 0) of the first input with rows."""
  local = _any_local(kinds)
  if local:
    return _same_for_outputs(op, local)
  rows = _first_rows(kinds)
  if rows is None:
    return _same_for_outputs(op, SHARD if SHARD in kinds else WHOLE)
  return _same_for_outputs(op, Rows(0) if rows.axis == 0 else rows)


def _fused_norm(op, kinds, ctx):
  kind = kinds[0]
  if not isinstance(kind, Rows):
    return _same_for_outputs(op, kind if is_local(kind) or kind is SHARD
                             else WHOLE)
  rank = _rank(op.inputs[0])
  channel = 1 if op.get_attr("data_format").decode().startswith("NC") else (
      None if rank is None else rank - 1)
  if kind.axis == channel:
    # Each row normalised by itself (the batch folded into the channels:
    # Keras' LayerNormalization): statistics per row.
    return [kind] + [Rows(0)] * (len(op.outputs) - 1)
  if not op.get_attr("is_training"):
    return [kind] + [WHOLE] * (len(op.outputs) - 1)
  if kind.axis != 0:
    return _same_for_outputs(op, Local(op.name, "normalises over an axis "
                                       "that is not the batch's"))
  if ctx.per_tower(op):
    return [kind] + [SHARD] * (len(op.outputs) - 1)
  statistics = ctx.needs_every_tower(op, FusedNorm(op), WHOLE,
                                     "normalises with batch statistics")
  return [kind if statistics is WHOLE else statistics] + [statistics] * (
      len(op.outputs) - 1)


def _py_func(op, kinds, ctx):
  if all(not isinstance(k, (Rows, Local, Size, Listed)) and k is not SHARD
         for k in kinds):
    return _same_for_outputs(op, WHOLE)
  local = _any_local(kinds)
  if local:
    return _same_for_outputs(op, local)
  return _same_for_outputs(op, ctx.needs_every_tower(
      op, Mixing(op, tuple([WHOLE] * len(op.outputs))), WHOLE,
      "runs Python on the rows"))


def _unique(op, kinds, ctx):
  kind = kinds[0]
  if not isinstance(kind, Rows):
    return _same_for_outputs(op, kind if is_local(kind) else WHOLE)
  outputs = [Local(op.name, "is the set of the tower's values"), kind]
  outputs += [Local(op.name, "counts the tower's values")] * (
      len(op.outputs) - 2)
  return outputs


def _dynamic_stitch(op, kinds, ctx):
  if all(k is WHOLE for k in kinds):
    return [WHOLE]
  return [Rows(0)]


def _dynamic_partition(op, kinds, ctx):
  if all(k is WHOLE for k in kinds):
    return _same_for_outputs(op, WHOLE)
  return _same_for_outputs(op, Local(op.name, "partitions the rows"))


def _sparse_fill_empty_rows(op, kinds, ctx):
  if all(k is WHOLE for k in kinds):
    return _same_for_outputs(op, WHOLE)
  return [Rows(0), Rows(0), Rows(0), Rows(0)][:len(op.outputs)]


def _sparse_reshape(op, kinds, ctx):
  if all(k is WHOLE for k in kinds):
    return _same_for_outputs(op, WHOLE)
  return [Rows(0), Size(False, frozenset([0]))]


def _sparse_to_dense(op, kinds, ctx):
  shape = kinds[1]
  if isinstance(shape, Size):
    return [Rows(min(shape.entries) if shape.entries else 0)]
  local = _any_local(kinds)
  if local:
    return [local]
  if isinstance(kinds[0], Rows) or isinstance(kinds[2], Rows):
    return [ctx.reduce(op, "sum", 0)]
  return [WHOLE]


def _sparse_segment(op, kinds, ctx):
  ids = kinds[2]
  if len(op.inputs) > 3 and isinstance(kinds[3], Size):
    return [Rows(0)]
  if all(k is WHOLE for k in kinds):
    return [WHOLE]
  if ids is WHOLE and isinstance(kinds[0], Rows):
    return [Local(op.name, "sums rows into fixed segments")]
  return [Rows(0)]


def _sparse_dense_matmul(op, kinds, ctx):
  a_indices, a_values, a_shape, b = kinds
  sparse_rows = isinstance(a_shape, Size) or isinstance(a_values, Rows)
  adjoint_a = op.get_attr("adjoint_a")
  if sparse_rows:
    if isinstance(b, Rows):
      return [Local(op.name, "multiplies sparse rows by rows")]
    if adjoint_a:
      return [ctx.reduce(op, "sum", 0)]
    return [Rows(0)]
  if isinstance(b, Rows):
    if op.get_attr("adjoint_b"):
      return [Rows(1)]
    return [Local(op.name, "contracts rows with a sparse tensor")]
  local = _any_local(kinds)
  return [local or WHOLE]


def _sparse_reduce(op, kinds, ctx):
  if all(k is WHOLE for k in kinds[:3]):
    return _same_for_outputs(op, WHOLE)
  axes = _static_ints(op.inputs[3])
  rank = op.inputs[2].shape.num_elements()
  if axes is None:
    return _same_for_outputs(op, Local(op.name, "reduces a sparse tensor "
                                       "along run-time axes"))
  reduced = {_axis_in(a, rank) for a in axes}
  if 0 in reduced:
    combine = "sum" if "Sum" in op.type else "max"
    if op.type.endswith("Sparse"):
      return _same_for_outputs(op, Local(op.name, "reduces sparse rows to a "
                                         "sparse value"))
    return [ctx.reduce(op, combine, 0)]
  if op.type.endswith("Sparse"):
    return [Rows(0), Rows(0), Size(False, frozenset([0]))]
  return [Rows(0)]


def _sparse_rows(op, kinds, ctx):
  """Sparse ops whose (indices, values, shape) outputs keep the rows."""
  if all(k is WHOLE for k in kinds):
    return _same_for_outputs(op, WHOLE)
  local = _any_local(kinds)
  if local:
    return _same_for_outputs(op, local)
  outputs = []
  for tensor in op.outputs:
    if tensor.dtype == tf.int64 and tensor.shape.rank == 1 and (
        tensor.name.endswith(":2") or "shape" in tensor.name):
      outputs.append(Size(False, frozenset([0])))
    else:
      outputs.append(Rows(0))
  return outputs


def _ctc(op, kinds, ctx):
  if all(k is WHOLE for k in kinds):
    return _same_for_outputs(op, WHOLE)
  return [Rows(0), Rows(1)][:len(op.outputs)] + [Rows(0)] * max(
      0, len(op.outputs) - 2)


def _reverse_sequence(op, kinds, ctx):
  kind = kinds[0]
  if not isinstance(kind, Rows):
    return [kind if is_local(kind) else WHOLE]
  if op.get_attr("seq_dim") == kind.axis:
    return [Local(op.name, "reverses the rows")]
  return [kind]


def _switch(op, kinds, ctx):
  data, pred = kinds
  if is_local(pred) or isinstance(pred, Rows):
    return _same_for_outputs(op, Local(op.name, "branches on a value of the "
                                       "tower's rows"))
  return _same_for_outputs(op, data)


def _merge(op, kinds, ctx):
  return [_join(kinds), WHOLE]


def _pass_through(op, kinds, ctx):
  if op.type == "IdentityN":
    return list(kinds)
  if op.type == "Print":
    return [kinds[0]]
  if not kinds:
    return _same_for_outputs(op, WHOLE)
  return _same_for_outputs(op, kinds[0])


def _sink(op, kinds, ctx):
  return _same_for_outputs(op, WHOLE)


def _bias_add_grad(op, kinds, ctx):
  """A bias's gradient sums every axis but the channels'."""
  kind = kinds[0]
  if not isinstance(kind, Rows):
    return [kind if is_local(kind) or kind is SHARD else WHOLE]
  rank = _rank(op.inputs[0])
  nchw = op.type == "BiasAddGrad" and (
      op.get_attr("data_format") in (b"NCHW", "NCHW"))
  channels = 1 if nchw else (None if rank is None else rank - 1)
  if channels is None or kind.axis == channels:
    return [Local(op.name, "sums a bias's gradient of rows of unknown rank")]
  return [ctx.reduce(op, "sum", kind.axis)]


def _summary(op, kinds, ctx):
  """A summary of rows (a histogram, images) is of the whole batch's."""
  local = _any_local(kinds)
  if local:
    return [local]
  if any(isinstance(k, (Rows, Size)) for k in kinds):
    return [ctx.needs_every_tower(op, Mixing(op, (WHOLE,)), WHOLE,
                                  "summarises rows")]
  return [WHOLE]


def _tensor_list_from_tensor(op, kinds, ctx):
  kind = kinds[0]
  if isinstance(kind, Rows):
    if kind.axis == 0:
      return [Local(op.name, "makes a list of the rows")]
    return [Listed(kind.axis - 1)]
  return [kind if is_local(kind) else WHOLE]


def _tensor_list_set(op, kinds, ctx):
  listed, item = kinds[0], kinds[2]
  if isinstance(item, Rows):
    if isinstance(listed, Listed) and listed.axis != item.axis:
      return [Local(op.name, "mixes rows of different axes in a list")]
    return [Listed(item.axis)]
  if is_local(item):
    return [item]
  return [listed]


def _tensor_list_get(op, kinds, ctx):
  listed = kinds[0]
  if isinstance(listed, Listed):
    return [Rows(listed.axis)]
  return [listed if is_local(listed) else WHOLE]


def _tensor_list_stack(op, kinds, ctx):
  listed = kinds[0]
  if isinstance(listed, Listed):
    return [Rows(listed.axis + 1)]
  return [listed if is_local(listed) else WHOLE]


def _tensor_list_other(op, kinds, ctx):
  listed = kinds[0] if kinds else WHOLE
  outputs = []
  for tensor in op.outputs:
    if tensor.dtype == tf.variant:
      outputs.append(listed if isinstance(listed, (Listed, Local)) else WHOLE)
    else:
      outputs.append(WHOLE)
  return outputs


def _tensor_array_write(op, kinds, ctx):
  # TensorArrayWriteV3(handle, index, value, flow_in) -> flow_out
  item, flow = kinds[2], kinds[3]
  if isinstance(item, Rows):
    return [Listed(item.axis)]
  if is_local(item):
    return [item]
  return [flow]


def _tensor_array_scatter(op, kinds, ctx):
  # TensorArrayScatterV3(handle, indices, value, flow_in) -> flow_out
  value, flow = kinds[2], kinds[3]
  if isinstance(value, Rows):
    if value.axis == 0:
      return [Local(op.name, "scatters the rows into a list")]
    return [Listed(value.axis - 1)]
  return [value if is_local(value) else flow]


def _tensor_array_read(op, kinds, ctx):
  flow = kinds[-1]
  if isinstance(flow, Listed):
    return [Rows(flow.axis)]
  return [flow if is_local(flow) else WHOLE]


def _tensor_array_gather(op, kinds, ctx):
  flow = kinds[-1]
  if isinstance(flow, Listed):
    return [Rows(flow.axis + 1)] + [WHOLE] * (len(op.outputs) - 1)
  return _same_for_outputs(op, flow if is_local(flow) else WHOLE)


def _call(op, kinds, ctx):
  """A function call (tf.cond, tf.while_loop, tf.function): its bodies."""
  outputs = ctx.function_kinds(op, kinds)
  if outputs is None:
    local = _any_local(kinds)
    if local:
      return _same_for_outputs(op, local)
    if all(k is WHOLE for k in kinds):
      return _same_for_outputs(op, WHOLE)
    return _same_for_outputs(op, Local(op.name, "is a function call whose "
                                       "body replicate cannot read"))
  return outputs


_TRANSFER: Dict[str, Callable] = {
    "MatMul": _matmul, "BatchMatMul": _batch_matmul,
    "BatchMatMulV2": _batch_matmul, "BatchMatMulV3": _batch_matmul,
    "Einsum": _einsum, "Reshape": _reshape, "Transpose": _transpose,
    "ConjugateTranspose": _transpose, "ExpandDims": _expand_dims,
    "Squeeze": _squeeze, "ConcatV2": _concat,
    "Concat": lambda op, k, c: _concat(op, k, c, axis_first=True),
    "Pack": _pack, "Unpack": _unpack, "Split": _split, "SplitV": _split,
    "Slice": _slice, "StridedSlice": _strided_slice, "Tile": _tile,
    "Pad": _pad, "PadV2": _pad, "MirrorPad": _pad,
    "BroadcastTo": _broadcast_to, "Fill": _fill, "Range": _range,
    "Shape": _shape, "ShapeN": _shape, "Size": _size,
    "Rank": lambda op, k, c: [WHOLE],
    "Gather": _gather, "GatherV2": _gather, "GatherNd": _gather_nd,
    "ResourceGather": _resource_gather, "ScatterNd": _scatter_nd,
    "Where": _where, "OneHot": _one_hot,
    "ArgMax": _arg_reduction, "ArgMin": _arg_reduction,
    "Cumsum": _along_axis_input(1, "accumulates along the rows"),
    "Cumprod": _along_axis_input(1, "accumulates along the rows"),
    "CumulativeLogsumexp": _along_axis_input(1, "accumulates along the "
                                             "rows"),
    "ReverseV2": _along_axis_input(1, "reverses the rows"),
    "Roll": _along_axis_input(2, "rolls the rows"),
    "Softmax": _last_axis("normalises over the rows"),
    "LogSoftmax": _last_axis("normalises over the rows"),
    "TopKV2": _last_axis("sorts the rows"), "TopK": _last_axis("sorts the "
                                                               "rows"),
    "RandomShuffle": lambda op, k, c: [
        Local(op.name, "shuffles the rows") if is_rows(k[0]) else
        (k[0] if is_local(k[0]) else WHOLE)],
    "SegmentSum": _sorted_segment, "SegmentMean": _sorted_segment,
    "SegmentMax": _sorted_segment, "SegmentMin": _sorted_segment,
    "SegmentProd": _sorted_segment,
    "BiasAddGrad": _bias_add_grad, "BiasAddGradV1": _bias_add_grad,
    "L2Loss": lambda op, k, c: (
        [c.reduce(op, "sum", k[0].axis)] if is_rows(k[0]) else
        [k[0] if is_local(k[0]) or k[0] is SHARD else WHOLE]),
    "Unique": _unique, "UniqueV2": _unique, "UniqueWithCounts": _unique,
    "DynamicStitch": _dynamic_stitch,
    "ParallelDynamicStitch": _dynamic_stitch,
    "DynamicPartition": _dynamic_partition,
    "SparseFillEmptyRows": _sparse_fill_empty_rows,
    "SparseReshape": _sparse_reshape, "SparseToDense": _sparse_to_dense,
    "SparseSegmentSum": _sparse_segment, "SparseSegmentMean": _sparse_segment,
    "SparseSegmentSqrtN": _sparse_segment,
    "SparseSegmentSumWithNumSegments": _sparse_segment,
    "SparseSegmentMeanWithNumSegments": _sparse_segment,
    "SparseSegmentSqrtNWithNumSegments": _sparse_segment,
    "SparseTensorDenseMatMul": _sparse_dense_matmul,
    "SparseReduceSum": _sparse_reduce, "SparseReduceMax": _sparse_reduce,
    "SparseReduceSumSparse": _sparse_reduce,
    "SparseReduceMaxSparse": _sparse_reduce,
    "SparseSlice": _sparse_rows, "SparseAdd": _sparse_rows,
    "SparseReorder": _sparse_rows, "SparseSoftmax": _sparse_rows,
    "SparseDenseCwiseMul": _sparse_rows, "SparseDenseCwiseAdd": _sparse_rows,
    "SparseDenseCwiseDiv": _sparse_rows, "SparseCross": _sparse_rows,
    "SparseCrossV2": _sparse_rows, "SparseCrossHashed": _sparse_rows,
    "CTCLoss": _ctc, "CTCLossV2": _ctc,
    "ReverseSequence": _reverse_sequence,
    "Switch": _switch, "RefSwitch": _switch, "Merge": _merge,
    "RefMerge": _merge,
    "TensorListFromTensor": _tensor_list_from_tensor,
    "TensorListSetItem": _tensor_list_set,
    "TensorListPushBack": lambda op, k, c: _tensor_list_set(
        op, [k[0], WHOLE, k[1]], c),
    "TensorListGetItem": _tensor_list_get,
    "TensorListPopBack": lambda op, k, c: [k[0], _tensor_list_get(op, k,
                                                                  c)[0]],
    "TensorListStack": _tensor_list_stack,
    "TensorArrayWriteV3": _tensor_array_write,
    "TensorArrayScatterV3": _tensor_array_scatter,
    "TensorArrayReadV3": _tensor_array_read,
    "TensorArrayGatherV3": _tensor_array_gather,
    "TensorArrayConcatV3": lambda op, k, c: [
        Local(op.name, "concatenates a list of rows")
        if isinstance(k[-1], Listed) and k[-1].axis == 0 else
        (Rows(k[-1].axis) if isinstance(k[-1], Listed) else WHOLE), WHOLE],
    "FusedBatchNorm": _fused_norm, "FusedBatchNormV2": _fused_norm,
    "FusedBatchNormV3": _fused_norm,
    "If": _call, "StatelessIf": _call, "While": _call,
    "StatelessWhile": _call, "Case": _call, "StatelessCase": _call,
    "PartitionedCall": _call, "StatefulPartitionedCall": _call,
}
for _type in _REDUCTIONS:
  _TRANSFER[_type] = _reduction
for _type in _SEGMENT_REDUCTIONS:
  _TRANSFER[_type] = _segment_reduction
for _type in _ELEMENTWISE:
  _TRANSFER.setdefault(_type, lambda op, k, c: [_elementwise(op, k)])
for _type in _PER_ROW:
  _TRANSFER.setdefault(_type, _per_row)
for _type in _PASS_THROUGH:
  _TRANSFER[_type] = _pass_through
for _type in _SINKS:
  _TRANSFER[_type] = _sink
for _type in _SUMMARIES:
  _TRANSFER[_type] = _summary
for _type in _PY_FUNCS:
  _TRANSFER[_type] = _py_func
for _type in _RANDOM_FROM_SHAPE:
  _TRANSFER.setdefault(_type, _from_shape)
for _type in ("TensorListReserve", "TensorListLength",
              "TensorListElementShape", "TensorListResize",
              "EmptyTensorList", "TensorArrayV3", "TensorArraySizeV3",
              "TensorArrayCloseV3"):
  _TRANSFER.setdefault(_type, _tensor_list_other)
del _type

_unknown_logged = set()


def _unknown(op, kinds, ctx):
  """An op of unknown row semantics: rows stay rows (logged once a type)."""
  if all(k is WHOLE for k in kinds):
    return _same_for_outputs(op, WHOLE)
  local = _any_local(kinds)
  if local:
    return _same_for_outputs(op, local)
  if all(k is WHOLE or k is SHARD for k in kinds):
    return _same_for_outputs(op, SHARD)
  rows = [k for k in kinds if isinstance(k, Rows)]
  if any(k.axis != 0 for k in rows) or not rows:
    return _same_for_outputs(op, Local(op.name, f"is a {op.type} op, whose "
                                       "effect on rows replicate does not "
                                       "know"))
  if op.type not in _unknown_logged:
    _unknown_logged.add(op.type)
    logging.info("replicate: %s ops are taken to compute each row from the "
                 "same row", op.type)
  return [Rows(0) if t.shape.rank != 0 else
          Local(op.name, f"is a {op.type} op reducing rows to a scalar")
          for t in op.outputs]


# Ops writing a value into a variable: a size written is a count.
_WRITES = frozenset([
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "Assign", "AssignAdd", "AssignSub", "ResourceScatterAdd",
    "ResourceScatterUpdate", "ScatterAdd", "ScatterUpdate"])


def _reads_size_as_value(op, index: int) -> bool:
  """Whether `op` reads its input `index`, a shard size, as a number.

  A size turned into a floating value (a mean's denominator), or written
  into a variable (a counter), is a count of the batch's rows; anywhere
  else (shapes of new tensors, sparse shapes, comparisons with the
  tower's own positions) it is the tower's own.
  """
  if index in _SHAPE_ROLES.get(op.type, ()):
    return False
  if op.type in _WRITES:
    return True
  return any(t.dtype.is_floating or t.dtype.is_complex for t in op.outputs)


def _size_inputs(op, kinds, ctx) -> List[Kind]:
  """Reads shard sizes as numbers: events, then WHOLE (see above)."""
  if any(is_local(k) for k in kinds):
    # Compared or combined with a value of the tower itself (a ragged
    # tensor's row splits, say): the tower's own size.
    return list(kinds)
  result = list(kinds)
  for index, kind in enumerate(kinds):
    if not isinstance(kind, Size):
      continue
    if op.type in _READS_NO_VALUES:
      result[index] = WHOLE if op.type in ("ZerosLike", "OnesLike") else kind
    elif _reads_size_as_value(op, index):
      result[index] = ctx.value_of_size(op, index)
  return result


# Ops that read their input's shape or type, never its values.
_READS_NO_VALUES = frozenset(["Shape", "ShapeN", "Size", "Rank", "ZerosLike",
                              "OnesLike"])

_SIZE_ARITHMETIC = frozenset([
    "Mul", "AddV2", "Add", "Sub", "FloorDiv", "FloorMod", "TruncateDiv",
    "Div", "Maximum", "Minimum", "Neg", "Abs", "Cast", "Identity",
    "Reshape", "ExpandDims", "Squeeze", "Prod", "Sum", "Max", "Min",
    "BroadcastArgs"])


def _size_arithmetic(op, kinds) -> List[Kind]:
  """Integer arithmetic of shard sizes: a size again."""
  outputs = []
  for tensor in op.outputs:
    if tensor.shape.rank == 0:
      outputs.append(Size(True))
      continue
    entries = set()
    for value, kind in zip(op.inputs, kinds):
      if isinstance(kind, Size):
        if kind.scalar or kind.entries is None or (
            value.shape.rank != tensor.shape.rank):
          entries = None
          break
        entries.update(kind.entries)
    outputs.append(Size(False, None if entries is None or op.type in (
        "Reshape", "ExpandDims", "Squeeze", "BroadcastArgs") and len(
            entries) != 1 else frozenset(entries) if entries else None))
  return outputs


def transfer(op: tf.Operation, kinds: List[Kind], ctx: _Context
             ) -> List[Kind]:
  """The kinds of `op`'s outputs given its inputs' (and the events)."""
  if not op.outputs:
    _size_inputs(op, kinds, ctx)
    return []
  kinds = _size_inputs(op, kinds, ctx)
  if op.type in _SIZE_ARITHMETIC and any(
      isinstance(k, Size) for k in kinds) and not any(
          isinstance(k, (Rows, Local)) for k in kinds):
    return _size_arithmetic(op, kinds)
  if all(k is WHOLE for k in kinds) and op.type not in (
      "Range", "Fill") and op.type not in _RANDOM_FROM_SHAPE:
    return [WHOLE] * len(op.outputs)
  rule = _TRANSFER.get(op.type, _unknown)
  outputs = rule(op, kinds, ctx)
  if len(outputs) != len(op.outputs):
    outputs = (list(outputs) + [outputs[-1] if outputs else WHOLE] *
               len(op.outputs))[:len(op.outputs)]
  return outputs


class TowerRows:
  """The kinds of one tower's tensors, found op by op in creation order.

  Args:
    sources: kinds of tensors the tower did not compute (its inputs, the
      stand-ins and results of meetings), by `tensor.ref()`.
    per_tower: whether an op's statistics are asked to stay the tower's
      (`sync_batch_norm=False`).
  """

  def __init__(self, sources: Dict[Any, Kind],
               per_tower: Callable[[tf.Operation], bool] = lambda op: False):
    self._kinds: Dict[Any, Kind] = dict(sources)
    self._per_tower = per_tower
    self._done = set()
    self.events: List[Event] = []

  def add_sources(self, sources: Dict[Any, Kind]):
    self._kinds.update(sources)

  def kind(self, tensor) -> Kind:
    """The kind of `tensor` (WHOLE for a tensor the tower did not build)."""
    if tensor is None:
      return WHOLE
    kind = self._kinds.get(tensor.ref(), WHOLE)
    seen = 0
    while isinstance(kind, Like) and seen < 64:
      kind = self._kinds.get(kind.tensor.ref(), WHOLE)
      seen += 1
    return WHOLE if isinstance(kind, Like) else kind

  def run(self, ops: Iterable[tf.Operation]):
    """Finds the kinds of `ops`' outputs (ops in creation order)."""
    ctx = _Context(TOWER, self._per_tower)
    for op in ops:
      if op in self._done:
        continue
      self._done.add(op)
      kinds = [self.kind(t) for t in op.inputs]
      for tensor, kind in zip(op.outputs, transfer(op, kinds, ctx)):
        if tensor.ref() not in self._kinds:
          self._kinds[tensor.ref()] = kind
    self.events.extend(ctx.events)
    return ctx.events


def function_kinds(op: tf.Operation, kinds: List[Kind], per_tower,
                   mode: str):
  """(the kinds of a call's outputs, the first op of its bodies that needs
  every tower, or None), read from its bodies; None where unreadable."""
  bodies = _tf.function_bodies(op)
  if bodies is None:
    return None
  needs = []

  def body_kinds(body, arguments):
    outputs, inner = _body_kinds(body, arguments, per_tower, mode)
    if inner is not None:
      needs.append(inner)
    return outputs

  if op.type in ("If", "StatelessIf", "Case", "StatelessCase"):
    arguments = kinds[1:]
    branches = [body_kinds(body, arguments) for body in bodies]
    outputs = [_join(column) for column in zip(*branches)]
    if isinstance(kinds[0], Rows) or is_local(kinds[0]):
      outputs = [Local(op.name, "branches on a value of the tower's rows")
                 for _ in outputs]
  elif op.type in ("While", "StatelessWhile"):
    condition, body = bodies
    carried = list(kinds)
    for _ in range(3):
      after = body_kinds(body, carried)
      joined = [_join([a, b]) for a, b in zip(carried, after)]
      if joined == carried:
        break
      carried = joined
    tested = body_kinds(condition, carried)
    outputs = carried
    if tested and (is_local(tested[0]) or isinstance(tested[0], Rows)):
      # A loop whose trip count depends on the tower's rows.
      outputs = [Local(op.name, "loops as long as the tower's rows say") if
                 not isinstance(k, (Rows, Listed)) and k is not WHOLE else k
                 for k in carried]
  else:
    outputs = body_kinds(bodies[0], kinds)
  return outputs, (needs[0] if needs else None)


def _body_kinds(body, arguments: List[Kind], per_tower, mode: str):
  """(the kinds of a body's outputs, its first op needing every tower)."""
  ctx = _Context(mode, per_tower)
  kinds = {}
  for tensor, kind in zip(body.inputs, arguments):
    kinds[tensor.ref()] = kind
  for op in body.get_operations():
    inputs = [kinds.get(t.ref(), WHOLE) for t in op.inputs]
    for tensor, kind in zip(op.outputs, transfer(op, inputs, ctx)):
      kinds.setdefault(tensor.ref(), kind)
  outputs = [kinds.get(t.ref(), WHOLE) if t is not None else WHOLE
             for t in body.outputs]
  return outputs, ctx.needs_towers


def sources_of_inputs(shards) -> Dict[Any, Kind]:
  """Kinds of a tower's input tensors: rows; a sparse shape holds a size."""
  sources = {}
  for leaf in tf.nest.flatten(shards, expand_composites=False):
    if leaf is None:
      continue
    if isinstance(leaf, tf.SparseTensor):
      sources[leaf.indices.ref()] = Rows(0)
      sources[leaf.values.ref()] = Rows(0)
      sources[leaf.dense_shape.ref()] = Size(False, frozenset([0]))
    elif isinstance(leaf, tf.RaggedTensor):
      sources[leaf.flat_values.ref()] = Rows(0)
      for splits in leaf.nested_row_splits:
        sources[splits.ref()] = Rows(0)
    elif isinstance(leaf, tf.Tensor):
      sources[leaf.ref()] = Rows(0)
  return sources
