"""Every bad input gets an error that names the value and the fix: a
TypeError for a wrong type, a ValueError for a wrong value."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import replicate
from tests import models

TRAIN = tf.estimator.ModeKeys.TRAIN
EVAL = tf.estimator.ModeKeys.EVAL
GPUS = ["/device:GPU:0", "/device:GPU:1"]


def _linear_model_fn(optimizer_fn=None, metrics_fn=None):

  def model_fn(features, labels, mode):
    logits = tf.compat.v1.layers.dense(features["x"], 3, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    if mode == EVAL:
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, eval_metric_ops=metrics_fn(labels, logits))
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=optimizer_fn(loss))

  return model_fn


def _call(model_fn, mode=TRAIN, devices=GPUS, batch=8, **kwargs):
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = models.data(batch)
    fn = replicate.replicate_model_fn(model_fn, devices=devices, **kwargs)
    return fn({"x": tf.constant(features["x"])}, tf.constant(labels), mode)


def _sgd():
  return tf.compat.v1.train.GradientDescentOptimizer(0.1)


class ArgumentErrorsTest(parameterized.TestCase):

  def test_a_reduction_that_is_not_a_string_is_a_type_error(self):
    with self.assertRaisesRegex(
        TypeError, r"loss_reduction=2 is of type int, not a "
        r"loss reduction; pass one of "
        r"tf.compat.v1.losses.Reduction"):
      replicate.replicate_model_fn(models.classifier_model_fn, loss_reduction=2)

  def test_unknown_reduction_is_refused(self):
    with self.assertRaisesRegex(ValueError,
                                "'mean-ish' is not a loss reduction"):
      replicate.replicate_model_fn(
          models.classifier_model_fn, loss_reduction="mean-ish")

  def test_keras_reduction_names_are_accepted(self):
    replicate.replicate_model_fn(
        models.classifier_model_fn, loss_reduction="sum_over_batch_size")

  @parameterized.parameters(
      ("/gpu:0", r"devices='/gpu:0' is of type str; pass a list of device "
       "names"),
      (7, "devices=7 is of type int; pass a list"),
      ([3], "Device 3 is of type int, not a device name"),
  )
  def test_devices_of_a_wrong_type_are_a_type_error(self, devices, message):
    with self.assertRaisesRegex(TypeError, message):
      replicate.replicate_model_fn(models.classifier_model_fn, devices=devices)

  @parameterized.parameters(
      ([], "names no device"),
      (["/gpu:0", ""], "Device '' is empty"),
      (["/gpu:0", "/job:worker/task:1"], "needs a type and an index"),
      (["/gpu:0", "/device:GPU"], "not a valid device name"),
      (["/gpu:0", "/device:GPU:0"], r"'/device:GPU:0' is listed twice.*as "
       r"'/device:GPU:0'"),
      (["/gpu:0", "gpu!1"], "'gpu!1' is not a valid device name"),
  )
  def test_bad_devices_are_refused(self, devices, message):
    with self.assertRaisesRegex(ValueError, message):
      replicate.replicate_model_fn(models.classifier_model_fn, devices=devices)

  def test_devices_are_canonicalised(self):
    seen = []

    def model_fn(features, labels, mode):
      seen.append(replicate.current_tower().device)
      return _linear_model_fn(
          lambda loss: replicate.TowerOptimizer(_sgd()).minimize(loss))(
              features, labels, mode)

    _call(model_fn, devices=["/gpu:1", "/job:worker/task:0/device:cpu:0"])
    # Towers are built 1, ..., N-1, then 0.
    self.assertEqual(seen, ["/job:worker/task:0/device:CPU:0", "/device:GPU:1"])

  def test_bad_placement_is_refused(self):
    with self.assertRaisesRegex(
        ValueError, "'mirror' is not supported.*"
        "'shared', 'round_robin', 'mirrored'"):
      replicate.replicate_model_fn(
          models.classifier_model_fn, variable_placement="mirror")

  def test_placement_of_a_wrong_type_is_a_type_error(self):
    with self.assertRaisesRegex(
        TypeError, "variable_placement=3 is of type int; pass a "
        "replicate.VariablePlacement"):
      replicate.replicate_model_fn(
          models.classifier_model_fn, variable_placement=3)

  def test_model_fn_must_be_callable(self):
    with self.assertRaisesRegex(
        TypeError, "model_fn='model_fn' is of type str, not a function"):
      replicate.replicate_model_fn("model_fn")

  def test_sync_batch_norm_must_be_a_bool(self):
    with self.assertRaisesRegex(
        TypeError, "sync_batch_norm='yes' is of type str; pass True"):
      replicate.replicate_model_fn(
          models.classifier_model_fn, sync_batch_norm="yes")

  def test_tower_optimizer_needs_an_optimizer(self):
    with self.assertRaisesRegex(TypeError,
                                "TowerOptimizer got 0.1 of type float"):
      replicate.TowerOptimizer(0.1)

  def test_optimizer_fn_must_return_an_optimizer(self):
    model_fn = _linear_model_fn(
        lambda loss: replicate.TowerOptimizer(lambda: "adam").minimize(loss))
    with self.assertRaisesRegex(TypeError, "returned 'adam' of type str"):
      _call(model_fn)


class ModelFnErrorsTest(parameterized.TestCase):

  def test_optimizer_that_cannot_be_routed(self):
    # A mock's `minimize` is an attribute of the instance, not a method of
    # an optimizer class, so the towers cannot share its call.
    optimizer = tf.compat.v1.test.mock.NonCallableMagicMock(
        spec=tf.compat.v1.train.Optimizer)
    optimizer.minimize = tf.compat.v1.test.mock.MagicMock(
        side_effect=lambda loss, global_step=None: tf.no_op())
    model_fn = _linear_model_fn(optimizer.minimize)
    with self.assertRaisesRegex(
        ValueError, "made no optimizer call the "
        "towers could share.*a mock.*Wrap the "
        "optimizer in replicate.TowerOptimizer"):
      _call(model_fn)

  def test_optimizer_not_wrapped_is_fine_on_one_device(self):
    spec = _call(
        _linear_model_fn(lambda loss: _sgd().minimize(loss)), devices=GPUS[:1])
    self.assertIsNotNone(spec.train_op)

  def test_towers_making_different_optimizer_calls(self):

    def optimizer_fn(loss):
      train_op = replicate.TowerOptimizer(_sgd()).minimize(loss)
      if replicate.current_tower().index == 0:
        replicate.TowerOptimizer(_sgd()).minimize(loss)
      return train_op

    with self.assertRaisesRegex(
        ValueError, r"Tower 0 made call 2 that needs every tower, "
        r"TowerOptimizer.minimize, but tower 1 made only 1.*Python counter"):
      _call(_linear_model_fn(optimizer_fn))

  def test_towers_updating_different_variables(self):

    def optimizer_fn(loss):
      variables = tf.compat.v1.trainable_variables()
      if replicate.current_tower().index == 1:
        variables = variables[:1]
      return replicate.TowerOptimizer(_sgd()).minimize(loss, var_list=variables)

    with self.assertRaisesRegex(
        ValueError, r"different calls.*tower 1 is TowerOptimizer.minimize of "
        r"\['logits/kernel'\] but tower 0's is .* of \['logits/kernel', "
        r"'logits/bias'\].*same variables"):
      _call(_linear_model_fn(optimizer_fn))

  def test_towers_returning_different_metrics(self):

    def metrics_fn(labels, logits):
      metrics = {
          "accuracy":
              tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1))
      }
      if replicate.current_tower().index == 1:
        metrics["mean"] = tf.compat.v1.metrics.mean(logits)
      return metrics

    with self.assertRaisesRegex(
        ValueError, r"Tower 1 returned eval_metric_ops "
        r"\['accuracy', 'mean'\] but tower 0 returned"):
      _call(_linear_model_fn(metrics_fn=metrics_fn), mode=EVAL)

  def test_tower_creating_a_variable_tower_zero_did_not(self):

    def model_fn(features, labels, mode):
      logits = tf.keras.layers.Dense(3)(features["x"])
      if replicate.current_tower().index == 1:
        logits += tf.Variable(0.0, name="extra")
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      opt = replicate.TowerOptimizer(_sgd())
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, train_op=opt.minimize(loss))

    with self.assertRaisesRegex(
        ValueError, r"Towers 0 and 1 built different "
        r"models: tower 1 computes rows with AddV2 op "
        r"'tower_1/add', which tower 0 has no "):
      _call(model_fn)

  def test_nested_replication_is_refused(self):
    inner = replicate.replicate_model_fn(
        _linear_model_fn(
            lambda loss: replicate.TowerOptimizer(_sgd()).minimize(loss)),
        devices=GPUS)
    with self.assertRaisesRegex(ValueError,
                                "inside another replicated model_fn"):
      _call(inner)

  def test_labels_given_to_a_model_fn_without_labels(self):

    def model_fn(features, mode):
      del features, mode

    with self.assertRaisesRegex(ValueError, "takes no `labels` argument"):
      _call(model_fn)


class InputErrorsTest(parameterized.TestCase):

  def _split(self, features, labels=None):
    model_fn = _linear_model_fn(
        lambda loss: replicate.TowerOptimizer(_sgd()).minimize(loss))
    with tf.Graph().as_default():
      tf.compat.v1.train.create_global_step()
      replicate.replicate_model_fn(
          model_fn, devices=GPUS)(features, labels, TRAIN)

  def test_scalar_feature_is_refused(self):
    with self.assertRaisesRegex(
        ValueError, r"`features\['scale'\]` is a "
        "scalar and has no batch dimension"):
      self._split({
          "x": np.zeros((4, 5), np.float32),
          "scale": 2.0
      }, np.zeros(4, np.int64))

  def test_different_batch_sizes_are_refused(self):
    with self.assertRaisesRegex(
        ValueError, r"different batch sizes "
        r"\(`features\['x'\]`: 4, `labels`: 6\)"):
      self._split({"x": np.zeros((4, 5), np.float32)}, np.zeros(6, np.int64))

  def test_non_tensor_feature_is_refused(self):
    with self.assertRaisesRegex(
        TypeError, r"`features\['f'\]` of type "
        "object cannot be split"):
      self._split({
          "x": np.zeros((4, 5), np.float32),
          "f": object()
      }, np.zeros(4, np.int64))


class MissingDevicesTest(parameterized.TestCase):
  """Names are checked against this process's devices: CPU:0..3 here."""

  def _build(self, devices, config=None):
    model_fn = _linear_model_fn(
        lambda loss: replicate.TowerOptimizer(_sgd()).minimize(loss))
    with tf.Graph().as_default():
      tf.compat.v1.train.create_global_step()
      features, labels = models.data(8)
      return replicate.replicate_model_fn(
          model_fn, devices=devices)({
              "x": tf.constant(features["x"])
          },
                                     tf.constant(labels),
                                     TRAIN,
                                     config=config)

  def test_unknown_device_type_lists_the_local_devices(self):
    with self.assertRaisesRegex(
        ValueError, r"Device '/device:CPUU:0' does not exist: this machine "
        r"has no CPUU device; the local devices are '/device:CPU:0', "
        r"'/device:CPU:1', '/device:CPU:2', '/device:CPU:3'.*Pass devices "
        r"from that list"):
      self._build(["/device:CPUU:0", "/device:CPU:1"])

  def test_missing_cpu_index_says_how_to_get_more(self):
    with self.assertRaisesRegex(
        ValueError, r"Device '/device:CPU:7' does not exist: this machine "
        r"has 4 CPU device\(s\).*set_logical_device_configuration.*"
        r"device_count=\{'CPU': N\}"):
      self._build(["/device:CPU:0", "/device:CPU:7"])

  def test_one_missing_device_is_refused_too(self):
    with self.assertRaisesRegex(ValueError, "'/cpu:7'|'/device:CPU:7'"):
      self._build(["/cpu:7"])

  def test_session_config_cpus_count(self):
    config = tf.estimator.RunConfig(
        session_config=tf.compat.v1.ConfigProto(device_count={"CPU": 8}))
    spec = self._build(["/device:CPU:0", "/device:CPU:7"], config=config)
    self.assertIsNotNone(spec.train_op)
    with self.assertRaisesRegex(ValueError, "has 8 CPU device"):
      self._build(["/device:CPU:0", "/device:CPU:8"], config=config)

  def test_devices_of_another_job_are_left_to_the_runtime(self):
    spec = self._build(["/job:worker/task:1/device:CPU:9", "/device:CPU:1"])
    self.assertIsNotNone(spec.train_op)

  def test_gpu_names_without_any_gpu_warn_once(self):
    if tf.config.list_logical_devices("GPU"):
      self.skipTest("this machine has a GPU")
    with self.assertLogs("absl", "WARNING") as logs:
      spec = self._build(GPUS)
    self.assertIsNotNone(spec.train_op)
    warnings = [
        r.getMessage() for r in logs.records if r.levelname == "WARNING"
    ]
    self.assertLen(warnings, 1)
    self.assertIn(
        "this machine has no GPU; devices ['/device:GPU:0', "
        "'/device:GPU:1'] run where soft placement puts them", warnings[0])


