"""The decisive tests: N towers give one device's losses, weights, metrics.

Same data, same initial weights; 1, 2 and 4 towers, on GPU names with soft
placement and on separate virtual CPU devices, for SUM and every averaging
reduction.
"""

import functools
import itertools

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness
from tests import models

R = tf.compat.v1.losses.Reduction
REDUCTIONS = (R.SUM, R.MEAN, R.SUM_BY_NONZERO_WEIGHTS, R.SUM_OVER_BATCH_SIZE)
KINDS = (harness.GPU_NAMES, harness.VIRTUAL_CPUS)
STEPS = 4
BATCH = 8


@functools.lru_cache(maxsize=None)
def _single_device_training(reduction, layers="v1", optimizer="adagrad"):
  params = {"reduction": reduction, "layers": layers, "optimizer": optimizer}
  return harness.train(
      models.classifier_model_fn, models.data(), BATCH, STEPS, params=params)


def _cases(wide):
  """Every reduction once by default, the tower counts and kinds in turn."""
  default = {(4, harness.GPU_NAMES, R.SUM), (4, harness.VIRTUAL_CPUS, R.MEAN),
             (2, harness.GPU_NAMES, R.SUM_BY_NONZERO_WEIGHTS),
             (1, harness.VIRTUAL_CPUS, R.SUM_OVER_BATCH_SIZE)}
  for n in (1, 2, 4):
    for kind in KINDS:
      for reduction in REDUCTIONS:
        if ((n, kind, reduction) in default) != wide:
          yield dict(
              testcase_name=f"{n}_towers_{kind}_{reduction}",
              num_towers=n,
              kind=kind,
              reduction=reduction)


class TrainingEquivalenceTest(parameterized.TestCase):

  @parameterized.named_parameters(*_cases(wide=False))
  def test_losses_and_trained_variables_match_one_device(
      self, num_towers, kind, reduction):
    self._assert_losses_and_trained_variables_match(num_towers, kind, reduction)

  @parameterized.named_parameters(*_cases(wide=True))
  @pytest.mark.wide
  def test_losses_and_trained_variables_match_one_device_wide(
      self, num_towers, kind, reduction):
    self._assert_losses_and_trained_variables_match(num_towers, kind, reduction)

  def _assert_losses_and_trained_variables_match(self, num_towers, kind,
                                                 reduction):
    expected_losses, expected_values = _single_device_training(reduction)
    losses, values = harness.train(
        models.classifier_model_fn,
        models.data(),
        BATCH,
        STEPS,
        tower_devices=harness.devices(kind, num_towers),
        reduction=reduction,
        kind=kind,
        params={"reduction": reduction})
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    self.assertEqual(sorted(values), sorted(expected_values))
    harness.assert_close_nests(values, expected_values)
    # Training moved the weights: the comparison is not of initial values.
    initial = harness.initial_value("logits/kernel", (8, 3), tf.float32)
    self.assertGreater(np.abs(values["logits/kernel"] - initial).max(), 1e-2)

  # Both layers, every optimizer, tower count and placement, and a
  # placement spelled as a string; the wide run adds other combinations.
  @parameterized.parameters(
      ("v1", "adam", 4, replicate.VariablePlacement.SHARED),
      ("v1", "momentum", 3, replicate.VariablePlacement.ROUND_ROBIN),
      ("v1", "adagrad", 2, replicate.VariablePlacement.MIRRORED),
      ("keras", "momentum", 3, "mirrored"),
  )
  def test_layers_optimizers_and_placements_match_one_device(
      self, layers, optimizer, num_towers, placement):
    self._assert_layers_optimizers_and_placements_match(layers, optimizer,
                                                        num_towers, placement)

  @parameterized.parameters(
      ("keras", "adagrad", 2, replicate.VariablePlacement.SHARED),
      ("keras", "adagrad", 4, replicate.VariablePlacement.ROUND_ROBIN),
      ("keras", "adam", 2, "round_robin"),
      ("v1", "adam", 4, replicate.VariablePlacement.MIRRORED),
      ("keras", "adam", 2, "mirrored"),
  )
  @pytest.mark.wide
  def test_layers_optimizers_and_placements_match_one_device_wide(
      self, layers, optimizer, num_towers, placement):
    self._assert_layers_optimizers_and_placements_match(layers, optimizer,
                                                        num_towers, placement)

  def _assert_layers_optimizers_and_placements_match(self, layers, optimizer,
                                                     num_towers, placement):
    # 8 examples on 3 towers: shards of 3, 3 and 2.
    reduction = R.SUM_BY_NONZERO_WEIGHTS
    expected_losses, expected_values = _single_device_training(
        reduction, layers, optimizer)
    losses, values = harness.train(
        models.classifier_model_fn,
        models.data(),
        BATCH,
        STEPS,
        tower_devices=harness.devices(harness.VIRTUAL_CPUS, num_towers),
        placement=placement,
        params={
            "reduction": reduction,
            "layers": layers,
            "optimizer": optimizer
        })
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    self.assertEqual(sorted(values), sorted(expected_values))
    harness.assert_close_nests(values, expected_values, rtol=1e-4, atol=1e-5)


