"""A cluster of trainers only: one device's step on the global batch.

On a `TF_CONFIG` cluster without a `ps` job each trainer keeps its own copy
of every variable (Estimator places them on its own task). Every batch
reduction a trainer's towers combine (`_meet.combining.combine`: sums,
counts, extrema) is all-reduced among the trainers as well, so that each
trainer's loss, model-state writes and summaries are the global batch's
(the trainers' batches in task order), and the gradients of that loss are
summed among them; every trainer then applies the same update. The
collectives are TensorFlow's own (`CollectiveReduceV2`, ring, over the
servers' gRPC runtime), with keys given in build order, the same on every
trainer that builds the same graph. The gradient of an all-reduced value
all-reduces the gradient flowing into it (every trainer's rows read it),
so each trainer's gradient is W times its share of one device's plus the
terms that read no rows: the summed gradients are divided by W. A loss
with rows (a per-example loss handed to an optimizer) passes no such
collective: its gradient is made W-fold too (`rows_loss`). The W-fold
gradient is exact in float64, and in float32 for W a power of two; a
float32 loss head (TensorFlow's v1 losses compute in float32, even of
float64 values) on W = 3 rounds it once (relative 2**-24), so float64
variables trained through one are one device's to about 1e-8.

Every route to gradients the towers meet at all-reduces them once, at the
outermost call (`_meet.optimizer_calls.among_trainers`): an optimizer's
minimize / compute_gradients / get_gradients / get_updates, Keras'
minimize (its tape), tf.gradients and GradientTape.gradient. Whatever else
writes a variable from this trainer's rows without passing a collective
among the trainers (an optimizer that differentiates by TensorFlow's
internal functions, a gradient taken inside a tf.function) would train
each trainer on its own rows: `check_all_reduced` refuses it when the
graph is built.

At session start (`start_op`) the trainers compare a fingerprint of their
graphs' collectives and cluster, then the chief broadcasts every global
variable (initialised or restored from a checkpoint) to the others.
"""

import collections
import hashlib
import json
import os
import re
from typing import Any, Callable, Iterable, List, Optional, Sequence, Set, Tuple

from absl import logging
import tensorflow as tf

from replicate import _graph

_GROUP_KEY = 48
_FINGERPRINT_KEY = 1
# Instance keys of the gathers whose rows vary by step: a range of _BUCKETS
# keys each, from _BUCKETED_KEYS (above any key built in order).
_BUCKETED_KEYS = 1 << 24
_BUCKETS = 2048
# Seconds a step's collective waits for the other trainers before failing,
# unless the environment variable TIMEOUT_VARIABLE says otherwise.
STEP_TIMEOUT_SECS = 600.0
TIMEOUT_VARIABLE = "REPLICATE_TRAINERS_TIMEOUT_SECS"
_MERGE = {
    "sum": "Add",
    "norm": "Add",
    "max": "Max",
    "min": "Min",
    "prod": "Mul",
    "all": "Min",
    "any": "Max"
}


