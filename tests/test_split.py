"""Properties of input splitting, over random batch sizes and tower counts."""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import tensorflow as tf

from replicate import _split


@given(batch=st.integers(0, 1000), towers=st.integers(1, 16))
def test_shard_sizes_cover_the_batch_and_differ_by_at_most_one(batch, towers):
  sizes = _split.shard_sizes(batch, towers)
  assert len(sizes) == towers and sum(sizes) == batch
  assert max(sizes) - min(sizes) <= 1
  assert sizes == sorted(sizes, reverse=True)  # larger shards first


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 13), towers=st.integers(1, 5),
       static=st.booleans(), seed=st.integers(0, 1000))
def test_shards_are_rows_in_order(batch, towers, static, seed):
  rng = np.random.RandomState(seed)
  dense = rng.randn(batch, 3).astype(np.float32)
  ids = np.array([[r, c] for r in range(batch) for c in range(rng.randint(3))],
                 np.int64).reshape(-1, 2)
  sparse = tf.compat.v1.SparseTensorValue(
      ids, np.arange(len(ids), dtype=np.int64), [batch, 2])
  with tf.Graph().as_default():
    x = tf.constant(dense)
    if not static:
      x = tf.compat.v1.placeholder_with_default(x, [None, 3])
    shards = _split.split_batch(
        {"x": x, "s": tf.SparseTensor.from_value(sparse)},
        {"y": tf.constant(np.arange(batch))}, towers)
    sizes = [tf.convert_to_tensor(size) for size in shards.sizes]
    with tf.compat.v1.Session() as session:
      features, labels, sizes = session.run(
          (shards.features, shards.labels, sizes))
  assert list(sizes) == _split.shard_sizes(batch, towers)
  np.testing.assert_array_equal(np.concatenate([f["x"] for f in features]),
                                dense)
  np.testing.assert_array_equal(np.concatenate([l["y"] for l in labels]),
                                np.arange(batch))
  rows = np.concatenate([f["s"].indices[:, 0] + offset for f, offset in zip(
      features, np.cumsum([0] + list(sizes[:-1])))])
  np.testing.assert_array_equal(rows, ids[:, 0])
  for f, size in zip(features, sizes):
    assert f["s"].dense_shape[0] == size
