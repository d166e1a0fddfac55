"""Every tower's model_fn call sees one device's graph.

The minimal forms real libraries write (DeepCTR's penalties added to
REGULARIZATION_LOSSES, TF-GAN's scoped `get_regularization_loss`, a moving
average of a tensor, AdaNet's variables picked by a marker, a variable and a
name scope of one name, as `metrics.true_positives_at_thresholds` beside
Keras metrics builds them), in float64 on 2 towers (9 rows) and 4 towers (10
rows): losses and every variable equal one device's. Then what a call reads
of the graph, point by point, against one device's call.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

D = tf.float64
_GraphKeys = tf.compat.v1.GraphKeys
CASES = [(2, 9), (4, 10)]


def _data():
  rng = np.random.RandomState(0)
  return ({"x": rng.randn(40, 5)}, rng.randint(0, 3, 40).astype(np.int64))


def _logits(features, scope="net", regularizer=None):
  with tf.compat.v1.variable_scope(scope):
    kernel = tf.compat.v1.get_variable(
        "kernel", [5, 3], D, regularizer=regularizer)
    bias = tf.compat.v1.get_variable("bias", [3], D)
  return tf.matmul(features["x"], kernel) + bias, kernel


def _cross_entropy(labels, logits):
  return tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits))


def _spec(mode, loss, after=(), var_list=None):
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.5)
  with tf.control_dependencies(list(after)):
    train_op = optimizer.minimize(
        loss, tf.compat.v1.train.get_global_step(), var_list=var_list)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _penalty_in_the_collection(features, labels, mode, params):
  del params
  logits, kernel = _logits(features)
  tf.compat.v1.losses.add_loss(0.1 * tf.nn.l2_loss(kernel),
                               _GraphKeys.REGULARIZATION_LOSSES)
  return _spec(
      mode,
      _cross_entropy(labels, logits) +
      tf.compat.v1.losses.get_regularization_loss())


def _scoped_regularization_loss(features, labels, mode, params):
  del params
  logits, _ = _logits(features, "D", lambda v: 0.1 * tf.nn.l2_loss(v))
  penalty = tf.compat.v1.losses.get_regularization_loss("D")
  return _spec(mode, _cross_entropy(labels, logits) + tf.cast(penalty, D))


def _moving_average_of_a_tensor(features, labels, mode, params):
  del params
  logits, _ = _logits(features)
  loss = _cross_entropy(labels, logits)
  average = tf.compat.v1.train.ExponentialMovingAverage(0.9, name="avg")
  return _spec(mode, loss, after=[average.apply([loss])])


def _variables_after_a_marker(features, labels, mode, params):
  del params
  start = len(tf.compat.v1.trainable_variables())
  logits, _ = _logits(features)
  variables = tf.compat.v1.trainable_variables()[start:]
  return _spec(mode, _cross_entropy(labels, logits), var_list=variables)


def _variable_and_scope_of_one_name(features, labels, mode, params):
  del params
  logits, _ = _logits(features)
  loss = _cross_entropy(labels, logits)
  positives = tf.Variable(0.0, name="tp", dtype=D, trainable=False)
  with tf.name_scope("tp"):
    count = tf.Variable(0.0, name="count", dtype=D, trainable=False)
  writes = [positives.assign_add(loss), count.assign_add(1.0)]
  return _spec(mode, loss + 0.0 * (positives + count), after=writes)


@pytest.mark.parametrize("model_fn", [
    _penalty_in_the_collection,
    _scoped_regularization_loss,
    _moving_average_of_a_tensor,
    _variables_after_a_marker,
    _variable_and_scope_of_one_name,
])
@pytest.mark.parametrize("towers,batch", CASES)
def test_graph_state_forms_train_as_one_device(model_fn, towers, batch):
  expected_losses, expected = harness.train(
      model_fn, _data(), batch, 3, static=False)
  losses, values = harness.train(
      model_fn,
      _data(),
      batch,
      3,
      tower_devices=harness.devices(harness.VIRTUAL_CPUS, towers),
      static=False)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-12)
  assert sorted(values) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(values[name], value, rtol=1e-11, err_msg=name)


def _reads(graph):
  """What a call reads of its graph now, in one device's names."""

  def towerless(name):
    return "/".join(
        part for part in name.split("/") if not part.startswith("tower_"))

  return {
      "global": [towerless(v.op.name) for v in tf.compat.v1.global_variables()],
      "scoped": [
          towerless(v.op.name)
          for v in tf.compat.v1.trainable_variables("block")
      ],
      "regularization": [
          towerless(t.op.name)
          for t in tf.compat.v1.losses.get_regularization_losses("block")
      ],
      "update_ops": [
          towerless(op.name)
          for op in tf.compat.v1.get_collection(_GraphKeys.UPDATE_OPS)
      ],
      "variable_scope": towerless(tf.compat.v1.get_variable_scope().name),
      "name_scope": towerless(graph.get_name_scope()),
      "next_name": towerless(graph.unique_name("dense", mark_as_used=False)),
  }