_EVAL_CASES = tuple(
    itertools.product((1, 2, 4), KINDS, (R.SUM, R.SUM_BY_NONZERO_WEIGHTS)))
_EVAL_DEFAULT = ((4, harness.GPU_NAMES, R.SUM), (2, harness.VIRTUAL_CPUS,
                                                 R.SUM_BY_NONZERO_WEIGHTS))


class EvalAndPredictEquivalenceTest(parameterized.TestCase):

  # Each reduction and kind once; 1 tower is in TrainingEquivalenceTest.
  @parameterized.parameters(*_EVAL_DEFAULT)
  def test_eval_metrics_match_one_device(self, num_towers, kind, reduction):
    self._assert_eval_metrics_match(num_towers, kind, reduction)

  @parameterized.parameters(
      *[case for case in _EVAL_CASES if case not in _EVAL_DEFAULT])
  @pytest.mark.wide
  def test_eval_metrics_match_one_device_wide(self, num_towers, kind,
                                              reduction):
    self._assert_eval_metrics_match(num_towers, kind, reduction)

  def _assert_eval_metrics_match(self, num_towers, kind, reduction):
    params = {"reduction": reduction}
    expected_losses, expected = harness.evaluate(
        models.classifier_model_fn, models.data(), BATCH, 5, params=params)
    losses, metrics = harness.evaluate(
        models.classifier_model_fn,
        models.data(),
        BATCH,
        5,
        tower_devices=harness.devices(kind, num_towers),
        reduction=reduction,
        kind=kind,
        params=params)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    self.assertEqual(sorted(metrics), sorted(expected))
    harness.assert_close_nests(metrics, expected)
    # Not a trivial metric: these weights get some examples right, not all.
    self.assertTrue(0.0 < metrics["accuracy"] < 1.0, metrics)

  @parameterized.parameters((4, harness.VIRTUAL_CPUS), (2, harness.GPU_NAMES))
  def test_predictions_and_export_outputs_match_one_device(
      self, num_towers, kind):
    self._assert_predictions_and_export_outputs_match(num_towers, kind)

  @parameterized.parameters((4, harness.GPU_NAMES), (2, harness.VIRTUAL_CPUS))
  @pytest.mark.wide
  def test_predictions_and_export_outputs_match_one_device_wide(
      self, num_towers, kind):
    self._assert_predictions_and_export_outputs_match(num_towers, kind)

  def _assert_predictions_and_export_outputs_match(self, num_towers, kind):
    expected = harness.predict(models.classifier_model_fn,
                               models.data()[0], BATCH, 3)
    actual = harness.predict(
        models.classifier_model_fn,
        models.data()[0],
        BATCH,
        3,
        tower_devices=harness.devices(kind, num_towers),
        kind=kind)
    harness.assert_close_nests(actual, expected)
    self.assertEqual(actual[0][0]["classes"].shape, (BATCH,))
    self.assertEqual(actual[0][1]["classify"]["classes"].shape, (BATCH, 3))


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()
