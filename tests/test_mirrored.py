"""MIRRORED: copies on every tower device, one device's results, one copy
in checkpoints, gradients summed between the devices."""

import functools
import os
import shutil
import tempfile
import unittest

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import conftest
from tests import harness
from tests import models

MIRRORED = replicate.VariablePlacement.MIRRORED
R = tf.compat.v1.losses.Reduction
STEPS = 4
BATCH = 8


@functools.lru_cache(maxsize=None)
def _one_device(layers="v1", optimizer="adagrad"):
  params = {"layers": layers, "optimizer": optimizer}
  return harness.train(
      models.classifier_model_fn, models.data(), BATCH, STEPS, params=params)


def _copies(graph=None):
  """Primary name -> [its copies], the mirrored local variables."""
  graph = graph or tf.compat.v1.get_default_graph()
  found = {}
  for variable in graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES):
    name = variable.op.name
    if name.startswith("tower_"):
      found.setdefault(name.split("/", 1)[1], []).append(variable)
  return found


def _train_graph(model_fn,
                 devices,
                 placement=MIRRORED,
                 params=None,
                 mode=tf.estimator.ModeKeys.TRAIN):
  """The replicated graph of `model_fn` (TRAIN by default) on one batch of
  constants."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features, labels = models.data(BATCH)
    labels = None if mode == tf.estimator.ModeKeys.PREDICT else (
        tf.constant(labels))
    harness.wrap(
        model_fn, devices, placement=placement)({
            "x": tf.constant(features["x"])
        }, labels, mode, params or {})
  return graph


def _embedding_model_fn(features, labels, mode, params):
  """An embedding lookup (sparse gradients) feeding a dense layer."""
  ids = tf.math.floormod(tf.cast(tf.abs(features["x"]) * 100.0, tf.int64), 40)
  table = tf.compat.v1.get_variable(
      "table", [40, 4],
      initializer=tf.compat.v1.random_normal_initializer(seed=1))
  pooled = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
  logits = tf.compat.v1.layers.dense(pooled, models.NUM_CLASSES, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.AdagradOptimizer(0.3)
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _bn_model_fn(features, labels, mode, params):
  """Batch norm (whole-batch statistics) and clipping by global norm
  between compute and apply."""
  training = mode == tf.estimator.ModeKeys.TRAIN
  h = tf.compat.v1.layers.dense(features["x"], 8, name="hidden")
  h = tf.compat.v1.layers.batch_normalization(h, training=training)
  logits = tf.compat.v1.layers.dense(
      tf.nn.relu(h), models.NUM_CLASSES, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  grads_and_vars = optimizer.compute_gradients(loss)
  grads, variables = zip(*grads_and_vars)
  clipped, _ = tf.clip_by_global_norm(grads, 0.5)
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.apply_gradients(
        zip(clipped, variables),
        global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _own_gradients_model_fn(features, labels, mode, params):
  """BERT's optimization.py: tf.gradients, clipping, apply_gradients."""
  logits = tf.compat.v1.layers.dense(
      tf.compat.v1.layers.dense(features["x"], 8, tf.nn.tanh, name="hidden"),
      models.NUM_CLASSES,
      name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  tvars = tf.compat.v1.trainable_variables()
  grads = tf.gradients(loss, tvars)
  grads, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
  optimizer = tf.compat.v1.train.AdamOptimizer(0.05)
  train_op = optimizer.apply_gradients(
      zip(grads, tvars), global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _two_optimizers_model_fn(features, labels, mode, params):
  """Two optimizers, each training its own layer, in one train_op."""
  hidden = tf.compat.v1.layers.dense(features["x"], 8, tf.nn.relu, name="a")
  logits = tf.compat.v1.layers.dense(hidden, models.NUM_CLASSES, name="b")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  first = tf.compat.v1.train.GradientDescentOptimizer(0.2).minimize(
      loss, var_list=tf.compat.v1.trainable_variables("a"))
  second = tf.compat.v1.train.RMSPropOptimizer(0.01).minimize(
      loss,
      var_list=tf.compat.v1.trainable_variables("b"),
      global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=tf.group(first, second))


def _keras_optimizer_model_fn(features, labels, mode, params):
  """A Keras legacy optimizer with a gradient_transform, minimizing a loss
  function."""
  hidden = tf.keras.layers.Dense(8, activation="relu")
  dense = tf.keras.layers.Dense(models.NUM_CLASSES)

  def loss_fn():
    return tf.compat.v1.losses.sparse_softmax_cross_entropy(
        labels, dense(hidden(features["x"])))

  loss = loss_fn()
  inner = tf.keras.optimizers.legacy.Adam(0.05)
  inner.iterations = tf.compat.v1.train.get_global_step()
  optimizer = replicate.TowerOptimizer(
      inner, gradient_transform=lambda pairs: [(g * 0.5, v) for g, v in pairs])
  # The reported loss before the update, on one device too.
  with tf.control_dependencies([loss]):
    train_op = optimizer.minimize(
        loss_fn, lambda: hidden.trainable_weights + dense.trainable_weights)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _hand_clipped_model_fn(features, labels, mode, params):
  """A trained variable also written by the model after each update (its
  weights clipped by hand): each device clips its own copy."""
  logits = tf.compat.v1.layers.dense(
      features["x"], models.NUM_CLASSES, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  kernel = [
      v for v in tf.compat.v1.trainable_variables() if "kernel" in v.op.name
  ][0]
  with tf.control_dependencies([train_op]):
    clip = kernel.assign(tf.clip_by_value(kernel, -0.3, 0.3))
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=tf.group(train_op, clip))


def _clipped_before_use_model_fn(features, labels, mode, params):
  """A trained variable written before the forward pass reads it (clipped
  at the start of each step): not part of the update, so not mirrored."""
  kernel = tf.compat.v1.get_variable(
      "kernel", [models.NUM_FEATURES, models.NUM_CLASSES],
      initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  clip = kernel.assign(tf.clip_by_value(kernel, -0.3, 0.3))
  with tf.control_dependencies([clip]):
    logits = tf.matmul(features["x"], kernel.read_value())
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _keras_batch_norm_model_fn(features, labels, mode, params):
  """A Keras model with batch normalization (its moving statistics in
  `model.updates`), called in training as ResNet50 is in a model_fn."""
  inputs = tf.keras.Input((models.NUM_FEATURES,))
  hidden = tf.keras.layers.Dense(8)(inputs)
  hidden = tf.keras.layers.BatchNormalization()(hidden)
  outputs = tf.keras.layers.Dense(models.NUM_CLASSES)(
      tf.keras.layers.ReLU()(hidden))
  model = tf.keras.Model(inputs, outputs)
  built = {id(update) for update in model.updates}
  logits = model(features["x"], training=mode == tf.estimator.ModeKeys.TRAIN)
  updates = [u for u in model.updates if id(u) not in built]
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  with tf.control_dependencies(updates):
    train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _loss_scaled_model_fn(features, labels, mode, params, spelling="keras"):
  """A dynamic loss scale: its update sits in a tf.cond (finite or not).

  It starts at an overflow and grows every second finite step. Spellings:
  Keras' LossScaleOptimizer in TowerOptimizer (with float16 compute and
  float32 variables too), tf.compat.v1's MixedPrecisionLossScaleOptimizer,
  alone or from the mixed-precision graph rewrite.
  """
  del params
  dense = tf.keras.layers.Dense(
      models.NUM_CLASSES,
      name="logits",
      dtype="mixed_float16" if spelling == "keras_float16" else None)
  # Eight times the cross entropy: the first scaled losses overflow.
  loss_fn = lambda: 8.0 * tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, tf.cast(dense(features["x"]), tf.float32))
  loss = loss_fn()
  if spelling in ("v1", "v1_rewrite"):
    scale = tf.compat.v1.mixed_precision.DynamicLossScale(
        initial_loss_scale=2.0**127, increment_period=2)
    if spelling == "v1":
      optimizer = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
          tf.compat.v1.train.AdagradOptimizer(0.3), scale)
    else:
      # The graph rewrite's spelling: the same optimizer, and float16
      # kernels where Grappler finds a GPU (none here).
      optimizer = (
          tf.compat.v1.mixed_precision.enable_mixed_precision_graph_rewrite(
              tf.compat.v1.train.AdagradOptimizer(0.3), scale))
      tf.compat.v1.mixed_precision.disable_mixed_precision_graph_rewrite()
    with tf.control_dependencies([loss]):
      train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  optimizer = replicate.TowerOptimizer(
      tf.keras.mixed_precision.LossScaleOptimizer(
          tf.keras.optimizers.legacy.Adagrad(0.3),
          # Overflowing float32's range at first; in float16, growing far
          # below its range (whether a float16 partial overflows depends on
          # how many rows it sums: the towers' fewer than one device's).
          initial_scale=2.0**(8 if spelling == "keras_float16" else 127),
          dynamic_growth_steps=2))
  optimizer.iterations = tf.compat.v1.train.get_global_step()
  # The reported loss before the update, on one device too.
  with tf.control_dependencies([loss]):
    train_op = optimizer.minimize(loss_fn, dense.trainable_weights)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


_MODEL_FNS = (_embedding_model_fn, _bn_model_fn, _own_gradients_model_fn,
              _two_optimizers_model_fn, _keras_optimizer_model_fn,
              _hand_clipped_model_fn, _clipped_before_use_model_fn,
              _keras_batch_norm_model_fn)


class EquivalenceTest(parameterized.TestCase):

  # Every model_fn, on 4 and 2 towers in turn.
  @parameterized.parameters(
      *[(model_fn, (4, 2)[i % 2]) for i, model_fn in enumerate(_MODEL_FNS)])
  def test_model_fns_match_one_device(self, model_fn, num_towers):
    self._assert_model_fn_matches_one_device(model_fn, num_towers)

  @parameterized.parameters(
      *[(model_fn, (2, 4)[i % 2]) for i, model_fn in enumerate(_MODEL_FNS)])
  @pytest.mark.wide
  def test_model_fns_match_one_device_wide(self, model_fn, num_towers):
    self._assert_model_fn_matches_one_device(model_fn, num_towers)

  def _assert_model_fn_matches_one_device(self, model_fn, num_towers):
    expected_losses, expected = harness.train(model_fn, models.data(), BATCH,
                                              STEPS)
    losses, values = harness.train(
        model_fn,
        models.data(),
        BATCH,
        STEPS,
        tower_devices=harness.devices(harness.VIRTUAL_CPUS, num_towers),
        placement=MIRRORED)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    self.assertEqual(sorted(values), sorted(expected))
    harness.assert_close_nests(values, expected, rtol=1e-4, atol=1e-5)


def _build_and_run(model_fn, num_towers, steps, check, batch=BATCH):
  """Builds the MIRRORED train graph; after each step `check(session)`."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(models.data(), batch)
    spec = harness.wrap(
        model_fn,
        harness.devices(harness.VIRTUAL_CPUS, num_towers),
        placement=MIRRORED)(features, labels, tf.estimator.ModeKeys.TRAIN, {})
    with tf.compat.v1.Session(
        config=harness.session_config(harness.VIRTUAL_CPUS)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      harness.set_trainable_weights(session)
      session.run(tf.compat.v1.local_variables_initializer())
      for _ in range(steps):
        session.run(spec.train_op)
        check(graph, session)


class CopiesTest(parameterized.TestCase):

  @parameterized.parameters(
      (_bn_model_fn, 4),
      (_embedding_model_fn, 3),
      (_keras_optimizer_model_fn, 2),
  )
  def test_copies_are_bitwise_equal_after_every_step(self, model_fn,
                                                     num_towers):
    checked = []

    def check(graph, session):
      copies = _copies(graph)
      primaries = {v.op.name: v for v in tf.compat.v1.global_variables()}
      self.assertNotEmpty(copies)
      for name, own in copies.items():
        self.assertLen(own, num_towers - 1, name)
        value = session.run(primaries[name])
        for copy in own:
          np.testing.assert_array_equal(session.run(copy), value, copy.name)
      checked.append(len(copies))

    _build_and_run(model_fn, num_towers, 3, check)
    self.assertLen(checked, 3)

  def test_two_runs_give_the_same_bits(self):
    runs = [
        harness.train(
            _bn_model_fn,
            models.data(),
            BATCH,
            STEPS,
            tower_devices=harness.devices(harness.VIRTUAL_CPUS, 4),
            placement=MIRRORED) for _ in range(2)
    ]
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    for name, value in runs[0][1].items():
      np.testing.assert_array_equal(runs[1][1][name], value, name)

  def test_each_device_holds_a_copy_and_reads_its_own(self):
    num_towers = 3
    # The host (CPU:0) apart from the towers, as with GPUs.
    devices = harness.devices(harness.VIRTUAL_CPUS, num_towers + 1)[1:]
    graph = _train_graph(
        models.classifier_model_fn, devices, params={"optimizer": "momentum"})
    copies = _copies(graph)
    # Every trained variable and its Momentum slot, on every other device.
    self.assertEqual(
        sorted(copies),
        sorted(f"{layer}/{kind}{slot}" for layer in ("hidden", "logits")
               for kind in ("kernel", "bias") for slot in ("", "/Momentum")))
    # Tower i's forward pass reads tower i's copy.
    self._assert_each_tower_reads_its_copy(graph, copies, devices, True)
    # Each device applies the update to its own copy; no optimizer work and
    # no summed gradient on the host.
    applies = [
        op for op in graph.get_operations()
        if op.type == "ResourceApplyMomentum"
    ]
    self.assertLen(applies, 4 * num_towers)
    self.assertEqual(sorted({op.device for op in applies}), sorted(devices))
    # The host splits the batch and merges the outputs, nothing else.
    for op in graph.get_operations():
      if op.device == "/device:CPU:0":
        self.assertTrue(
            op.name.startswith(("split_inputs/", "merge_towers/")), op.name)

  def _assert_each_tower_reads_its_copy(self, graph, copies, devices,
                                        through_read_op):
    """Originals on tower 0's device, a copy on each other tower's, and tower
    i's first layer reading tower i's copy."""
    for name, own in copies.items():
      self.assertEqual(
          graph.get_operation_by_name(name).device, devices[0], name)
      self.assertEqual([c.device for c in own], devices[1:])
    for index in range(1, len(devices)):
      read = graph.get_operation_by_name(f"tower_{index}/hidden/MatMul")
      kernel = read.inputs[1].op
      if through_read_op:
        self.assertEqual(kernel.type, "ReadVariableOp")
      self.assertEqual(kernel.inputs[0].op.name, f"tower_{index}/hidden/kernel")
      self.assertEqual(kernel.device, devices[index])

  @parameterized.parameters(tf.estimator.ModeKeys.EVAL,
                            tf.estimator.ModeKeys.PREDICT)
  def test_evaluation_and_prediction_read_each_devices_copy(self, mode):
    num_towers = 3
    devices = harness.devices(harness.VIRTUAL_CPUS, num_towers + 1)[1:]
    graph = _train_graph(
        models.classifier_model_fn, devices, params={}, mode=mode)
    copies = _copies(graph)
    self.assertEqual(
        sorted(copies),
        sorted(f"{layer}/{kind}" for layer in ("hidden", "logits")
               for kind in ("kernel", "bias")))
    self._assert_each_tower_reads_its_copy(graph, copies, devices, False)

  def test_evaluation_and_prediction_from_a_checkpoint_are_one_devices(self):
    # Trained, evaluated and predicted from one checkpoint: every copy is
    # filled from the restored original when the session starts.
    summary = replicate.testing.assert_replicates(
        models.classifier_model_fn,
        lambda: tf.data.Dataset.from_tensor_slices(models.data(40)).repeat().
        batch(7),
        towers=(3,),
        params={},
        variable_placement=MIRRORED)
    self.assertIn("accuracy", summary.metrics)
    self.assertGreater(summary.predictions, 0)

  def test_load_after_initialisation_reaches_the_copies(self):

    def check(graph, session):
      primaries = {v.op.name: v for v in tf.compat.v1.global_variables()}
      for name, own in _copies(graph).items():
        value = session.run(primaries[name])
        for copy in own:
          np.testing.assert_array_equal(session.run(copy), value)

    # _build_and_run loads the weights after the global initialiser and
    # before the local one; load them once more after both.
    with tf.Graph().as_default() as graph:
      tf.compat.v1.train.create_global_step()
      features, labels = harness.batches(models.data(), BATCH)
      spec = harness.wrap(
          models.classifier_model_fn,
          harness.devices(harness.VIRTUAL_CPUS, 2),
          placement=MIRRORED)(features, labels, tf.estimator.ModeKeys.TRAIN, {})
      with tf.compat.v1.Session(
          config=harness.session_config(harness.VIRTUAL_CPUS)) as session:
        session.run([
            tf.compat.v1.global_variables_initializer(),
            tf.compat.v1.local_variables_initializer()
        ])
        harness.set_trainable_weights(session)
        copies = _copies(graph)
        kernel = [
            v for v in tf.compat.v1.global_variables()
            if v.op.name == "hidden/kernel"
        ][0]
        np.testing.assert_array_equal(
            session.run(copies["hidden/kernel"][0]), session.run(kernel))
        session.run(spec.train_op)
        check(graph, session)

  @parameterized.parameters(("keras", 3), ("v1", 4), ("v1_rewrite", 3),
                            ("keras_float16", 2))
  def test_a_dynamic_loss_scale_is_mirrored_and_one_devices(
      self, spelling, num_towers):
    self._assert_dynamic_loss_scale_is_mirrored(spelling, num_towers)

  @parameterized.parameters(("keras", 2), ("v1", 2))
  @pytest.mark.wide
  def test_a_dynamic_loss_scale_is_mirrored_and_one_devices_wide(
      self, spelling, num_towers):
    self._assert_dynamic_loss_scale_is_mirrored(spelling, num_towers)

  def _assert_dynamic_loss_scale_is_mirrored(self, spelling, num_towers):
    # The update sits in the scale's tf.cond (a function body): each
    # device runs its own copy of the body, on its copies. The scale
    # starts at an overflow (the first steps skip and halve it), then grows
    # every second finite step.
    model_fn = functools.partial(_loss_scaled_model_fn, spelling=spelling)
    expected_losses, expected = harness.train(model_fn, models.data(), BATCH, 8)
    scales = []

    def check(graph, session):
      copies = _copies(graph)
      primaries = {v.op.name: v for v in tf.compat.v1.global_variables()}
      self.assertIn("logits/kernel", copies)
      for name, own in copies.items():
        value = session.run(primaries[name])
        for copy in own:
          np.testing.assert_array_equal(session.run(copy), value, copy.name)
      scale = [n for n in copies if "loss_scale" in n or n.endswith("/scale")]
      self.assertNotEmpty(scale, sorted(copies))
      scales.append(float(session.run(primaries[scale[0]])))

    _build_and_run(model_fn, num_towers, 8, check, batch=BATCH)
    if spelling != "keras_float16":
      self.assertLess(min(scales), 2.0**126)  # it shrank, skipping steps
    self.assertGreater(scales[-1], min(scales))  # and grew
    losses, values = harness.train(
        model_fn,
        models.data(),
        BATCH,
        8,
        tower_devices=harness.devices(harness.VIRTUAL_CPUS, num_towers),
        placement=MIRRORED)
    # In float16 a float32 weight one ulp apart can round a logit to the
    # next float16 (2**-11 relative): agreement to float16's precision.
    rtol = 2e-3 if spelling == "keras_float16" else 1e-5
    np.testing.assert_allclose(losses, expected_losses, rtol=rtol)
    self.assertEqual(sorted(values), sorted(expected))
    harness.assert_close_nests(values, expected, rtol=100 * rtol, atol=1e-5)

  def test_keras_batch_norm_layers_are_mirrored(self):
    # Their tf.cond reads the variables (read-only function inputs).
    graph = _train_graph(_keras_batch_norm_model_fn,
                         harness.devices(harness.VIRTUAL_CPUS, 2))
    names = sorted(_copies(graph))
    self.assertLen(names, 12)  # 6 trained variables and their Momentum slots
    self.assertTrue(any("batch_normalization/gamma" in n for n in names))

  def test_a_variable_written_outside_the_update_is_not_mirrored(self):
    with self.assertLogs("absl", "WARNING") as logs:
      graph = _train_graph(_clipped_before_use_model_fn,
                           harness.devices(harness.VIRTUAL_CPUS, 2))
    self.assertEqual(_copies(graph), {})
    self.assertTrue(
        any("also written by" in line and "kernel" in line
            for line in logs.output), logs.output)


class DefaultTest(parameterized.TestCase):

  @unittest.skipIf(conftest.forced_placement(),
                   "--replicate-placement changes the default")
  def test_gpu_towers_are_mirrored_by_default_cpu_towers_shared(self):
    for devices, mirrored in ((["/gpu:0",
                                "/gpu:1"], True), (["/cpu:1",
                                                    "/cpu:2"], False)):
      graph = _train_graph(models.classifier_model_fn, devices, placement=None)
      self.assertEqual(bool(_copies(graph)), mirrored, devices)

  def test_gpu_names_on_cpu_train_as_one_device(self):
    # GPU names with soft placement: the default (MIRRORED) runs on CPU.
    expected_losses, expected = _one_device()
    losses, values = harness.train(
        models.classifier_model_fn,
        models.data(),
        BATCH,
        STEPS,
        tower_devices=harness.devices(harness.GPU_NAMES, 4),
        placement=None,
        kind=harness.GPU_NAMES)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    harness.assert_close_nests(values, expected, rtol=1e-4, atol=1e-5)


class _CopiesAtStart(tf.estimator.SessionRunHook):
  """Reads every copy once the session exists, before the first step."""

  def begin(self):
    self._reads = {
        name: [copy.read_value() for copy in own]
        for name, own in _copies().items()
    }
    self.values = None

  def after_create_session(self, session, coord):
    del coord
    self.values = session.run(self._reads)


class CheckpointTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self._directory = tempfile.mkdtemp()

  def tearDown(self):
    shutil.rmtree(self._directory, ignore_errors=True)
    super().tearDown()

  def _estimator(self, name, devices, placement):
    model_fn = models.classifier_model_fn
    if devices:
      model_fn = replicate.replicate_model_fn(
          model_fn, devices=devices, variable_placement=placement)
    return tf.estimator.Estimator(
        model_fn,
        model_dir=os.path.join(self._directory, name),
        params={"optimizer": "adam"},
        config=tf.estimator.RunConfig(
            session_config=harness.session_config(harness.VIRTUAL_CPUS),
            tf_random_seed=3))

  def _input_fn(self):
    return tf.data.Dataset.from_tensor_slices(
        models.data()).repeat().batch(BATCH)

  def test_checkpoints_restore_both_ways(self):
    mirrored = harness.devices(harness.VIRTUAL_CPUS, 4)
    start = self._estimator("start", None, None)
    start.train(self._input_fn, steps=1)
    for name in ("mirrored", "plain"):
      shutil.copytree(start.model_dir, os.path.join(self._directory, name))
    first = self._estimator("mirrored", mirrored, MIRRORED)
    first.train(self._input_fn, steps=3)
    plain = self._estimator("plain", None, None)
    plain.train(self._input_fn, steps=3)
    names = sorted(
        name for name, _ in tf.train.list_variables(first.latest_checkpoint()))
    # One copy of each variable and slot, under the unwrapped names.
    self.assertNotIn("tower_", " ".join(names))
    self.assertEqual(
        names,
        sorted(
            name
            for name, _ in tf.train.list_variables(plain.latest_checkpoint())))
    for name in names:
      np.testing.assert_allclose(
          first.get_variable_value(name),
          plain.get_variable_value(name),
          rtol=1e-4,
          atol=1e-5,
          err_msg=name)
    # MIRRORED -> plain and SHARED, and back into MIRRORED on 2 towers.
    for target, devices, placement in (("to_plain", None, None),
                                       ("to_shared", mirrored[:3], "shared"),
                                       ("back", mirrored[:2], MIRRORED)):
      shutil.copytree(first.model_dir, os.path.join(self._directory, target))
      estimator = self._estimator(target, devices, placement)
      estimator.train(self._input_fn, steps=2)
      self.assertEqual(estimator.get_variable_value("global_step"), 6)
    for name in names:
      values = [
          self._estimator(target, None, None).get_variable_value(name)
          for target in ("to_plain", "to_shared", "back")
      ]
      for value in values[1:]:
        np.testing.assert_allclose(
            value, values[0], rtol=1e-4, atol=1e-5, err_msg=name)

  @parameterized.parameters("warm_start_from", "init_from_checkpoint")
  def test_warm_started_values_reach_every_copy_before_the_first_step(
      self, how):
    source = self._estimator("source", None, None)
    source.train(self._input_fn, steps=2)
    checkpoint = source.latest_checkpoint()
    model_fn = models.classifier_model_fn
    if how == "init_from_checkpoint":

      def model_fn(features, labels, mode, params):  # pylint: disable=function-redefined
        spec = models.classifier_model_fn(features, labels, mode, params)
        tf.compat.v1.train.init_from_checkpoint(checkpoint, {
            "hidden/": "hidden/",
            "logits/": "logits/"
        })
        return spec

    estimator = tf.estimator.Estimator(
        replicate.replicate_model_fn(
            model_fn,
            devices=harness.devices(harness.VIRTUAL_CPUS, 3),
            variable_placement=MIRRORED),
        model_dir=os.path.join(self._directory, how),
        params={"optimizer": "adam"},
        config=tf.estimator.RunConfig(
            session_config=harness.session_config(harness.VIRTUAL_CPUS)),
        warm_start_from=source.model_dir if how == "warm_start_from" else None)
    hook = _CopiesAtStart()
    estimator.train(self._input_fn, steps=1, hooks=[hook])
    warmed = [name for name in hook.values if "/Adam" not in name]
    self.assertLen(warmed, 4)
    for name in warmed:
      for value in hook.values[name]:
        np.testing.assert_array_equal(value,
                                      tf.train.load_variable(checkpoint, name),
                                      name)

  def test_restored_values_reach_every_copy_before_the_first_step(self):
    source = self._estimator("source", None, None)
    source.train(self._input_fn, steps=2)
    checkpoint = source.latest_checkpoint()
    devices = harness.devices(harness.VIRTUAL_CPUS, 3)
    with tf.Graph().as_default() as graph:
      tf.compat.v1.train.create_global_step()
      features, labels = harness.batches(models.data(), BATCH)
      replicate.replicate_model_fn(
          models.classifier_model_fn,
          devices=devices,
          variable_placement=MIRRORED)(features, labels,
                                       tf.estimator.ModeKeys.TRAIN, {
                                           "optimizer": "adam"
                                       })
      copies = _copies(graph)
      self.assertNotEmpty(copies)
      reads = {
          name: [copy.read_value() for copy in own]
          for name, own in copies.items()
      }
      with tf.compat.v1.train.MonitoredSession(
          tf.compat.v1.train.ChiefSessionCreator(
              checkpoint_filename_with_path=checkpoint,
              config=harness.session_config(harness.VIRTUAL_CPUS))) as session:
        for name, own in reads.items():
          restored = tf.train.load_variable(checkpoint, name)
          for read in own:
            np.testing.assert_array_equal(session.run(read), restored, name)


if __name__ == "__main__":
  tf.test.main()
