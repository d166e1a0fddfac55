"""Variable-length sparse sequences: each shard as wide as its own rows.

On one device a VarLen SparseTensor is as wide as its longest row, so the
width and the lengths computed from the values agree; a shard of it must be
as wide as its own longest row (see `_prepare.split._split_sparse`), or a model
that masks with `tf.sequence_mask(lengths)` (RNNClassifier does) fails.
Each case runs N towers and one device on the same batch and weights.
"""

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

TRAIN, EVAL, PREDICT = harness.TRAIN, harness.EVAL, harness.PREDICT
# The longest row sits in the second half, so tower 0's rows are shorter
# than the batch's width; the last row (shard of its own on 4 towers of 6
# rows) is shorter still.
LENGTHS = [2, 1, 5, 3, 1, 2]
FIXED_WIDTH = 4  # a padded feature: wider than its longest row (3)


def _sparse(values, lengths, width, dtype):
  indices = [[r, t] for r, n in enumerate(lengths) for t in range(n)]
  return tf.SparseTensor(
      np.array(indices, np.int64), tf.constant(values, dtype),
      [len(lengths), width])


def _batch(static):
  """Sequence features, a context feature and labels as constants.

  Dynamic: every component behind placeholder_with_default with an unknown
  batch size (as Dataset.batch makes them).
  """
  count = sum(LENGTHS)
  features = {
      "x":
          _sparse(np.linspace(-1, 1, count), LENGTHS, max(LENGTHS), tf.float32),
      "tokens":
          _sparse(np.arange(count) % 7, LENGTHS, max(LENGTHS), tf.int64),
      "padded":
          _sparse(
              np.linspace(1, 2, 12), [min(n, 3) for n in LENGTHS], FIXED_WIDTH,
              tf.float32),
      "context":
          tf.constant(np.linspace(0, 1, len(LENGTHS))[:, None], tf.float32)
  }
  labels = tf.constant([[0], [1], [1], [0], [1], [0]], tf.int64)
  if static:
    return features, labels

  def dynamic(tensor):
    shape = [None] + tensor.shape.as_list()[1:]
    return tf.compat.v1.placeholder_with_default(tensor, shape)

  features = {
      key: (tf.SparseTensor(
          dynamic(v.indices), dynamic(v.values),
          tf.compat.v1.placeholder_with_default(v.dense_shape, [2]))
            if isinstance(v, tf.SparseTensor) else dynamic(v)
           ) for key, v in features.items()
  }
  return features, dynamic(labels)


def _run(model_fn, mode, num_towers, static, steps=2):
  """Train: losses and variables; eval: loss and metrics; predict: outputs."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = _batch(static)
    if num_towers > 1:
      model_fn = replicate.replicate_model_fn(
          model_fn, devices=harness.devices(harness.VIRTUAL_CPUS, num_towers))
    spec = model_fn(
        features=features,
        labels=labels,
        mode=mode,
        config=tf.estimator.RunConfig())
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      if mode == TRAIN:
        return harness.run_training(session, spec, steps)
      session.run([
          tf.compat.v1.global_variables_initializer(),
          tf.compat.v1.local_variables_initializer()
      ])
      harness.set_trainable_weights(session)
      if mode == PREDICT:
        return session.run(spec.predictions)
      updates = [op for _, op in spec.eval_metric_ops.values()]
      loss, _ = session.run([spec.loss, updates])
      return loss, session.run({
          k: v for k, (v, _) in spec.eval_metric_ops.items()
      })


def mask_model_fn(features, labels, mode, config):
  """Densifies a VarLen feature and masks it with its rows' lengths."""
  del config
  x = features["x"]
  lengths = tf.math.unsorted_segment_max(x.indices[:, 1] + 1, x.indices[:, 0],
                                         tf.cast(x.dense_shape[0], tf.int32))
  mask = tf.sequence_mask(lengths, dtype=tf.float32)
  padded = tf.sparse.to_dense(features["padded"])  # keeps its fixed width
  weight = tf.compat.v1.get_variable("weight", [FIXED_WIDTH])
  scores = (
      tf.reduce_sum(tf.sparse.to_dense(x) * mask, 1) +
      tf.reduce_sum(padded * weight, 1))
  loss = tf.compat.v1.losses.mean_squared_error(
      tf.cast(labels[:, 0], tf.float32), scores)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1))
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      # Per step: as wide as the batch's longest row once merged.
      predictions={
          "scores": scores,
          "lengths": lengths,
          "steps": tf.sparse.to_dense(x) * mask * weight[0]
      },
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _rnn_model_fn(cell_type, units):
  columns = [
      tf.feature_column.embedding_column(
          tf.feature_column.sequence_categorical_column_with_identity(
              "tokens", 7), 2),
      tf.feature_column.sequence_numeric_column("x")
  ]
  return tf.estimator.experimental.RNNClassifier(
      sequence_feature_columns=columns,
      context_feature_columns=[tf.feature_column.numeric_column("context")],
      units=units,
      cell_type=cell_type,
      optimizer=replicate.TowerOptimizer(
          lambda: tf.keras.optimizers.legacy.Adagrad(0.1))).model_fn


class SequenceMaskTest(parameterized.TestCase):

  @parameterized.parameters((4, False), (2, True))
  def test_masked_feature_matches_one_device(self, num_towers, static):
    self._assert_masked_feature_matches_one_device(num_towers, static)

  @parameterized.parameters((4, True), (2, False))
  @pytest.mark.wide
  def test_masked_feature_matches_one_device_wide(self, num_towers, static):
    self._assert_masked_feature_matches_one_device(num_towers, static)

  def _assert_masked_feature_matches_one_device(self, num_towers, static):
    expected = _run(mask_model_fn, TRAIN, 1, static)
    harness.assert_close_nests(
        _run(mask_model_fn, TRAIN, num_towers, static), expected)
    harness.assert_close_nests(
        _run(mask_model_fn, PREDICT, num_towers, static),
        _run(mask_model_fn, PREDICT, 1, static))


class RNNClassifierTest(parameterized.TestCase):
  """LSTM and stacked GRU with sequence categorical/numeric + context.

  Static batches of 6 only on 2 towers: Keras' masked RNN fails to build
  on a static batch of one row (on one device too), which 4 towers give
  the last rows; dynamic batches (Dataset.batch's) on 4.
  """

  # The GRU case takes twice the LSTM's time; SequenceMaskTest has the
  # dynamic batch on 4 towers.
  @parameterized.parameters(("lstm", [3], 2, True))
  def test_train_eval_predict_match_one_device(self, cell_type, units,
                                               num_towers, static):
    self._assert_train_eval_predict_match(cell_type, units, num_towers, static)

  @parameterized.parameters(("gru", [3, 2], 4, False))
  @pytest.mark.wide
  def test_train_eval_predict_match_one_device_wide(self, cell_type, units,
                                                    num_towers, static):
    self._assert_train_eval_predict_match(cell_type, units, num_towers, static)

  def _assert_train_eval_predict_match(self, cell_type, units, num_towers,
                                       static):
    model_fn = _rnn_model_fn(cell_type, units)
    for mode in (TRAIN, EVAL, PREDICT):
      with self.subTest(mode=mode):
        harness.assert_close_nests(
            _run(model_fn, mode, num_towers, static),
            _run(model_fn, mode, 1, static))


if __name__ == "__main__":
  tf.test.main()
