"""The wrapped model_fn on TensorFlow's own distributed runtime.

A parameter-server cluster of in-process servers: the model's variables
live on the ps task, the towers on the worker's (virtual CPU) devices, as
Estimator's `replica_device_setter` puts them for a TF_CONFIG cluster. One
trainer makes training deterministic, so it must match one device exactly.
Synchronous training's `SyncReplicasOptimizer` goes inside TowerOptimizer.
"""

import gc
import json
import os
import socket
from unittest import mock
import weakref

from google.protobuf import text_format
import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness
from tests import models

# SyncReplicasOptimizer's queue runner thread ends in a CancelledError when
# its session closes (without replication too); it may end during a later test.
pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")

STEPS = 4
BATCH = 12


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _cluster(trainer_job):
  return {
      "ps": [f"localhost:{_free_port()}"],
      trainer_job: [f"localhost:{_free_port()}"]
  }


def _server_config():
  return tf.compat.v1.ConfigProto(
      device_count={"CPU": 4}, allow_soft_placement=True)


def _model_fn(features, labels, mode):
  return models.classifier_model_fn(features, labels, mode,
                                    {"optimizer": "momentum"})


def _batch_norm_model_fn(features, labels, mode):
  """Fused batch norm on maps and tf.nn.moments on a dense layer, in
  training: the hub meets on the worker, moving statistics on the ps."""
  hidden = tf.compat.v1.layers.dense(features["x"], 8, name="hidden")
  maps = tf.compat.v1.layers.batch_normalization(
      tf.reshape(hidden, [-1, 2, 2, 2]), training=True, fused=True, name="bn")
  dense = tf.compat.v1.layers.dense(tf.reshape(maps, [-1, 8]), 4, name="dense")
  mean, variance = tf.nn.moments(dense, [0])
  normalised = tf.nn.batch_normalization(dense, mean, variance, None, None,
                                         1e-3)
  logits = tf.compat.v1.layers.dense(
      normalised, models.NUM_CLASSES, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _train_in_cluster(tower_devices, model_fn=_model_fn, placement=None):
  """Trains STEPS steps through a worker server; losses and variables."""
  cluster = tf.train.ClusterSpec(_cluster("worker"))
  tf.distribute.Server(cluster, "ps", 0, config=_server_config())
  worker = tf.distribute.Server(cluster, "worker", 0, config=_server_config())
  setter = tf.compat.v1.train.replica_device_setter(
      ps_tasks=1, worker_device="/job:worker/task:0", cluster=cluster)
  with tf.Graph().as_default() as graph:
    with tf.compat.v1.device(setter):
      tf.compat.v1.train.create_global_step()
      features, labels = harness.batches(models.data(), BATCH)
      spec = harness.wrap(
          model_fn, tower_devices, placement=placement)(features, labels,
                                                        harness.TRAIN)
    with tf.compat.v1.Session(worker.target) as session:
      losses, values = harness.run_training(session, spec, STEPS)
  return losses, values, graph


def _devices_of(graph, op_type):
  return {
      op.name: op.device for op in graph.get_operations() if op.type == op_type
  }


def test_mirrored_on_a_cluster_keeps_the_variables_on_the_ps():
  expected_losses, expected_values, _ = _train_in_cluster(None)
  losses, values, graph = _train_in_cluster(
      harness.devices(harness.VIRTUAL_CPUS, 3), placement="mirrored")
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  harness.assert_close_nests(values, expected_values)
  variables = _devices_of(graph, "VarHandleOp")
  assert all(d.startswith("/job:ps/task:0") for d in variables.values())
  assert not [
      v for v in graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
      if v.op.name.startswith("tower_")
  ]


def test_towers_on_a_worker_with_variables_on_a_parameter_server():
  expected_losses, expected_values, _ = _train_in_cluster(None)
  losses, values, graph = _train_in_cluster(
      harness.devices(harness.VIRTUAL_CPUS, 3))
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  harness.assert_close_nests(values, expected_values)

  variables = _devices_of(graph, "VarHandleOp")
  assert variables["hidden/kernel"] == "/job:ps/task:0/device:CPU:0"
  assert all(d.startswith("/job:ps/task:0") for d in variables.values())
  matmuls = _devices_of(graph, "MatMul")
  assert matmuls["hidden/MatMul"] == "/job:worker/task:0/device:CPU:0"
  assert matmuls["tower_2/hidden/MatMul"] == "/job:worker/task:0/device:CPU:2"
  # Each tower's backward pass runs on its own device of the worker.
  backward = _devices_of(graph, "MatMul")
  assert backward["gradients/tower_2/hidden/MatMul_grad/MatMul_1"] == (
      "/job:worker/task:0/device:CPU:2")
  applies = _devices_of(graph, "ResourceApplyMomentum")
  assert set(applies.values()) == {"/job:ps/task:0/device:CPU:0"}


def test_synchronised_batch_norm_on_a_parameter_server_cluster():
  expected_losses, expected_values, _ = _train_in_cluster(
      None, _batch_norm_model_fn)
  losses, values, graph = _train_in_cluster(
      harness.devices(harness.VIRTUAL_CPUS, 3), _batch_norm_model_fn)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  harness.assert_close_nests(values, expected_values)
  assert expected_values["bn/moving_variance"].std() > 0  # it moved
  variables = _devices_of(graph, "VarHandleOp")
  assert variables["bn/moving_mean"] == "/job:ps/task:0/device:CPU:0"
  # The whole batch's statistics are combined on the worker, not the ps.
  hub = {
      op.device
      for op in graph.get_operations()
      if "whole_batch" in op.name and op.type == "AddN"
  }
  assert hub == {"/job:worker/task:0/device:CPU:0"}, hub


def _estimator_model_fn(features, labels, mode, params):
  """params['sync']: SyncReplicasOptimizer around Momentum, with its hook."""
  logits = tf.compat.v1.layers.dense(
      features["x"],
      models.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=3))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  if params.get("sync"):
    optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
        optimizer, replicas_to_aggregate=1, total_num_replicas=1)
  train_op = replicate.TowerOptimizer(optimizer).minimize(
      loss, tf.compat.v1.train.get_global_step())
  hooks = ([optimizer.make_session_run_hook(
      is_chief=True)] if params.get("sync") else [])
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op, training_hooks=hooks)


