"""Where variables and ops land, and what they are called."""

import shutil
import tempfile

from absl.testing import parameterized
import pytest
import tensorflow as tf

import replicate
from replicate._prepare import devices as _devices
from tests import harness
from tests import models

TRAIN = tf.estimator.ModeKeys.TRAIN
CPUS = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2", "/device:CPU:3"]
GPUS = ["/device:GPU:0", "/device:GPU:1", "/device:GPU:2", "/device:GPU:3"]


def _build(model_fn,
           tower_devices=None,
           placement="shared",
           params=None,
           mode=TRAIN,
           batch=8,
           config=None):
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = models.data(batch)
    features = {"x": tf.constant(features["x"])}
    labels = tf.constant(labels)
    graph.ops_before_model_fn = len(graph.get_operations())
    spec = harness.wrap(
        model_fn, tower_devices, placement=placement)(features, labels, mode,
                                                      params or {}, **({
                                                          "config": config
                                                      } if config else {}))
  return graph, spec


def _trainable(graph):
  return {
      v.op.name: v
      for v in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
  }


class PlacementTest(parameterized.TestCase):

  def test_shared_puts_every_variable_on_the_host_and_ops_on_towers(self):
    graph, _ = _build(models.classifier_model_fn, GPUS)
    for variable in graph.get_collection(
        tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
      if variable.op.name != "global_step":
        self.assertEqual(variable.device, "/device:CPU:0", variable.op.name)
    for index in range(4):
      prefix = f"tower_{index}/" if index else ""
      matmul = graph.get_operation_by_name(prefix + "hidden/MatMul")
      self.assertEqual(matmul.device, GPUS[index])
      # One backward pass for the whole batch; each tower's part on its device.
      gradient = graph.get_operation_by_name(
          f"gradients/{prefix}hidden/MatMul_grad/MatMul")
      self.assertEqual(gradient.device, GPUS[index])

  def test_summed_gradients_are_applied_on_the_consolidation_device(self):
    graph, _ = _build(models.classifier_model_fn, GPUS)
    self.assertEqual(
        graph.get_operation_by_name("Adagrad/learning_rate").device,
        "/device:CPU:0")
    update = graph.get_operation_by_name(
        "Adagrad/update_hidden/kernel/ResourceApplyAdagrad")
    self.assertIn(b"loc:@hidden/kernel", update.colocation_groups())

  def test_single_gpu_is_the_consolidation_device(self):
    graph, _ = _build(models.classifier_model_fn, GPUS[:1])
    for variable in _trainable(graph).values():
      self.assertEqual(variable.device, "/device:GPU:0")

  def test_round_robin_spreads_variables_one_after_another(self):
    graph, _ = _build(models.classifier_model_fn, GPUS, "round_robin")
    devices = [
        v.device for v in graph.get_collection(
            tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
    ]
    self.assertEqual(devices, GPUS)  # hidden/kernel, bias, logits/kernel, bias
    slot = graph.get_operation_by_name("logits/kernel/Adagrad")
    self.assertEqual(slot.device, GPUS[2])  # slots live with their variable

  def test_round_robin_balances_bytes_moving_statistics_counted(self):
    self._check_round_robin_balances_bytes(4)

  @pytest.mark.wide
  def test_round_robin_balances_bytes_moving_statistics_counted_on_2(self):
    self._check_round_robin_balances_bytes(2)

  def _check_round_robin_balances_bytes(self, n):
    # Layers of very different sizes, with batch norm's moving statistics
    # created among them: one variable after another would put every
    # kernel on the even devices and the small vectors on the odd ones.
    def model_fn(features, labels, mode):
      x = features["x"]
      for width in (256, 256, 16):
        x = tf.compat.v1.layers.dense(x, width)
        x = tf.compat.v1.layers.batch_normalization(x, training=True)
      logits = tf.compat.v1.layers.dense(x, 3, name="logits")
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
      with tf.control_dependencies(
          tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
        train_op = opt.minimize(loss, tf.compat.v1.train.get_global_step())
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    graph, _ = _build(model_fn, GPUS[:n], "round_robin")
    held = {device: 0 for device in GPUS[:n]}
    sizes = []
    for variable in graph.get_collection(
        tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
      if variable.op.name == "global_step":
        continue
      size = variable.shape.num_elements() * variable.dtype.size
      held[variable.device] += size
      sizes.append(size)
    mean = sum(held.values()) / n
    # Greedy by bytes: no device holds more than the mean plus the largest
    # variable, and each device holds something.
    self.assertLessEqual(max(held.values()), mean + max(sizes))
    self.assertTrue(all(held.values()), held)

  def test_explicit_device_in_the_model_fn_is_kept(self):

    def model_fn(features, labels, mode):
      with tf.device("/device:CPU:0"):
        pinned = tf.identity(features["x"], name="pinned")
      logits = tf.compat.v1.layers.dense(pinned, 3, name="logits")
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      opt = replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1))
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, train_op=opt.minimize(loss))

    graph, _ = _build(model_fn, GPUS[:2])
    self.assertEqual(
        graph.get_operation_by_name("tower_1/pinned").device, "/device:CPU:0")
    self.assertEqual(
        graph.get_operation_by_name("tower_1/logits/MatMul").device, GPUS[1])

  def test_one_device_adds_no_ops_and_keeps_every_name(self):
    plain, _ = _build(models.classifier_model_fn)
    one, _ = _build(models.classifier_model_fn, GPUS[:1])
    self.assertEqual([op.name for op in one.get_operations()],
                     [op.name for op in plain.get_operations()])
    model_ops = one.get_operations()[one.ops_before_model_fn:]
    self.assertEqual({op.device for op in model_ops}, {"/device:GPU:0", ""})
    for op in model_ops:
      if not op.device:  # placed by TensorFlow with the variable they touch
        colocated = [
            g for g in op.colocation_groups()
            if g != b"loc:@" + op.name.encode()
        ]
        self.assertTrue(op.type == "ReadVariableOp" or colocated, op.name)
    self.assertEqual({op.device for op in plain.get_operations()}, {""})


class NamesTest(parameterized.TestCase):

  @parameterized.parameters("v1", "keras")
  def test_variables_are_those_of_the_unwrapped_model(self, layers):
    params = {"layers": layers}
    plain, _ = _build(models.classifier_model_fn, params=params)
    for n in (2, 4):
      graph, _ = _build(models.classifier_model_fn, GPUS[:n], params=params)
      self.assertEqual(sorted(_trainable(graph)), sorted(_trainable(plain)))
      names = lambda g: sorted(
          v.op.name
          for v in g.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))
      self.assertEqual(names(graph), names(plain))

  def test_tower_zero_has_unwrapped_op_names_and_others_a_prefix(self):
    plain, _ = _build(models.classifier_model_fn)
    graph, _ = _build(models.classifier_model_fn, GPUS[:2])
    names = {op.name for op in graph.get_operations()}
    for op in plain.get_operations():
      if op.name.startswith(
          ("hidden/", "logits/")) and "Initializer" not in op.name:
        self.assertIn(op.name, names)
    self.assertIn("tower_1/hidden/MatMul", names)
    self.assertNotIn("tower_1/hidden/kernel", names)  # variables not duplicated


