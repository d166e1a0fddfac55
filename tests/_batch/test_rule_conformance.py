"""Every rows rule checked numerically against its op.

`replicate._batch.rows` gives each op's outputs a kind from its inputs':
rows of one device's tensor, one device's whole value, a batch reduction
whose towers' partials combine into it, or an op run once on the whole
batch. Here each op type the rules name (and the elementwise table, drawn
from TensorFlow's own op definitions) is built on random float64 inputs with
a rows axis: once on the whole batch, and on N shards of it (N = 2, 3, 4;
uneven, one-row and empty shards; shapes static and unknown). What the rule
says is then checked against the whole batch's output:

- rows on an axis: the shards' outputs concatenated along it;
- a whole value: every shard's own output (no event), or the partials
  combined as the reduction says;
- run on the whole batch: the whole output splits along its rows axis;
- positions of rows: the shards' own positions, offset, concatenated;
- the tower's own (refused where one device's value is needed): counted.

The op types with no case here are listed (`test_every_rule_has_a_case`).
"""

from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_def_registry  # pylint: disable=g-direct-tensorflow-import

from replicate import _core
from replicate._batch import flow_rules
from replicate._batch import op_types
from replicate._batch import row_kinds
from replicate._batch import rows
from replicate._batch import shape_rules
from replicate._batch import value_rules

F = tf.float64
BATCH = 7
# Shard sizes of BATCH rows: 2, 3 and 4 towers, uneven, a one-row and an
# empty shard.
SPLITS = ((4, 3), (1, 2, 4), (3, 0, 2, 2))
# How much of the inputs' shapes is known: all but the rows axis (as the
# towers' shards are), no dimension, not even the rank.
SHAPES = ("dims", "rank", "none")


class Case(NamedTuple):
  """An op built on inputs; `rows[i]`: the rows axis of input i (None:
  the same whole input for every shard)."""
  op_type: str
  build: Callable[..., Any]
  inputs: Sequence[Callable[[np.random.RandomState, int], np.ndarray]]
  rows: Sequence[Optional[int]]


def _floats(*tail: int, low: float = 0.1, high: float = 0.9):
  return lambda rng, n: rng.uniform(low, high, (n,) + tail)


def _ints(*tail: int, high: int = 4):
  return lambda rng, n: rng.randint(0, high, (n,) + tail).astype(np.int64)


def _sorted_ids(rng, n):
  return np.sort(rng.randint(0, 3, n)).astype(np.int64)


def _whole_floats(*shape: int):
  return lambda rng, n: rng.uniform(0.1, 0.9, shape)


_CASES: List[Case] = []


def case(op_type: str,
         build: Callable[..., Any],
         *inputs: Any,
         rows_axes: Sequence[Optional[int]] = (0,)) -> None:
  axes = list(rows_axes) + [None] * (len(inputs) - len(rows_axes))
  _CASES.append(Case(op_type, build, inputs, axes))


# --------------------------------------------------------- elementwise

_DTYPES = (tf.float64, tf.float32, tf.int64, tf.int32, tf.bool, tf.string)
# Op types built with arguments the table cannot make up.
_NOT_GENERATED = frozenset([
    "Bitcast", "EnsureShape", "LookupTableFind", "LookupTableFindV2",
    "StringToHashBucket", "StringToHashBucketFast", "StringToHashBucketStrong",
    "RegexFullMatch", "RegexReplace", "StaticRegexFullMatch",
    "StaticRegexReplace", "Substr", "DebugIdentity", "DebugIdentityV2",
    "CheckNumerics", "CheckNumericsV2", "Print", "AsString", "StringToNumber",
    "StringLength", "StringLower", "StringUpper", "StringStrip", "Complex",
    "Real", "Imag", "Angle", "ComplexAbs", "Conj", "Select", "SelectV2"
])


def _dtype_of(op_def: Any, arg: Any) -> Optional[tf.DType]:
  if arg.type:
    return tf.as_dtype(arg.type)
  attr = next((a for a in op_def.attr if a.name == arg.type_attr), None)
  if attr is None:
    return None
  allowed = [tf.as_dtype(t) for t in attr.allowed_values.list.type
            ] or list(_DTYPES)
  return next((d for d in _DTYPES if d in allowed), None)