class Trainers:
  """The trainers of one cluster, as one graph on one of them sees them.

  Args:
    tasks: the trainers' task names ('chief:0', 'worker:0', ...), in order.
    rank: this trainer's position in `tasks`.
    cluster: the cluster spec, as a dict, for the fingerprint.
    timeout_secs: how long a step's collective waits for the others.
  """

  def __init__(self,
               tasks: Sequence[str],
               rank: int,
               cluster: Any,
               timeout_secs: float = STEP_TIMEOUT_SECS) -> None:
    self.tasks = list(tasks)
    self.rank = rank
    self.size = len(tasks)
    self._cluster = json.dumps(cluster, sort_keys=True)
    self._timeout = timeout_secs
    job, index = tasks[rank].split(":")
    self.device = f"/job:{job}/replica:0/task:{index}/device:CPU:0"
    self._key = _FINGERPRINT_KEY
    self._bucketed = 0
    self._built: List[str] = []
    # Gradients already all-reduced (a routed call inside another).
    self._reduced: Set[Any] = set()
    # The collectives built: where a value stops being this trainer's own.
    self.collectives: Set[tf.Operation] = set()

  @property
  def is_chief(self) -> bool:
    return self.rank == 0

  def _next_key(self, what: str) -> int:
    self._key += 1
    self._built.append(what)
    return self._key

  def _bucketed_key(self, what: str, bucket: tf.Tensor) -> tf.Tensor:
    """The instance key of a collective whose size varies by step, for the
    size `bucket` names (`_rows_bucket`): TensorFlow fixes a collective
    instance's shape at its first run."""
    self._next_key(f"{what}:bucketed")
    self._bucketed += 1
    return _BUCKETED_KEYS + (self._bucketed - 1) * _BUCKETS + bucket

  def _reduce(self, value: tf.Tensor, merge: str, what: str) -> tf.Tensor:
    what = f"{what}:{merge}:{value.dtype.name}"
    if value.shape.is_fully_defined() or value.shape.rank is None:
      return self._collective(value, self._next_key(what), merge)
    # A shape that may change by step (a mean over a step's columns): the
    # shape is all-reduced first, then the values, flat and padded to a
    # size `_rows_bucket` names.
    shape = self._reduce(
        tf.shape(value, out_type=tf.int32), "Max", f"{what} shape")
    with tf.device(self.device):
      size = tf.reduce_prod(shape)
      padded_size, bucket = _rows_bucket(size)
      flat = tf.concat([
          tf.reshape(value, [-1]),
          tf.zeros([padded_size - size], value.dtype)
      ], 0)
    reduced = self._collective(flat, self._bucketed_key(what, bucket), merge)
    with tf.device(self.device):
      return tf.reshape(reduced[:size], shape)

  def _collective(self, value: tf.Tensor, key: Any, merge: str) -> tf.Tensor:
    """The trainers' ring all-reduce of `value` under instance `key`."""
    with tf.device(self.device):
      reduced = tf.raw_ops.CollectiveReduceV2(
          input=value,
          group_size=self.size,
          group_key=_GROUP_KEY,
          instance_key=key,
          ordering_token=[],
          merge_op=merge,
          final_op="Id",
          communication_hint="ring",
          timeout_seconds=self._timeout,
          name="among_trainers")
    self.collectives.add(reduced.op)
    return reduced

  def combine(self, how: str, value: tf.Tensor) -> tf.Tensor:
    """This trainer's combination of its towers' partials (`how`, as in
    `_meet.combining.combine`) combined with the other trainers'."""
    merge = _MERGE[how]
    if value.dtype == tf.bool:
      as_int = self._reduce(tf.cast(value, tf.int32), merge, how)
      return tf.cast(as_int, tf.bool)
    if not value.dtype.is_floating:
      return self._reduce(value, merge, how)
    return self._differentiable(how, merge)(value)

  def _differentiable(self, how: str,
                      merge: str) -> Callable[[tf.Tensor], tf.Tensor]:

    @tf.custom_gradient
    def reduced(value: tf.Tensor) -> Any:
      whole = self._reduce(value, merge, how)

      def grad(upstream: tf.Tensor) -> tf.Tensor:
        # Every trainer's rows read `whole`: their gradients all flow here.
        summed = self._reduce(upstream, "Add", f"d{how}")
        if merge == "Add":
          return summed
        if merge == "Mul":
          return summed * tf.math.divide_no_nan(whole, value)
        return summed * tf.cast(tf.equal(value, whole), summed.dtype)

      return whole, grad

    return reduced

  def gradients(self, grads: Sequence[Any]) -> List[Any]:
    """One device's gradients from each trainer's: dense ones summed (one
    all-reduce per dtype, of them all flattened end to end), sparse ones
    (IndexedSlices) gathered as rows, both over W."""
    reduced = list(grads)
    # Packed by static shapes: a shape read from a gradient would be this
    # trainer's own value after the all-reduce.
    packed = collections.defaultdict(list)
    for i, grad in enumerate(grads):
      if grad is None or _key(grad) in self._reduced:
        continue
      if isinstance(grad, tf.IndexedSlices) and grad.dense_shape is not None:
        reduced[i] = self._gathered_rows(grad)
        continue
      grad = tf.convert_to_tensor(grad)
      if grad.shape.is_fully_defined():
        packed[grad.dtype].append((i, grad))
      else:
        reduced[i] = self._mean(grad)
    for pairs in packed.values():
      with tf.device(self.device):
        flat = tf.concat([tf.reshape(g, [-1]) for _, g in pairs], 0)
      mean = self._mean(flat)
      with tf.device(self.device):
        parts = tf.split(mean, [g.shape.num_elements() for _, g in pairs])
        for (i, grad), part in zip(pairs, parts):
          reduced[i] = tf.reshape(part, grad.shape)
    for grad in reduced:
      if grad is not None:
        self._reduced.add(_key(grad))
    logging.info(
        "replicate: %d gradients among %d trainers (ring; dense all-reduced "
        "as one per dtype, sparse gathered as rows)",
        len([g for g in grads if g is not None]), self.size)
    return reduced

  def _mean(self, grad: tf.Tensor) -> tf.Tensor:
    """The trainers' `grad`s summed, over W."""
    summed = self._reduce(grad, "Add", "gradients")
    with tf.device(self.device):
      return summed / tf.cast(self.size, summed.dtype)

  def _gather(self,
              value: tf.Tensor,
              what: str,
              bucket: Optional[tf.Tensor] = None) -> tf.Tensor:
    """The trainers' `value`s concatenated in task order (equal shapes); a
    value whose rows vary by step gives `bucket`, naming its row count."""
    what = f"{what}:gather:{value.dtype.name}"
    key: Any = (
        self._next_key(what) if bucket is None else self._bucketed_key(
            what, bucket))
    with tf.device(self.device):
      gathered = tf.raw_ops.CollectiveGatherV2(
          input=value,
          group_size=self.size,
          group_key=_GROUP_KEY,
          instance_key=key,
          ordering_token=[],
          communication_hint="ring",
          timeout_seconds=self._timeout,
          name="among_trainers")
    self.collectives.add(gathered.op)
    return gathered

  def _gathered_rows(self, grad: tf.IndexedSlices) -> tf.IndexedSlices:
    """One device's sparse gradient: every trainer's rows of `grad` in task
    order, as one device's lookup over the global batch lists them (its
    optimizer sums repeated rows). Each trainer's rows are padded to the
    most any trainer has, rounded up to a bucket (at most 1/16 more),
    gathered, and the padding dropped: the traffic is the rows', not the
    table's."""
    with tf.device(self.device):
      count = tf.shape(grad.indices, out_type=tf.int32)[:1]
    counts = self._gather(count, "rows")
    with tf.device(self.device):
      rows, bucket = _rows_bucket(tf.reduce_max(counts))

      def padded(part: tf.Tensor) -> tf.Tensor:
        shape = tf.concat([[rows - count[0]], tf.shape(part)[1:]], 0)
        return tf.concat([part, tf.zeros(shape, part.dtype)], 0)

      values, indices = padded(grad.values), padded(grad.indices)
    values = self._gather(values, "sparse values", bucket)
    indices = self._gather(indices, "sparse indices", bucket)
    with tf.device(self.device):
      kept = tf.reshape(tf.sequence_mask(counts, rows), [-1])
      values = tf.boolean_mask(values, kept)
      return tf.IndexedSlices(values / tf.cast(self.size, values.dtype),
                              tf.boolean_mask(indices, kept), grad.dense_shape)

  def rows_loss(self, loss: tf.Tensor) -> tf.Tensor:
    """`loss`, a loss with rows (this trainer's), whose gradient is W times
    its own, as a loss of the global batch's value gets (see above)."""

    @tf.custom_gradient
    def rows(value: tf.Tensor) -> Any:

      def grad(upstream: tf.Tensor) -> tf.Tensor:
        return upstream * tf.cast(self.size, upstream.dtype)

      return tf.identity(value), grad

    return rows(loss)

  def own_rows_gradient(self, grad: Any) -> Any:
    """One device's gradient of a tensor of this trainer's rows (an
    activation, an input), from the W-fold one it computed."""
    if grad is None:
      return None
    if isinstance(grad, tf.IndexedSlices):
      return tf.IndexedSlices(
          grad.values / tf.cast(self.size, grad.values.dtype), grad.indices,
          grad.dense_shape)
    return grad / tf.cast(self.size, grad.dtype)

  def fingerprint(self) -> int:
    """The collectives built so far and the cluster, as 48 bits."""
    text = "|".join([self._cluster] + self._built)
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)

  def start_op(self, variables: Sequence[tf.Variable]) -> tf.Operation:
    """At session start: compare fingerprints, then the chief's values of
    `variables` (initialised or restored) become every trainer's."""
    with tf.name_scope("replicate_trainers_start"), tf.device(self.device):
      mine = float(self.fingerprint())
      both = tf.constant([mine, -mine], tf.float64)
      # A key no other collective takes: trainers whose graphs differ give
      # their other collectives different keys, never this one.
      agreed = self._collective(both, _FINGERPRINT_KEY, "Max")
      check = tf.debugging.Assert(
          tf.logical_and(tf.equal(agreed[0], mine), tf.equal(-agreed[1], mine)),
          [
              "replicate: the trainers of this TF_CONFIG cluster built "
              "different training graphs or name different clusters "
              f"(this trainer, {self.tasks[self.rank]}: {mine:.0f}); "
              "give every trainer the same TF_CONFIG cluster, the same "
              "model_fn, params and replicate_model_fn arguments.", agreed
          ])
      copies = []
      with tf.control_dependencies([check]):
        for variable in variables:
          copies.append(self._broadcast(variable))
      return tf.group(*copies)

  def _broadcast(self, variable: tf.Variable) -> tf.Operation:
    key = self._next_key("broadcast")
    if self.is_chief:
      return tf.raw_ops.CollectiveBcastSendV2(
          input=variable.read_value(),
          group_size=self.size,
          group_key=_GROUP_KEY,
          instance_key=key,
          communication_hint="ring",
          timeout_seconds=self._timeout,
          name="from_chief").op
    value = tf.raw_ops.CollectiveBcastRecvV2(
        group_size=self.size,
        group_key=_GROUP_KEY,
        instance_key=key,
        shape=variable.shape.as_list(),
        T=variable.dtype.base_dtype,
        communication_hint="ring",
        timeout_seconds=self._timeout,
        name="from_chief")
    return variable.assign(value, read_value=False)