class CurrentTowerTest(parameterized.TestCase):

  def test_current_tower_inside_and_outside(self):
    seen = []

    def model_fn(features, labels, mode):
      seen.append(replicate.current_tower())
      logits = tf.compat.v1.layers.dense(features["x"], 3, name="logits")
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      opt = replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1))
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, train_op=opt.minimize(loss))

    self.assertIsNone(replicate.current_tower())
    _build(model_fn, GPUS[:3])
    # Towers are built 1, ..., N-1, then 0.
    self.assertEqual([(t.index, t.num_towers, t.device) for t in seen],
                     [(i, 3, GPUS[i]) for i in (1, 2, 0)])
    _build(model_fn, GPUS[:1])
    self.assertEqual(tuple(seen[-1]), (0, 1, GPUS[0]))
    self.assertIsNone(replicate.current_tower())


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()


class EstimatorSessionCpusTest(parameterized.TestCase):
  """CPUs of the logical split (conftest.py) that the Estimator's session lacks.

  An Estimator opens its sessions with its RunConfig's session_config,
  which has one CPU unless `device_count` asks for more, whatever the
  logical split; the model_fn gets a copy of that RunConfig.
  """

  def setUp(self):
    super().setUp()
    _devices._WARNED_SESSION_CPUS.clear()  # pylint: disable=protected-access

  def _config(self, session_config=None):
    """The RunConfig an Estimator hands its model_fn."""
    model_dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, model_dir)
    return tf.estimator.Estimator(
        models.classifier_model_fn,
        model_dir=model_dir,
        config=tf.estimator.RunConfig(session_config=session_config)).config

  def _warnings(self, tower_devices, config):
    with self.assertLogs("absl", "INFO") as logs:
      for mode in (TRAIN, tf.estimator.ModeKeys.EVAL, TRAIN):
        _build(
            models.classifier_model_fn, tower_devices, mode=mode, config=config)
    return [r.getMessage() for r in logs.records if r.levelname == "WARNING"]

  def test_cpus_the_session_lacks_are_named_once_with_the_fix(self):
    warnings = self._warnings(CPUS, self._config())
    self.assertLen(warnings, 1)  # one line, not one per model_fn call
    self.assertIn(
        "devices ['/device:CPU:1', '/device:CPU:2', "
        "'/device:CPU:3'] are CPUs of this process's logical split "
        "that the Estimator's session will not have", warnings[0])
    self.assertIn(
        "RunConfig(session_config=replicate.testing."
        "session_config(4))", warnings[0])
    self.assertIn("device_count={'CPU': 4}", warnings[0])

  def test_a_session_with_too_few_cpus_names_only_the_missing(self):
    two = tf.compat.v1.ConfigProto(
        device_count={"CPU": 2}, allow_soft_placement=True)
    warnings = self._warnings(CPUS[:3], self._config(two))
    self.assertLen(warnings, 1)
    self.assertIn("devices ['/device:CPU:2'] are CPUs", warnings[0])
    self.assertIn("session_config(3)", warnings[0])

  def test_a_session_with_the_cpus_gets_no_warning(self):
    config = self._config(replicate.testing.session_config(4))
    self.assertEmpty(self._warnings(CPUS, config))

  def test_without_soft_placement_the_missing_cpus_are_an_error(self):
    config = self._config(tf.compat.v1.ConfigProto(allow_soft_placement=False))
    with self.assertRaisesRegex(
        ValueError, r"Devices \['/device:CPU:1'\] are CPUs .* does not allow "
        r"soft placement.*session_config\(2\)"):
      _build(models.classifier_model_fn, CPUS[:2], config=config)

  def test_towers_run_on_their_cpus_only_in_a_session_that_has_them(self):
    config = self._config()
    graph, spec = _build(models.classifier_model_fn, CPUS[:2], config=config)
    with_cpus = replicate.testing.session_config(4, config.session_config)
    # Where tower 1's ops ran, from the session's own step statistics.
    ran_on = {}
    for name, session_config in (("estimator", config.session_config),
                                 ("four_cpus", with_cpus)):
      with graph.as_default(), tf.compat.v1.Session(
          config=session_config) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        metadata = tf.compat.v1.RunMetadata()
        session.run(
            spec.train_op,
            options=tf.compat.v1.RunOptions(
                trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
            run_metadata=metadata)
      ran_on[name] = {
          tf.DeviceSpec.from_string(stats.device).device_index
          for stats in metadata.step_stats.dev_stats
          for node in stats.node_stats
          if node.node_name.startswith("tower_1/hidden/")
      }
    self.assertEqual(ran_on["estimator"], {0})  # serialised, as warned
    self.assertIn(1, ran_on["four_cpus"])


class InitialWeightsTest(parameterized.TestCase):

  def test_unseeded_initializers_start_equal_after_set_random_seed(self):

    def model_fn(features, labels, mode, params):
      del params
      hidden = tf.keras.layers.Dense(8, activation="relu")(features["x"])
      logits = tf.compat.v1.layers.dense(hidden, 3)
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      opt = replicate.TowerOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1))
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, train_op=opt.minimize(loss))

    def initial_values(tower_devices):
      tf.keras.utils.set_random_seed(42)
      graph, _ = _build(model_fn, tower_devices)
      with graph.as_default(), tf.compat.v1.Session(
          config=harness.session_config(harness.GPU_NAMES)) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        return {name: session.run(v) for name, v in _trainable(graph).items()}

    expected = initial_values(None)
    harness.assert_close_nests(initial_values(GPUS), expected, rtol=0, atol=0)