def _values(dtype: tf.DType):

  def make(rng, n):
    if dtype.is_floating:
      return rng.uniform(0.1, 0.9, (n, 3)).astype(dtype.as_numpy_dtype)
    if dtype.is_integer:
      return rng.randint(1, 5, (n, 3)).astype(dtype.as_numpy_dtype)
    if dtype == tf.bool:
      return rng.rand(n, 3) > 0.5
    return np.array([[str(v) for v in rng.randint(0, 9, 3)] for _ in range(n)
                    ]).reshape(n, 3)

  return make


def _elementwise_cases() -> None:
  for op_type in sorted(op_types.ELEMENTWISE - _NOT_GENERATED):
    op_def = op_def_registry.get(op_type)
    if op_def is None or any(
        a.number_attr or a.type_list_attr for a in op_def.input_arg):
      continue
    dtypes = [_dtype_of(op_def, a) for a in op_def.input_arg]
    if None in dtypes or tf.string in dtypes or not dtypes:
      continue
    names = [a.name for a in op_def.input_arg]
    function = getattr(tf.raw_ops, op_type)

    def build(*tensors, function=function, names=names):
      return function(**dict(zip(names, tensors)))

    # Each input with rows; then the first with rows and the others whole.
    case(
        op_type,
        build,
        *[_values(d) for d in dtypes],
        rows_axes=[0] * len(dtypes))
    if len(dtypes) > 1:
      _CASES.append(
          Case(op_type, build, [_values(dtypes[0])] +
               [lambda rng, n, d=d: _values(d)(rng, 1)[0] for d in dtypes[1:]],
               [0] + [None] * (len(dtypes) - 1)))


_elementwise_cases()
case(
    "AddN",
    lambda a, b: tf.raw_ops.AddN(inputs=[a, b]),
    _floats(3),
    _floats(3),
    rows_axes=(0, 0))
case(
    "Select",
    lambda c, a, b: tf.raw_ops.Select(condition=c, t=a, e=b),
    lambda rng, n: rng.rand(n) > 0.5,
    _floats(3),
    _floats(3),
    rows_axes=(0, 0, 0))
case(
    "SelectV2",
    lambda c, a, b: tf.raw_ops.SelectV2(condition=c, t=a, e=b),
    lambda rng, n: rng.rand(n, 3) > 0.5,
    _floats(3),
    _floats(3),
    rows_axes=(0, 0, 0))
case(
    "SelectV2",
    lambda c, a, b: tf.raw_ops.SelectV2(condition=c, t=a, e=b),
    lambda rng, n: rng.rand(n, 1) > 0.5,
    _floats(3),
    _floats(3),
    rows_axes=(0, 0, 0))
# Rows meeting rows along another axis: a pairwise difference.
case(
    "Sub",
    lambda a, b: a[:, None] - b[None, :],
    _floats(),
    _floats(),
    rows_axes=(0, 0))

# --------------------------------------------------------- reductions

for _type, _function in (("Sum", tf.reduce_sum), ("Mean", tf.reduce_mean),
                         ("Max", tf.reduce_max), ("Min", tf.reduce_min),
                         ("Prod", tf.reduce_prod),
                         ("EuclideanNorm", tf.math.reduce_euclidean_norm)):
  for _axis in (0, 1, [0, 1], None):
    case(_type, lambda x, f=_function, a=_axis: f(x, axis=a), _floats(3))
  case(_type, lambda x, f=_function: f(x, axis=0, keepdims=True), _floats(3))
  case(_type, lambda x, f=_function: f(x, axis=1), _floats(3), rows_axes=(1,))
case("All", lambda x: tf.reduce_all(x, axis=0),
     lambda rng, n: rng.rand(n, 3) > 0.2)
case("Any", lambda x: tf.reduce_any(x, axis=0),
     lambda rng, n: rng.rand(n, 3) > 0.8)
case("L2Loss", tf.nn.l2_loss, _floats(3))
case(
    "UnsortedSegmentSum",
    lambda x, i: tf.math.unsorted_segment_sum(x, i, 4),
    _floats(2),
    _ints(high=4),
    rows_axes=(0, 0))