def _input_fn():
  x, y = models.data()
  return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH)


def _final_weights(model_dir):
  return {
      name: tf.train.load_variable(model_dir, name)
      for name, _ in tf.train.list_variables(model_dir)
      if name.startswith("dense/")
  }


def _train_estimator(model_dir, params):
  estimator = tf.estimator.Estimator(
      _estimator_model_fn,
      params=params,
      config=harness.estimator_config(model_dir, seed=5))
  estimator.train(_input_fn, max_steps=STEPS)
  return _final_weights(str(model_dir))


def _train_monitored(tower_devices, params):
  """Like Estimator.train, but waits 1 s, not 120, for queue runners."""
  with tf.Graph().as_default():
    tf.compat.v1.set_random_seed(5)
    global_step = tf.compat.v1.train.create_global_step()
    features, labels = tf.compat.v1.data.make_one_shot_iterator(
        _input_fn()).get_next()
    spec = harness.wrap(_estimator_model_fn,
                        tower_devices)(features, labels, harness.TRAIN, params)
    with tf.compat.v1.train.MonitoredTrainingSession(
        hooks=list(spec.training_hooks),
        stop_grace_period_secs=1,
        config=harness.session_config(),
        save_checkpoint_steps=None,
        save_summaries_steps=None) as session:
      while session.run(global_step) < STEPS:
        session.run(spec.train_op)
      return {
          v.op.name: session.run(v) for v in tf.compat.v1.trainable_variables()
      }


def test_sync_replicas_optimizer_inside_tower_optimizer():
  """Its accumulators and its hook (made in every tower) work replicated."""
  expected = _train_monitored(None, {"sync": True})
  actual = _train_monitored(
      harness.devices(harness.VIRTUAL_CPUS, 3), {"sync": True})
  harness.assert_close_nests(actual, expected)


def test_estimator_in_a_tf_config_cluster_trains_like_one_device(tmp_path):
  expected = _train_estimator(tmp_path / "plain", {})

  cluster = _cluster("chief")
  tf.distribute.Server(
      tf.train.ClusterSpec(cluster), "ps", 0, config=_server_config())
  tf_config = {"cluster": cluster, "task": {"type": "chief", "index": 0}}
  with mock.patch.dict(os.environ, {"TF_CONFIG": json.dumps(tf_config)}):
    config = harness.estimator_config(tmp_path / "cluster", seed=5)
    assert config.num_ps_replicas == 1 and config.is_chief
    estimator = tf.estimator.Estimator(
        replicate.replicate_model_fn(
            _estimator_model_fn,
            devices=harness.devices(harness.VIRTUAL_CPUS, 2)),
        config=config,
        params={})
    tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(_input_fn, max_steps=STEPS),
        tf.estimator.EvalSpec(_input_fn, steps=1))

  graph = tf.compat.v1.GraphDef()
  text_format.Parse((tmp_path / "cluster" / "graph.pbtxt").read_text(), graph)
  devices = {node.name: node.device for node in graph.node}
  assert devices["dense/kernel"] == "/job:ps/task:0/device:CPU:0"
  assert devices["tower_1/dense/MatMul"] == "/job:chief/task:0/device:CPU:1"
  assert tf.train.load_variable(str(tmp_path / "cluster"),
                                "global_step") == STEPS
  harness.assert_close_nests(
      _final_weights(str(tmp_path / "cluster")), expected)


def _canned_input_fn():
  rng = np.random.RandomState(8)
  ids = rng.randint(0, 20, size=(48, 2)).astype(np.int64)
  x = rng.randn(48, 3).astype(np.float32)
  labels = (ids[:, 0] % 3).astype(np.int64)
  return tf.data.Dataset.from_tensor_slices(({
      "ids": ids,
      "x": x
  }, labels)).repeat().batch(BATCH)