class RuntimeInputErrorsTest(parameterized.TestCase):
  """Batch sizes that only the running graph knows get a clear error."""

  def _run(self, features, labels, feed=None):
    model_fn = _linear_model_fn(
        lambda loss: replicate.TowerOptimizer(_sgd()).minimize(loss))
    with tf.Graph().as_default() as graph:
      tf.compat.v1.train.create_global_step()
      features, labels = features(), labels()
      spec = replicate.replicate_model_fn(
          model_fn, devices=GPUS)(features, labels, TRAIN)
      checks = {
          op.name.split("/")[1]
          for op in graph.get_operations()
          if op.name.startswith("split_inputs/check_")
      }
      with tf.compat.v1.Session(
          config=tf.compat.v1.ConfigProto(
              allow_soft_placement=True)) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        return checks, session.run(spec.loss, feed)

  @staticmethod
  def _dynamic(value, shape):
    return lambda: tf.compat.v1.placeholder_with_default(value, shape)

  def test_dynamic_batch_sizes_that_differ(self):
    x = np.zeros((4, 5), np.float32)
    with self.assertRaisesRegex(
        tf.errors.InvalidArgumentError, r"Batch size of `labels`:\] \[6\] "
        r"\[differs from that of `features\[\\?'x\\?'\]`:\] \[4\].*every "
        r"feature and label must have the same size in dimension 0.*batch "
        r"them together in the input_fn"):
      self._run(lambda: {"x": self._dynamic(x, [None, 5])()},
                self._dynamic(np.zeros(6, np.int64), [None]))

  def test_dynamic_labels_against_a_static_feature(self):
    x = np.zeros((4, 5), np.float32)
    with self.assertRaisesRegex(
        tf.errors.InvalidArgumentError, r"Batch size of `labels`:\] \[3\] "
        r"\[differs from that of `features\[\\?'x\\?'\]`:\] \[4\]"):
      self._run(lambda: {"x": tf.constant(x)},
                self._dynamic(np.zeros(3, np.int64), [None]))

  def test_unknown_rank_feature_fed_a_scalar(self):
    x = np.zeros((4, 5), np.float32)
    with self.assertRaisesRegex(
        tf.errors.InvalidArgumentError,
        r"`features\[\\?'scale\\?'\]` is a scalar and has no batch "
        "dimension to split across towers; give every feature and label a "
        "leading batch dimension"):
      self._run(
          lambda: {
              "x": self._dynamic(x, [None, 5])(),
              "scale": self._dynamic(2.0, None)()
          }, lambda: tf.constant(np.zeros(4, np.int64)))

  def test_checks_only_where_static_shapes_cannot_tell(self):
    x = np.zeros((4, 5), np.float32)
    labels = np.zeros(4, np.int64)
    checks, loss = self._run(lambda: {"x": tf.constant(x)},
                             lambda: tf.constant(labels))
    self.assertEqual(checks, set())
    self.assertTrue(np.isfinite(loss))
    checks, loss = self._run(lambda: {"x": self._dynamic(x, [None, 5])()},
                             self._dynamic(labels, [None]))
    self.assertEqual(checks, {"check_batch"})
    self.assertTrue(np.isfinite(loss))


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()