case(
    "UnsortedSegmentMax",
    lambda x, i: tf.math.unsorted_segment_max(x, i, 4),
    _floats(2),
    _ints(high=4),
    rows_axes=(0, 0))
case(
    "UnsortedSegmentMin",
    lambda x, i: tf.math.unsorted_segment_min(x, i, 4),
    _floats(2),
    _ints(high=4),
    rows_axes=(0, 0))
case(
    "UnsortedSegmentProd",
    lambda x, i: tf.math.unsorted_segment_prod(x, i, 4),
    _floats(2),
    _ints(high=4),
    rows_axes=(0, 0))
for _type, _function in (("SegmentSum", tf.math.segment_sum),
                         ("SegmentMean", tf.math.segment_mean),
                         ("SegmentMax", tf.math.segment_max),
                         ("SegmentMin", tf.math.segment_min),
                         ("SegmentProd", tf.math.segment_prod)):
  case(_type, _function, _floats(2), _sorted_ids, rows_axes=(0, 0))
case("BiasAddGrad", lambda g: tf.raw_ops.BiasAddGrad(out_backprop=g),
     _floats(3))

# --------------------------------------------------------- products

case("MatMul", lambda a, w: tf.matmul(a, w), _floats(3), _whole_floats(3, 2))
case(
    "MatMul",
    lambda a, b: tf.matmul(a, b, transpose_a=True),
    _floats(3),
    _floats(2),
    rows_axes=(0, 0))
case(
    "MatMul",
    lambda a, b: tf.matmul(a, b, transpose_b=True),
    _floats(3),
    _floats(3),
    rows_axes=(0, 0))
case(
    "MatMul",
    lambda w, b: tf.matmul(w, b, transpose_b=True),
    _whole_floats(2, 3),
    _floats(3),
    rows_axes=(None, 0))
case("BatchMatMulV2", lambda a, w: tf.matmul(a, w), _floats(2, 3),
     _whole_floats(3, 2))
case(
    "BatchMatMulV2",
    lambda a, b: tf.linalg.matmul(a, b, adjoint_b=True),
    _floats(2, 3),
    _floats(2, 3),
    rows_axes=(0, 0))
case(
    "Einsum",
    lambda a, b: tf.einsum("bi,bi->b", a, b),
    _floats(3),
    _floats(3),
    rows_axes=(0, 0))
case(
    "Einsum",
    lambda a, b: tf.einsum("bi,bj->ij", a, b),
    _floats(3),
    _floats(2),
    rows_axes=(0, 0))
case(
    "Einsum",
    lambda a, b: tf.einsum("bi,ci->bc", a, b),
    _floats(3),
    _floats(3),
    rows_axes=(0, 0))

# --------------------------------------------------------- along an axis

for _type, _function in (("Cumsum", tf.math.cumsum), ("Cumprod",
                                                      tf.math.cumprod),
                         ("CumulativeLogsumexp", tf.math.cumulative_logsumexp)):
  case(_type, lambda x, f=_function: f(x, axis=0), _floats(2))
  case(_type, lambda x, f=_function: f(x, axis=1), _floats(2))
case("ReverseV2", lambda x: tf.reverse(x, [0]), _floats(2))
case("ReverseV2", lambda x: tf.reverse(x, [1]), _floats(2))
case("Roll", lambda x: tf.roll(x, 1, 0), _floats(2))
case("Softmax", lambda x: tf.nn.softmax(x, axis=-1), _floats(3))
case("Softmax", lambda x: tf.nn.softmax(x, axis=0), _floats(3))
case("Softmax", tf.nn.softmax, _floats())
case("LogSoftmax", lambda x: tf.nn.log_softmax(x, axis=0), _floats(3))
case("TopKV2", lambda x: tf.math.top_k(x, 2), _floats())
case("TopKV2", lambda x: tf.math.top_k(x, 2), _floats(3))
case("TopKV2", tf.sort, _floats())
case("ArgMax", lambda x: tf.argmax(x, 0), _floats(3))
case("ArgMax", lambda x: tf.argmax(x, 1), _floats(3))
case("ArgMin", lambda x: tf.argmin(x, 0), _floats(3))
case(
    "ReverseSequence",
    lambda x, n: tf.reverse_sequence(x, n, seq_axis=1, batch_axis=0),
    _floats(3),
    _ints(high=3),
    rows_axes=(0, 0))