@pytest.mark.parametrize("towers", [2, 4])
def test_a_call_reads_one_devices_graph_at_every_point(towers):
  calls = []

  def model_fn(features, labels, mode, params):
    del params
    graph = tf.compat.v1.get_default_graph()
    reads = [_reads(graph)]
    with tf.compat.v1.variable_scope(None, default_name="block"):
      hidden = tf.compat.v1.layers.dense(
          features["x"],
          4,
          kernel_regularizer=tf.keras.regularizers.l2(0.1),
          name="dense")
      reads.append(_reads(graph))
      hidden = tf.compat.v1.layers.batch_normalization(hidden, training=True)
      reads.append(_reads(graph))
    with tf.compat.v1.variable_scope(None, default_name="block"):
      logits = tf.compat.v1.layers.dense(hidden, 3, name="dense")
    reads.append(_reads(graph))
    calls.append(reads)
    loss = _cross_entropy(labels, logits)
    loss += tf.compat.v1.losses.get_regularization_loss()
    return _spec(
        mode, loss, after=tf.compat.v1.get_collection(_GraphKeys.UPDATE_OPS))

  harness.train(model_fn, _data(), 8, 1)
  one_device = calls.pop()
  harness.train(
      model_fn,
      _data(),
      8,
      1,
      tower_devices=harness.devices(harness.VIRTUAL_CPUS, towers))
  assert len(calls) == towers
  for reads in calls:
    assert reads == one_device
  assert one_device[1]["scoped"] == ["block/dense/kernel", "block/dense/bias"]
  assert one_device[1]["regularization"] == [
      "block/dense/kernel/Regularizer/mul"
  ]
  assert len(one_device[2]["update_ops"]) == 2


def _train_raw(model_fn, towers, steps=3):
  """Losses, weights and the global step of a model_fn called in a plain
  graph, no Estimator (which would create the global step first)."""
  features, labels = _data()
  if towers:
    model_fn = replicate.replicate_model_fn(
        model_fn, devices=harness.devices(harness.VIRTUAL_CPUS, towers))
  with tf.Graph().as_default():
    spec = model_fn({"x": tf.constant(features["x"][:9])},
                    tf.constant(labels[:9]), tf.estimator.ModeKeys.TRAIN)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      losses = [
          session.run([spec.loss, spec.train_op])[0] for _ in range(steps)
      ]
      values = {
          v.op.name: session.run(v) for v in tf.compat.v1.global_variables()
      }
  return losses, values


@pytest.mark.parametrize("towers", [2, 3])
def test_a_global_step_the_call_creates_is_every_towers(towers):
  # One device's call creates it; each later tower gets it back (such a
  # tower looked it up by name and found its resource handle: a TypeError).

  def model_fn(features, labels, mode):
    kernel = tf.compat.v1.get_variable(
        "kernel", initializer=np.linspace(-1, 1, 15).reshape(5, 3))
    loss = _cross_entropy(labels, tf.matmul(features["x"], kernel))
    step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
        loss, step)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  expected_losses, expected = _train_raw(model_fn, 0)
  losses, values = _train_raw(model_fn, towers)
  assert expected["global_step"] == 3 and values["global_step"] == 3
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-12)
  assert sorted(values) == ["global_step", "kernel"] == sorted(expected)
  np.testing.assert_allclose(values["kernel"], expected["kernel"], rtol=1e-12)
