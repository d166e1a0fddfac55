"""TensorFlow op types grouped by how they treat a tower's rows.
"""

# ---------------------------------------------------------------- op tables

REDUCTIONS = {
    "Sum": "sum",
    "Mean": "mean",
    "Max": "max",
    "Min": "min",
    "Prod": "prod",
    "All": "all",
    "Any": "any",
    "EuclideanNorm": "norm"
}

SEGMENT_REDUCTIONS = {
    "UnsortedSegmentSum": "sum",
    "UnsortedSegmentMax": "max",
    "UnsortedSegmentMin": "min",
    "UnsortedSegmentProd": "prod"
}

# Ops computing each output element from the inputs' elements at the same
# (broadcast) position.
ELEMENTWISE = frozenset("""
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
PER_ROW = frozenset("""
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
PASS_THROUGH = frozenset([
    "Identity", "IdentityN", "StopGradient", "PreventGradient", "Snapshot",
    "CheckNumerics", "CheckNumericsV2", "EnsureShape", "DebugIdentity", "Enter",
    "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration",
    "RefIdentity", "Print"
])

# Ops whose outputs say nothing a later op computes with.
SINKS = frozenset([
    "NoOp", "Assert", "PrintV2", "MergeSummary", "StringFormat",
    "WriteScalarSummary", "WriteHistogramSummary", "WriteImageSummary",
    "WriteSummary", "WriteAudioSummary", "WriteRawProtoSummary"
])

# Summaries of a value (TensorBoard's tf.compat.v1.summary.*).
SUMMARIES = frozenset([
    "ScalarSummary", "HistogramSummary", "ImageSummary", "AudioSummary",
    "AudioSummaryV2", "TensorSummary", "TensorSummaryV2"
])

# Ops that run Python on their inputs: rows mixed in ways nobody can split.
PY_FUNCS = frozenset(["PyFunc", "PyFuncStateless", "EagerPyFunc"])

RANDOM_FROM_SHAPE = frozenset([
    "RandomUniform", "RandomStandardNormal", "TruncatedNormal",
    "RandomUniformInt", "StatelessRandomUniform", "StatelessRandomNormal",
    "StatelessTruncatedNormal", "StatelessRandomUniformInt",
    "StatelessRandomUniformV2", "StatelessRandomNormalV2",
    "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
    "StatelessRandomUniformFullIntV2", "RandomGammaGrad", "Empty"
])

# (op type, input index): inputs that give an op's output its shape; a size
# read there is the tower's own (its rows), not a value.
SHAPE_ROLES = {
    "Reshape": (1,),
    "Fill": (0,),
    "Tile": (1,),
    "BroadcastTo": (1,),
    "Slice": (1, 2),
    "StridedSlice": (1, 2, 3),
    "Range": (0, 1, 2),
    "Pad": (1,),
    "PadV2": (1,),
    "MirrorPad": (1,),
    "OneHot": (1,),
    "UnsortedSegmentSum": (2,),
    "UnsortedSegmentMax": (2,),
    "UnsortedSegmentMin": (2,),
    "UnsortedSegmentProd": (2,),
    "ScatterNd": (2,),
    "SparseToDense": (1,),
    "SparseReshape": (1, 2),
    "SparseSlice": (2, 3, 4),
    "SparseFillEmptyRows": (2,),
    "SparseTensorDenseMatMul": (2,),
    "SparseReduceSum": (2,),
    "SparseReduceMax": (2,),
    "SparseSegmentSumWithNumSegments": (3,),
    "SparseSegmentMeanWithNumSegments": (3,),
    "SparseSegmentSqrtNWithNumSegments": (3,),
    "TensorListReserve": (0, 1),
    "TensorListFromTensor": (1,),
    "TensorListStack": (1,),
    "TensorListGetItem": (2,),
    "TensorListConcatV2": (1, 2),
    "TensorArrayV3": (0,),
    "ResizeBilinear": (1,),
    "ResizeNearestNeighbor": (1,),
    "ResizeBicubic": (1,),
    "ResizeArea": (1,),
    "Conv2DBackpropInput": (0,),
    "Conv2DBackpropFilter": (1,),
    "Conv3DBackpropInputV2": (0,),
    "RaggedTensorToTensor": (0,),
    "SplitV": (1,),
    "SparseSlice_": (),
    "BroadcastArgs": (0, 1),
    "BroadcastGradientArgs": (0, 1),
    "Bincount": (1,),
    "DenseBincount": (1,),
    "TensorScatterUpdate": (),
    "SparseAdd": (2, 5),
    "SparseDenseCwiseMul": (2,),
    "SparseDenseCwiseAdd": (2,),
    "SparseDenseCwiseDiv": (2,),
    "SparseSoftmax": (2,),
    "SparseSegmentSum": (),
    "SequenceMask": (1,),
    "Empty": (0,),
    "TensorListSetItem": (),
    "RandomShuffle": (),
}

for _type in RANDOM_FROM_SHAPE:
  SHAPE_ROLES.setdefault(_type, (0,))
del _type