# --------------------------------------------------------- shapes

case("Reshape", lambda x: tf.reshape(x, [-1, 6]), _floats(2, 3))
case("Reshape", lambda x: tf.reshape(x, [tf.shape(x)[0], 6]), _floats(2, 3))
case("Transpose", lambda x: tf.transpose(x, [1, 0, 2]), _floats(2, 3))
case("ExpandDims", lambda x: tf.expand_dims(x, -1), _floats(3))
case("ExpandDims", lambda x: tf.expand_dims(x, 0), _floats(3))
case("Squeeze", lambda x: tf.squeeze(x, 1), _floats(1, 3))
case(
    "ConcatV2",
    lambda a, b: tf.concat([a, b], 1),
    _floats(2),
    _floats(3),
    rows_axes=(0, 0))
case(
    "ConcatV2",
    lambda a, b: tf.concat([a, b], 0),
    _floats(2),
    _floats(2),
    rows_axes=(0, 0))
case(
    "ConcatV2",
    lambda a, w: tf.concat([a, w], 0),
    _floats(2),
    _whole_floats(1, 2),
    rows_axes=(0, None))
case(
    "Pack",
    lambda a, b: tf.stack([a, b], 1),
    _floats(2),
    _floats(2),
    rows_axes=(0, 0))
case("Unpack", lambda x: tf.unstack(x, axis=1), _floats(2))
case("Split", lambda x: tf.split(x, 2, axis=1), _floats(4))
case("SplitV", lambda x: tf.split(x, [1, 3], axis=1), _floats(4))
case("Slice", lambda x: tf.slice(x, [0, 1], [-1, 2]), _floats(3))
case("Slice", lambda x: tf.slice(x, [1, 0], [2, -1]), _floats(3))
case("StridedSlice", lambda x: x[:, 1:], _floats(3))
case("StridedSlice", lambda x: x[1:3], _floats(3))
case("StridedSlice", lambda x: x[0], _floats(3))
case("Tile", lambda x: tf.tile(x, [1, 2]), _floats(2))
case("Tile", lambda x: tf.tile(x, [2, 1]), _floats(2))
case("Tile", lambda x: tf.tile(x[None], [tf.shape(x)[0], 1, 1]), _floats(2))
case("Tile", lambda x: tf.tile(x, [tf.shape(x)[0], 1]), _floats(2))
case("Pad", lambda x: tf.pad(x, [[0, 0], [1, 1]]), _floats(2))
case("Pad", lambda x: tf.pad(x, [[1, 0], [0, 0]]), _floats(2))
case("Pad", lambda x: tf.pad(x, [[0, 0], [0, 3 - tf.shape(x)[1]]]), _floats(2))
case("BroadcastTo", lambda x: tf.broadcast_to(x[:, None], [tf.shape(x)[0], 2]),
     _floats())
case("Fill", lambda x: tf.fill([tf.shape(x)[0], 2], 1.5), _floats(3))
case("Range", lambda x: tf.range(tf.shape(x)[0]), _floats(3))
case("Range", lambda x: tf.cast(tf.range(tf.shape(x)[0]), F) + x[:, 0],
     _floats(3))
case("Shape", tf.shape, _floats(3))
case("Size", tf.size, _floats(3))
case(
    "GatherV2",
    lambda w, i: tf.gather(w, i),
    _whole_floats(4, 2),
    _ints(high=4),
    rows_axes=(None, 0))
case("GatherV2", lambda x: tf.gather(x, [0, 2], axis=1), _floats(3))
case("GatherV2", lambda x: tf.gather(x, [1, 0]), _floats(3))
case(
    "GatherV2",
    lambda x, i: tf.gather(x, i, batch_dims=1),
    _floats(3),
    _ints(2, high=3),
    rows_axes=(0, 0))
case(
    "GatherNd",
    lambda x, i: tf.gather_nd(x, i, batch_dims=1),
    _floats(3),
    _ints(1, high=3),
    rows_axes=(0, 0))
