"""Graphs that replicate built on are freed once their owner drops them.

Estimator builds a new graph for every train, evaluate and export call;
`train_and_evaluate` alternates them for the length of a run. Whatever
replicate keeps per graph (the optimizer a `TowerOptimizer` function built,
batch norm's written-out gradients, shared copies on a cluster) must live
no longer than the graph, or a long run keeps every graph it ever built.
"""

import gc
import itertools
import weakref

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

# Built once per test module: each graph must get its own optimizer.
_LAZY = replicate.TowerOptimizer(
    lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))


def _model_fn(features, labels, mode, params):
  h = tf.reshape(features["x"], [-1, 2, 2, 3])
  h = tf.compat.v1.layers.conv2d(h, 4, 1, name="conv")
  h = tf.compat.v1.layers.batch_normalization(
      h, training=True, fused=params["fused"], name="bn")
  logits = tf.compat.v1.layers.dense(tf.reshape(h, [-1, 16]), 3, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    optimizer = _LAZY if params["lazy"] else replicate.TowerOptimizer(
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _built(devices, fused, lazy):
  """A weak reference to a graph a model_fn was built in, and its step."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    rng = np.random.RandomState(0)
    features = {"x": tf.constant(rng.randn(8, 12).astype(np.float32))}
    labels = tf.constant(rng.randint(0, 3, 8))
    model_fn = (
        _model_fn if devices is None else replicate.replicate_model_fn(
            _model_fn, devices=devices))
    spec = model_fn(features, labels, tf.estimator.ModeKeys.TRAIN, {
        "fused": fused,
        "lazy": lazy
    })
    with tf.compat.v1.Session(
        config=tf.compat.v1.ConfigProto(
            device_count={"CPU": 2}, allow_soft_placement=True)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      loss = session.run([spec.loss, spec.train_op])[0]
  return weakref.ref(graph), loss


DEVICES = [
    None,
    # Virtual CPUs: the fused layer runs on the concatenated batch.
    ["/device:CPU:0", "/device:CPU:1"],
    # GPU names (soft placement on a machine without them): the towers'
    # moments meet, with written-out gradients.
    ["/device:GPU:0", "/device:GPU:1"],
]


def _cases():
  """Every (devices, fused, lazy); the default run takes each (fused,
  lazy) on one of DEVICES, in turn from the GPU names; the rest are `wide`."""
  cases = []
  for d, devices in enumerate(DEVICES):
    name = "None" if devices is None else f"devices{d}"
    for i, (fused,
            lazy) in enumerate(itertools.product((True, False), (True, False))):
      kept = d == (len(DEVICES) - 1 - i) % len(DEVICES)
      case = pytest.param if kept else harness.wide
      cases.append(case(devices, fused, lazy, id=f"{name}-{fused}-{lazy}"))
  return cases


@pytest.mark.parametrize("devices,fused,lazy", _cases())
def test_a_dropped_graph_is_freed(devices, fused, lazy):
  graph, loss = _built(devices, fused, lazy)
  gc.collect()
  assert graph() is None
  assert np.isfinite(loss)
