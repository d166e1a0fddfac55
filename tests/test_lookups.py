"""Embedding lookups of every form their params take give one device's values.

While towers are built, `tf.nn.embedding_lookup` is routed (see
`replicate/_towers/lookups.py`): on a cluster a reference variable, or any
variable's shared copy, is swapped for the variable's own read. Every
params form must reach TensorFlow as the user wrote it: a tensor is one table
(not rows to iterate), a list holds partitions, a tuple is stacked into one
table, a `PartitionedVariable`'s parts are partitions. Each case trains,
evaluates and predicts on 2 and 4 towers (10 rows: uneven on 4) against one
device.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

NUM_IDS, DIM, NUM_CLASSES, BATCH = 12, 4, 3, 10


def _data():
  rng = np.random.RandomState(5)
  ids = rng.randint(0, NUM_IDS, size=(40, 2)).astype(np.int64)
  return {"ids": ids}, (ids[:, 0] % NUM_CLASSES).astype(np.int64)


def _input_fn():
  features, labels = _data()
  return tf.data.Dataset.from_tensor_slices((features, labels)).batch(BATCH)


def _table(name, rows=NUM_IDS, use_resource=False, partitioner=None):
  return tf.compat.v1.get_variable(
      name, [rows, DIM],
      use_resource=use_resource,
      partitioner=partitioner,
      initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))


def _embedded(ids, form):
  """[batch, 2, DIM]: each id's embedding, looked up as `form` says."""
  lookup = tf.compat.v1.nn.embedding_lookup
  if form == "tensor":
    return lookup(_table("table") * 2.0, ids)
  if form == "tensor_list_div":
    table = _table("table")
    return lookup([table[:6] * 1.0, table[6:] * 1.0],
                  ids,
                  partition_strategy="div")
  if form == "ref_list_mod":
    return lookup([_table("part_0", 6), _table("part_1", 6)], ids)
  if form == "tuple":
    # A tuple is stacked into one table: [2, NUM_IDS / 2, DIM] gathered by
    # the ids' parity.
    halves = tuple(_table(f"half_{i}", NUM_IDS // 2) for i in range(2))
    return tf.reduce_sum(lookup(halves, ids % 2), axis=2)
  if form == "numpy":
    constant = np.arange(
        NUM_IDS * DIM, dtype=np.float32).reshape(NUM_IDS, DIM) / 10.0
    return lookup(constant, ids) * _table("scale", 1)[0]
  partitioner = tf.compat.v1.fixed_size_partitioner(3)
  if form == "partitioned_ref":
    return lookup(_table("table", partitioner=partitioner), ids)
  if form == "partitioned_resource":
    return lookup(
        _table("table", use_resource=True, partitioner=partitioner), ids)
  shifted = tf.sparse.from_dense(ids + 1)  # id 0 would be dropped
  sparse = tf.SparseTensor(shifted.indices, shifted.values - 1,
                           shifted.dense_shape)
  if form == "sparse_partitioned_ref":
    return tf.compat.v1.nn.embedding_lookup_sparse(
        _table("table", partitioner=partitioner), sparse, None,
        combiner="mean")[:, None]
  assert form == "safe_sparse_ref", form
  return tf.compat.v1.nn.safe_embedding_lookup_sparse(
      [_table("part_0", 6), _table("part_1", 6)], sparse,
      combiner="sqrtn")[:, None]


def _model_fn(features, labels, mode, params):
  embedded = tf.reduce_mean(_embedded(features["ids"], params["form"]), 1)
  logits = tf.compat.v1.layers.dense(
      embedded,
      NUM_CLASSES,
      name="logits",
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        eval_metric_ops={"mean_logit": tf.compat.v1.metrics.mean(logits)})
  optimizer = replicate.TowerOptimizer(tf.compat.v1.train.AdagradOptimizer(0.5))
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


FORMS = [
    "tensor", "tensor_list_div", "ref_list_mod", "tuple", "numpy",
    "partitioned_ref", "partitioned_resource", "sparse_partitioned_ref",
    "safe_sparse_ref"
]

# Each form on 4 towers; the sparse forms (rows of ids split with their
# indices) on 2 as well. The default run takes the sparse forms' tower
# counts in turn: safe_sparse_ref on 4, sparse_partitioned_ref on 2.
SPARSE_DEFAULT_TOWERS = {"safe_sparse_ref": 4, "sparse_partitioned_ref": 2}


def _cases():
  for form in FORMS:
    if form not in SPARSE_DEFAULT_TOWERS:
      yield pytest.param(form, (4,), id=form)
      continue
    for num_towers in (2, 4):
      if num_towers == SPARSE_DEFAULT_TOWERS[form]:
        yield pytest.param(form, (num_towers,), id=form)
      else:
        yield harness.wide(form, (num_towers,), id=f"{form}-{num_towers}")


@pytest.mark.parametrize("form,towers", _cases())
def test_lookup_forms_are_one_devices(form, towers):
  summary = replicate.testing.assert_replicates(
      _model_fn, _input_fn, towers=towers, steps=3, params={"form": form})
  assert list(summary.towers) == list(towers)
  assert summary.metrics == ["global_step", "loss", "mean_logit"]
  assert summary.predictions == 40