case(
    "GatherNd", lambda x: tf.gather_nd(
        x,
        tf.stack(
            [tf.range(tf.shape(x)[0]),
             tf.zeros_like(tf.range(tf.shape(x)[0]))], 1)), _floats(3))
case("ScatterNd", lambda u: tf.scatter_nd([[1], [2]], u[:2] * 0 + 1.0, [5, 3]),
     _floats(3))
case("OneHot", lambda i: tf.one_hot(i, 4, dtype=F), _ints(high=4))
case("Where", lambda x: tf.where(x > 0.5), _floats(3))
case(
    "DynamicPartition",
    lambda x, p: tf.dynamic_partition(x, p, 2),
    _floats(2),
    _ints(high=2),
    rows_axes=(0, 0))

# Distinct values: counted, or their set read as a value, on the whole
# batch; indices into the tower's own set gather it back as its rows.
case("UniqueWithCounts", tf.unique_with_counts, _ints())
case("Unique", lambda x: tf.size(tf.unique(x)[0]), _ints())


def _unique_gathered_back(x):
  values, indices = tf.unique(x)
  return tf.gather(values * 2 + 1, indices)


case("Unique", _unique_gathered_back, _ints())
# Counts of the rows' values: on the whole batch; of each row's own values
# (a matrix counted along its last axis), rows.
case("DenseBincount", lambda x: tf.math.bincount(x, minlength=5), _ints())
case(
    "DenseBincount",
    lambda x, w: tf.math.bincount(x, weights=w, minlength=5),
    _ints(),
    _floats(),
    rows_axes=(0, 0))
case("DenseBincount", lambda x: tf.math.bincount(x, minlength=5, axis=-1),
     _ints(3))
case(
    "Bincount", lambda x: tf.raw_ops.Bincount(
        arr=tf.cast(x, tf.int32), size=5, weights=tf.constant([], F)), _ints())

# --------------------------------------------------------- per row

case(
    "SparseSoftmaxCrossEntropyWithLogits",
    lambda x, y: tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=x),
    _floats(3),
    _ints(high=3),
    rows_axes=(0, 0))
case(
    "SoftmaxCrossEntropyWithLogits",
    lambda x, y: tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=x),
    _floats(3),
    _floats(3),
    rows_axes=(0, 0))
case(
    "Conv2D",
    lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"),
    _floats(4, 4, 2),
    _whole_floats(2, 2, 2, 3),
    rows_axes=(0, None))