def _canned(model_dir, num_towers=None):
  """A v1 DNNLinearCombinedClassifier with embeddings, as users build it."""
  ids = tf.feature_column.categorical_column_with_identity("ids", 20)
  arguments = dict(
      linear_feature_columns=[ids],
      dnn_feature_columns=[
          tf.feature_column.embedding_column(ids, 4),
          tf.feature_column.numeric_column("x", [3])
      ],
      dnn_hidden_units=[8],
      n_classes=3,
      config=harness.estimator_config(model_dir, seed=5))
  if num_towers is None:
    return tf.compat.v1.estimator.DNNLinearCombinedClassifier(**arguments)
  return replicate.testing.replicated(
      tf.compat.v1.estimator.DNNLinearCombinedClassifier,
      num_towers)(**arguments)


def _checkpoint(model_dir):
  return {
      name: tf.train.load_variable(model_dir, name)
      for name, _ in tf.train.list_variables(model_dir)
  }


def test_canned_estimator_on_two_parameter_servers_trains_like_one_device(
    tmp_path):
  """Embeddings, linear weights and their Adagrad / Ftrl slots on two ps."""
  plain = tmp_path / "plain"
  _canned(plain).train(_canned_input_fn, max_steps=STEPS)

  cluster = _cluster("chief")
  cluster["ps"].append(f"localhost:{_free_port()}")
  for index in range(2):
    tf.distribute.Server(
        tf.train.ClusterSpec(cluster), "ps", index, config=_server_config())
  tf_config = {"cluster": cluster, "task": {"type": "chief", "index": 0}}
  towers = tmp_path / "towers"
  with mock.patch.dict(os.environ, {"TF_CONFIG": json.dumps(tf_config)}):
    estimator = _canned(towers, num_towers=4)
    assert estimator.config.num_ps_replicas == 2
    tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(_canned_input_fn, max_steps=STEPS),
        tf.estimator.EvalSpec(_canned_input_fn, steps=1))

  graph = tf.compat.v1.GraphDef()
  text_format.Parse((towers / "graph.pbtxt").read_text(), graph)
  variables = {
      node.name: node.device
      for node in graph.node
      if node.op in ("VarHandleOp", "VariableV2")
  }
  # Round robin over the two ps tasks (variables, slots, global step).
  assert {d[:len("/job:ps/task:0")] for d in variables.values()
         } == {"/job:ps/task:0", "/job:ps/task:1"}
  matmuls = {
      node.name: node.device for node in graph.node if node.op == "MatMul" and
      "hiddenlayer_0" in node.name and "gradients" not in node.name
  }
  assert matmuls == {
      f"{prefix}dnn/hiddenlayer_0/MatMul": f"/job:chief/task:0/device:CPU:{i}"
      for i, prefix in enumerate(["", "tower_1/", "tower_2/", "tower_3/"])
  }
  expected, actual = _checkpoint(str(plain)), _checkpoint(str(towers))
  assert sorted(actual) == sorted(expected)
  assert actual["global_step"] == STEPS
  assert any("embedding_weights" in name for name in expected)
  for name, value in expected.items():
    np.testing.assert_allclose(
        actual[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _built_on_a_cluster():
  """A weak reference to a replicated graph built as a cluster trainer does."""
  cluster = tf.train.ClusterSpec(_cluster("worker"))
  setter = tf.compat.v1.train.replica_device_setter(
      ps_tasks=1, worker_device="/job:worker/task:0", cluster=cluster)

  def model_fn(features, labels, mode):
    with tf.compat.v1.variable_scope("", use_resource=False):
      table = tf.compat.v1.get_variable("table", [10, 4])
      rows = tf.nn.embedding_lookup(table, features["ids"])
    logits = tf.compat.v1.layers.dense(rows, 3, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        train_op=tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            loss, tf.compat.v1.train.get_global_step()))

  with tf.Graph().as_default() as graph:
    with tf.compat.v1.device(setter):
      tf.compat.v1.train.create_global_step()
      with tf.device("/cpu:0"):
        features = {"ids": tf.constant(np.arange(8) % 10)}
        labels = tf.constant(np.arange(8) % 3)
      spec = replicate.replicate_model_fn(
          model_fn, devices=["/device:CPU:0",
                             "/device:CPU:1"])(features, labels,
                                               tf.estimator.ModeKeys.TRAIN)
    # The towers share one read of the table per step, and look rows up in
    # the variable's own read on the ps.
    ops = {op.name: op for op in graph.get_operations()}
    assert ops["table/read_once_per_step"].device == (
        "/job:worker/task:0/device:CPU:0")
    gathers = [
        op for op in graph.get_operations()
        if op.type == "GatherV2" and not op.name.startswith("gradients")
    ]
    assert len(gathers) == 2
    assert all(op.inputs[0].op.type == "Identity" and
               op.inputs[0].device.startswith("/job:ps/task:0")
               for op in gathers), [(op.name, op.inputs[0]) for op in gathers]
    del spec, ops, gathers
  return weakref.ref(graph)


def test_a_graph_built_on_a_cluster_is_freed_once_dropped():
  """Nothing of replicate keeps a trainer's graphs (one per train / eval)."""
  graph = _built_on_a_cluster()
  gc.collect()
  assert graph() is None