def _rows_bucket(most: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  """(size, bucket) for a collective of `most` rows or elements (int32
  scalar) that vary by step: size >= most (and >= 1), the same for every
  `most` in its bucket, at most 1/16 above it; bucket < _BUCKETS, one per
  size."""
  most = tf.maximum(most, 1)
  bits = tf.reduce_sum(
      tf.cast(tf.bitwise.right_shift(most, tf.range(31)) > 0, tf.int32))
  # Five significant bits: rows = m * 2**e, m <= 32.
  e = tf.maximum(bits - 5, 0)
  m = tf.bitwise.right_shift(most + tf.bitwise.left_shift(1, e) - 1, e)
  return tf.bitwise.left_shift(m, e), e * 64 + m


def _key(grad: Any) -> Any:
  return (grad.values if isinstance(grad, tf.IndexedSlices) else grad).ref()


def check_all_reduced(trainers: Trainers, batch: Iterable[tf.Operation],
                      train_op: Any) -> None:
  """Raises ValueError if the train_op writes a variable from this trainer's
  rows (`batch`: the ops of its input) by a way that no collective among the
  trainers passes: that variable would train on this trainer's rows alone
  and drift from the other trainers' copies."""
  own = _own_rows(trainers, batch)
  if not own:
    return
  start = [getattr(t, "op", t) for t in tf.nest.flatten(train_op)]
  for op in _graph.walk([op for op in start if op is not None],
                        _graph.input_and_control_ops):
    if not _WRITES.match(op.type):
      continue
    tainted = [t for t in op.inputs[1:] if t.ref() in own]
    if tainted:
      raise ValueError(_not_reduced(op, tainted[0]))


# Ops that write their first input, a variable.
_WRITES = re.compile(r"^(Resource)?(Sparse)?Apply|^Assign|^(Resource)?Scatter|"
                     r"StridedSliceAssign$")


def _own_rows(trainers: Trainers, batch: Iterable[tf.Operation]) -> Set[Any]:
  """The tensors (refs) computed from this trainer's rows without passing
  one of the trainers' collectives. An IdentityN (`tf.custom_gradient`'s,
  as around the collectives) passes each input to its own output only."""
  stop = trainers.collectives

  def outputs(ref: Any) -> List[Any]:
    tensor = ref.deref()
    found: List[tf.Tensor] = []
    for op in tensor.consumers():
      if op in stop:
        continue
      if op.type == "IdentityN":
        found.extend(op.outputs[i]
                     for i, t in enumerate(op.inputs)
                     if t is tensor and i < len(op.outputs))
      else:
        found.extend(op.outputs)
    return [t.ref() for t in found]

  start = [t.ref() for op in batch if op not in stop for t in op.outputs]
  return set(_graph.walk(start, outputs))


def _not_reduced(op: tf.Operation, tensor: tf.Tensor) -> str:
  return (f"On a TF_CONFIG cluster of trainers only (no ps job), {op.type} op "
          f"{op.name!r} writes variable {op.inputs[0].op.name!r} from "
          f"{tensor.name}, which this trainer computed from its own rows "
          "without an all-reduce among the trainers: each trainer would train "
          "its copy on its own rows. replicate all-reduces the gradients of "
          "the optimizer calls it routes (tf.compat.v1.train.Optimizer and "
          "tf.keras.optimizers.legacy.Optimizer: minimize, compute_gradients, "
          "get_gradients, get_updates, and replicate.TowerOptimizer), of "
          "tf.gradients and GradientTape.gradient called in the model_fn, and "
          "the batch reductions (sums, means, counts, extrema); not a gradient "
          "taken another way (inside a tf.function, by an optimizer's own "
          "differentiation) nor a variable the model_fn writes from its rows "
          "by other ops. Compute the update's gradients with one of those "
          "calls, or add a ps job to the cluster.")


def from_config(config: Optional[tf.estimator.RunConfig],
                mode: str) -> Optional[Trainers]:
  """The trainers of `config`'s cluster when it has no `ps` job, this task is
  one of two or more trainers and `mode` trains; else None."""
  if config is None or mode != tf.estimator.ModeKeys.TRAIN:
    return None
  spec = config.cluster_spec.as_dict() if config.cluster_spec else {}
  if not spec or "ps" in spec or config.task_type not in ("chief", "worker"):
    return None
  tasks = [
      f"{job}:{i}" for job in ("chief", "worker")
      for i in range(len(spec.get(job, [])))
  ]
  if len(tasks) < 2:
    return None
  rank = tasks.index(f"{config.task_type}:{config.task_id}")
  logging.info(
      "replicate: trainers only (no ps): %s is trainer %d of %d, gradients "
      "and batch reductions all-reduced among them", tasks[rank], rank,
      len(tasks))
  return Trainers(tasks, rank, spec, timeout_secs())


def timeout_secs() -> float:
  """How long the trainers' collectives wait: $REPLICATE_TRAINERS_TIMEOUT_SECS
  or `STEP_TIMEOUT_SECS`."""
  given = os.environ.get(TIMEOUT_VARIABLE)
  if not given:
    return STEP_TIMEOUT_SECS
  try:
    secs = float(given)
  except ValueError:
    secs = 0.0
  if secs <= 0:
    raise ValueError(f"{TIMEOUT_VARIABLE}={given!r}: give the seconds the "
                     "trainers' collectives wait for one another, a number "
                     "above 0.")
  return secs


def started(spec: Any, trainers: Trainers) -> Any:
  """`spec` whose scaffold, at session start, makes the trainers' variables
  the chief's (`Trainers.start_op`) once each has its own initialised (the
  chief) or not (the others, which never run the init op: they are ready
  for it at once)."""
  scaffold = spec.scaffold or tf.compat.v1.train.Scaffold()
  own = scaffold.local_init_op
  if own is None:
    own = tf.compat.v1.train.Scaffold.default_local_init_op()
  start = trainers.start_op(tf.compat.v1.global_variables())
  with tf.control_dependencies([own]):
    local_init = tf.group(start, name="replicate_local_init")
  logging.info(
      "replicate: %s starts from the chief's variables (broadcast at session "
      "start)", trainers.tasks[trainers.rank])
  return spec._replace(
      scaffold=tf.compat.v1.train.Scaffold(
          copy_from_scaffold=scaffold,
          local_init_op=local_init,
          ready_for_local_init_op=tf.constant([], tf.string)))