case("MaxPool", lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID"), _floats(4, 4, 2))
case("AvgPool", lambda x: tf.nn.avg_pool2d(x, 2, 2, "VALID"), _floats(4, 4, 2))
case(
    "FusedBatchNormV3", lambda x: tf.compat.v1.nn.fused_batch_norm(
        x,
        tf.ones([2], F),
        tf.zeros([2], F),
        tf.zeros([2], F),
        tf.ones([2], F),
        is_training=False)[0], _floats(3, 3, 2))
case("MatrixDiagPartV3", tf.linalg.diag_part, _floats(3, 3))
case(
    "InTopKV2",
    lambda x, y: tf.math.in_top_k(y, tf.cast(x, tf.float32), 2),
    _floats(3),
    _ints(high=3),
    rows_axes=(0, 0))

# ----------------------------------------------------------- the check


class _Built(NamedTuple):
  outputs: List[tf.Tensor]
  kinds: List[Any]
  events: List[Any]


def _shards(array: np.ndarray, axis: int,
            sizes: Sequence[int]) -> List[np.ndarray]:
  cuts = np.cumsum(sizes)[:-1]
  return np.split(array, cuts, axis=axis)


def _placeholder(array: np.ndarray, axis: Optional[int],
                 known: str) -> tf.Tensor:
  if axis is None:
    return tf.constant(array)
  shape: Any = list(array.shape)
  shape[axis] = None
  if known == "rank":
    shape = [None] * len(shape)
  elif known == "none":
    shape = None
  return tf.compat.v1.placeholder_with_default(array, shape)


def _outputs(value: Any) -> List[tf.Tensor]:
  flat = tf.nest.flatten(value)
  return [tf.convert_to_tensor(t) for t in flat]


def _build(graph: tf.Graph, check: Case, arrays: Sequence[np.ndarray],
           known: str, analysed: bool) -> _Built:
  start = graph.version
  inputs = [_placeholder(a, axis, known) for a, axis in zip(arrays, check.rows)]
  outputs = _outputs(check.build(*inputs))
  if not analysed:
    return _Built(outputs, [], [])
  sources = {
      t.ref(): row_kinds.Rows(axis)
      for t, axis in zip(inputs, check.rows)
      if axis is not None
  }
  tower = rows.TowerRows(sources)
  events = tower.run(graph.get_operations()[start:])
  return _Built(outputs, [tower.kind(t) for t in outputs], events)


def _combine(how: str, partials: Sequence[np.ndarray],
             weights: Sequence[float]) -> np.ndarray:
  kept = [p for p, w in zip(partials, weights) if w > 0] or partials[:1]
  if how == "sum":
    return np.sum(kept, axis=0)
  if how == "mean":
    used = [(p, w) for p, w in zip(partials, weights) if w > 0]
    total = sum(w for _, w in used)
    return np.sum([p * w / total for p, w in used], axis=0)
  if how == "norm":
    return np.sqrt(np.sum(np.square(kept), axis=0))
  return {
      "max": np.max,
      "min": np.min,
      "prod": np.prod,
      "all": np.all,
      "any": np.any
  }[how](
      kept, axis=0)


def _check(check: Case, sizes: Sequence[int], whole_values: List[Any],
           towers: List[_Built], run: Callable[[Any], Any],
           shard_inputs: List[List[np.ndarray]]) -> bool:
  """Compares what the rule makes of the towers with the whole batch's;
  False where the rule refuses (the tower's own value)."""
  kinds = towers[0].kinds
  if any(row_kinds.is_local(k) for k in kinds):
    return False
  if any(isinstance(e, row_kinds.PositionUse) for e in towers[0].events):
    # Positions read as values are rewired to the whole batch's
    # (`_meet.rewiring`): checked end to end (tests/test_whole_batch.py).
    return True
  if any(isinstance(e, row_kinds.Mixing) for e in towers[0].events):
    # Run once on the whole batch: its rows split by the towers' counts.
    counts = [
        np.shape(parts[check.rows.index(0)])[0] if 0 in check.rows else 0
        for parts in shard_inputs
    ]
    for position, kind in enumerate(kinds):
      if isinstance(kind, row_kinds.Rows) and 0 in check.rows:
        where = f"{check.op_type} output {position} ({kind}) sizes {sizes}"
        assert np.shape(whole_values[position])[kind.axis] == sum(counts), where
    return True
  got = run([tower.outputs for tower in towers])
  for position, expected in enumerate(whole_values):
    kind = kinds[position]
    parts = [values[position] for values in got]
    where = f"{check.op_type} output {position} ({kind}) sizes {sizes}"
    if isinstance(kind, row_kinds.Positions):
      offsets = np.cumsum([0] + [np.shape(p)[kind.axis] for p in parts])[:-1]
      np.testing.assert_array_equal(
          np.concatenate([p + o for p, o in zip(parts, offsets)], kind.axis),
          expected, where)
    elif isinstance(kind, row_kinds.Rows) and kind.order:
      # One device's rows in another order: the same rows.
      np.testing.assert_allclose(
          np.sort(np.concatenate(parts, kind.axis), axis=kind.axis),
          np.sort(expected, axis=kind.axis), 1e-9, 1e-12, where)
    elif isinstance(kind, row_kinds.Rows):
      np.testing.assert_allclose(
          np.concatenate(parts, kind.axis), expected, 1e-9, 1e-12, where)
    elif isinstance(kind, row_kinds.Size):
      entries = [()] if kind.scalar else [(e,) for e in kind.entries or ()]
      for entry in entries:
        assert sum(p[entry] for p in parts) == expected[entry], where
    elif kind is row_kinds.WHOLE:
      reductions = [
          e for e in towers[0].events if isinstance(e, row_kinds.Reduction) and
          e.op is towers[0].outputs[position].op
      ]
      if reductions:
        weights = [
            float(np.size(inputs[0])) / max(np.size(p), 1)
            for inputs, p in zip(shard_inputs, parts)
        ]
        np.testing.assert_allclose(
            _combine(reductions[0].combine, parts, weights), expected, 1e-9,
            1e-12, where)
      else:
        for value in parts:
          np.testing.assert_allclose(value, expected, 1e-9, 1e-12, where)
  return True


def _run_case(check: Case, seed: int, known: str) -> int:
  """Checks every split of one draw of inputs; how many the rule ran."""
  rng = np.random.RandomState(seed)
  arrays = [make(rng, BATCH) for make in check.inputs]
  checked = 0
  with tf.Graph().as_default() as graph, _core._UNFOLDED_SHAPES.applied():
    try:
      whole = _build(graph, check, arrays, known, analysed=False)
    except (ValueError, TypeError):
      return -1  # one device cannot build it with these shapes either
    split = []
    for sizes in SPLITS:
      shard_inputs = [[
          a if axis is None else _shards(a, axis, sizes)[index]
          for a, axis in zip(arrays, check.rows)
      ]
                      for index in range(len(sizes))]
      towers = [
          _build(graph, check, parts, known, analysed=True)
          for parts in shard_inputs
      ]
      split.append((sizes, shard_inputs, towers))
    with tf.compat.v1.Session() as session:
      try:
        whole_values = session.run(whole.outputs)
      except tf.errors.InvalidArgumentError:
        return -1  # one device's op refuses these shapes too
      for sizes, shard_inputs, towers in split:
        try:
          checked += _check(check, sizes, whole_values, towers, session.run,
                            shard_inputs)
        except tf.errors.InvalidArgumentError:
          # An empty shard the op refuses, as one device would refuse it.
          if 0 not in sizes:
            raise
  return checked


def _case_id(check: Case) -> str:
  return f"{check.op_type}-{_CASES.index(check)}"


@pytest.mark.parametrize("check", _CASES, ids=_case_id)
def test_rule_agrees_with_its_op(check):
  built = [_run_case(check, seed, known) for seed, known in enumerate(SHAPES)]
  if all(b < 0 for b in built):
    pytest.skip("one device cannot build it from these inputs")


def _ruled_op_types() -> List[str]:
  return sorted(
      set(value_rules.RULES) | set(shape_rules.RULES) | set(flow_rules.RULES))


# Op types whose rule is about control flow, containers, sparse or string
# values, summaries or Python: checked by the end-to-end tests instead
# (tests/test_whole_batch.py, test_inputs.py, test_sequence_inputs.py,
# test_loss_summaries.py), not here.
_END_TO_END = frozenset(
    set(flow_rules.RULES) | op_types.SUMMARIES | op_types.PY_FUNCS
    | op_types.SINKS | op_types.PASS_THROUGH
    | {t for t in value_rules.RULES if t.startswith("Sparse")} | {
        "CTCLoss",
        "CTCLossV2",
        "DynamicStitch",
        "ParallelDynamicStitch",
        "RandomShuffle",
        "ResourceGather",
        "Rank",
        # Strings split into sparse rows: tests/test_clients.py (a TF Hub
        # text module) and tests/test_inputs.py.
        "StringSplit",
        "StringSplitV2",
        # Sets of each row, sparse: tests/test_safe_default.py.
        "DenseToDenseSetOperation",
        "DenseToSparseSetOperation",
        "SetSize",
        # Along another axis than the rows: refused as values.
        "UniqueV2",
        "UniqueWithCountsV2",
        "BiasAddGradV1",
        "Concat",
        "ShapeN",
        "TopK",
        "FusedBatchNorm",
        "FusedBatchNormV2",
        "Gather",
        "MirrorPad",
        "PadV2",
        "ConjugateTranspose",
        "BatchMatMul",
        "BatchMatMulV3"
    })


def test_every_rule_has_a_case():
  """The op types a rule names with no case here, listed; every one is
  covered by the end-to-end tests or a table drawn from op definitions."""
  covered = {c.op_type for c in _CASES}
  missing = [
      t for t in _ruled_op_types() if t not in covered and
      t not in _END_TO_END and t not in op_types.ELEMENTWISE and
      t not in op_types.PER_ROW and t not in op_types.RANDOM_FROM_SHAPE
  ]
  assert not missing, f"rules without a conformance case: {missing}"
