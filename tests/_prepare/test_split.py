"""Properties of input splitting, over random batch sizes and tower counts."""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import tensorflow as tf

from replicate._prepare import split


@given(batch=st.integers(0, 1000), towers=st.integers(1, 16))
def test_shard_sizes_cover_the_batch_and_differ_by_at_most_one(batch, towers):
  sizes = split.shard_sizes(batch, towers)
  assert len(sizes) == towers and sum(sizes) == batch
  assert max(sizes) - min(sizes) <= 1
  assert sizes == sorted(sizes, reverse=True)  # larger shards first


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 13),
    towers=st.integers(1, 5),
    static=st.booleans(),
    seed=st.integers(0, 1000))
def test_shards_are_rows_in_order(batch, towers, static, seed):
  rng = np.random.RandomState(seed)
  dense = rng.randn(batch, 3).astype(np.float32)
  ids = np.array([[r, c] for r in range(batch) for c in range(rng.randint(3))],
                 np.int64).reshape(-1, 2)
  sparse = tf.compat.v1.SparseTensorValue(ids,
                                          np.arange(len(ids), dtype=np.int64),
                                          [batch, 2])
  with tf.Graph().as_default():
    x = tf.constant(dense)
    if not static:
      x = tf.compat.v1.placeholder_with_default(x, [None, 3])
    shards = split.split_batch({
        "x": x,
        "s": tf.SparseTensor.from_value(sparse)
    }, {"y": tf.constant(np.arange(batch))}, towers)
    sizes = [tf.convert_to_tensor(size) for size in shards.sizes]
    valid = [tf.convert_to_tensor(v) for v in shards.valid]
    with tf.compat.v1.Session() as session:
      features, labels, sizes, valid = session.run(
          (shards.features, shards.labels, sizes, valid))
  assert list(sizes) == split.shard_sizes(batch, towers)
  assert list(valid) == [i == 0 or size > 0 for i, size in enumerate(sizes)]
  # A tower without examples holds one phantom row: the batch's last.
  real = [(f, y) for f, y, size in zip(features, labels, sizes) if size]
  np.testing.assert_array_equal(
      np.concatenate([f["x"] for f, _ in real]), dense)
  np.testing.assert_array_equal(
      np.concatenate([y["y"] for _, y in real]), np.arange(batch))
  rows = np.concatenate([
      f["s"].indices[:, 0] + offset
      for (f, _), offset in zip(real, np.cumsum([0] + list(sizes[:-1])))
  ])
  np.testing.assert_array_equal(rows, ids[:, 0])
  for f, y, size in zip(features, labels, sizes):
    assert f["s"].dense_shape[0] == max(size, 1)
    if not size:
      np.testing.assert_array_equal(f["x"], dense[-1:])
      np.testing.assert_array_equal(y["y"], [batch - 1])
      np.testing.assert_array_equal(f["s"].indices[:, 1],
                                    ids[ids[:, 0] == batch - 1, 1])
