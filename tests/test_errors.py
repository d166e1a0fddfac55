"""Every bad input gets a ValueError that names the value and the fix."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import replicate
from tests import models

TRAIN = tf.estimator.ModeKeys.TRAIN
EVAL = tf.estimator.ModeKeys.EVAL
R = tf.compat.v1.losses.Reduction
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

  def test_reduction_none_is_refused(self):
    with self.assertRaisesRegex(ValueError, r"Reduction.NONE is not supported.*"
                                r"Reduction.SUM"):
      replicate.replicate_model_fn(models.classifier_model_fn,
                                   loss_reduction=R.NONE)

  def test_unknown_reduction_is_refused(self):
    with self.assertRaisesRegex(ValueError, "'mean-ish' is not a loss reduction"):
      replicate.replicate_model_fn(models.classifier_model_fn,
                                   loss_reduction="mean-ish")

  def test_keras_reduction_names_are_accepted(self):
    replicate.replicate_model_fn(models.classifier_model_fn,
                                 loss_reduction="sum_over_batch_size")

  @parameterized.parameters(
      ([], "names no device"),
      ("/gpu:0", "must be a list of device names"),
      (["/gpu:0", ""], "'' is not a device name"),
      (["/gpu:0", "/job:worker/task:1"], "needs a type and an index"),
      (["/gpu:0", "/device:GPU"], "not a valid device name"),
      (["/gpu:0", "/device:GPU:0"], r"'/device:GPU:0' is listed twice.*as "
       r"'/device:GPU:0'"),
      (["/gpu:0", "gpu!1"], "'gpu!1' is not a valid device name"),
      ([3], "3 is not a device name"),
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
    self.assertEqual(seen, ["/device:GPU:1", "/job:worker/task:0/device:CPU:0"])

  def test_bad_placement_is_refused(self):
    with self.assertRaisesRegex(ValueError, "'mirrored' is not supported.*"
                                "'shared', 'round_robin'"):
      replicate.replicate_model_fn(models.classifier_model_fn,
                                   variable_placement="mirrored")

  def test_tower_optimizer_needs_an_optimizer(self):
    with self.assertRaisesRegex(ValueError, "TowerOptimizer got 0.1"):
      replicate.TowerOptimizer(0.1)

  def test_optimizer_fn_must_return_an_optimizer(self):
    model_fn = _linear_model_fn(
        lambda loss: replicate.TowerOptimizer(lambda: "adam").minimize(loss))
    with self.assertRaisesRegex(ValueError, "returned 'adam'"):
      _call(model_fn)


class ModelFnErrorsTest(parameterized.TestCase):

  def test_optimizer_not_wrapped_with_several_devices(self):
    model_fn = _linear_model_fn(lambda loss: _sgd().minimize(loss))
    with self.assertRaisesRegex(ValueError, "wrap the optimizer in "
                                "replicate.TowerOptimizer"):
      _call(model_fn)

  def test_optimizer_not_wrapped_is_fine_on_one_device(self):
    spec = _call(_linear_model_fn(lambda loss: _sgd().minimize(loss)),
                 devices=GPUS[:1])
    self.assertIsNotNone(spec.train_op)

  def test_towers_making_different_optimizer_calls(self):
    def optimizer_fn(loss):
      train_op = replicate.TowerOptimizer(_sgd()).minimize(loss)
      if replicate.current_tower().index == 0:
        replicate.TowerOptimizer(_sgd()).minimize(loss)
      return train_op
    with self.assertRaisesRegex(ValueError, r"different numbers of "
                                r"TowerOptimizer calls \(\[2, 1\]"):
      _call(_linear_model_fn(optimizer_fn))

  def test_towers_updating_different_variables(self):
    def optimizer_fn(loss):
      variables = tf.compat.v1.trainable_variables()
      if replicate.current_tower().index == 1:
        variables = variables[:1]
      return replicate.TowerOptimizer(_sgd()).minimize(loss, var_list=variables)
    with self.assertRaisesRegex(ValueError, "updates variables .*logits/kernel"
                                ".*same variables"):
      _call(_linear_model_fn(optimizer_fn))

  def test_towers_returning_different_metrics(self):
    def metrics_fn(labels, logits):
      metrics = {"accuracy": tf.compat.v1.metrics.accuracy(
          labels, tf.argmax(logits, 1))}
      if replicate.current_tower().index == 1:
        metrics["mean"] = tf.compat.v1.metrics.mean(logits)
      return metrics
    with self.assertRaisesRegex(ValueError, r"Tower 1 returned eval_metric_ops "
                                r"\['accuracy', 'mean'\] but tower 0 returned"):
      _call(_linear_model_fn(metrics_fn=metrics_fn), mode=EVAL)

  def test_tower_creating_a_variable_tower_zero_did_not(self):
    def model_fn(features, labels, mode):
      logits = tf.keras.layers.Dense(3)(features["x"])
      if replicate.current_tower().index == 1:
        logits += tf.Variable(0.0, name="extra")
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      opt = replicate.TowerOptimizer(_sgd())
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=opt.minimize(loss))
    with self.assertRaisesRegex(ValueError, "Tower 1 creates variable "
                                "'tower_1/extra' that tower 0 did not"):
      _call(model_fn)

  def test_nested_replication_is_refused(self):
    inner = replicate.replicate_model_fn(
        _linear_model_fn(lambda l: replicate.TowerOptimizer(_sgd()).minimize(l)),
        devices=GPUS)
    with self.assertRaisesRegex(ValueError, "inside another replicated model_fn"):
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
      replicate.replicate_model_fn(model_fn, devices=GPUS)(
          features, labels, TRAIN)

  def test_scalar_feature_is_refused(self):
    with self.assertRaisesRegex(ValueError, r"`features\['scale'\]` is a "
                                "scalar and has no batch dimension"):
      self._split({"x": np.zeros((4, 5), np.float32), "scale": 2.0},
                  np.zeros(4, np.int64))

  def test_different_batch_sizes_are_refused(self):
    with self.assertRaisesRegex(ValueError, r"different batch sizes "
                                r"\(`features\['x'\]`: 4, `labels`: 6\)"):
      self._split({"x": np.zeros((4, 5), np.float32)}, np.zeros(6, np.int64))

  def test_non_tensor_feature_is_refused(self):
    with self.assertRaisesRegex(ValueError, r"`features\['f'\]` of type "
                                "object cannot be split"):
      self._split({"x": np.zeros((4, 5), np.float32), "f": object()},
                  np.zeros(4, np.int64))


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()
