"""A v1 canned estimator's model_fn, replicated, and its exported model.

`tf.compat.v1.estimator.DNNClassifier` takes a `tf.compat.v1.train`
optimizer and sums its loss over the batch, so it is replicated with
Reduction.SUM (given, or found on its head). The SavedModel exported from GPU
towers must serve from a CPU-only session without soft placement.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness
from tests import models

GPUS = [f"/device:GPU:{i}" for i in range(4)]


def _config(model_dir):
  return harness.estimator_config(model_dir, seed=7)


def _canned(model_dir):
  columns = [
      tf.feature_column.numeric_column("x", shape=(models.NUM_FEATURES,))
  ]
  return tf.compat.v1.estimator.DNNClassifier(
      hidden_units=[8],
      feature_columns=columns,
      n_classes=models.NUM_CLASSES,
      optimizer=replicate.TowerOptimizer(
          tf.compat.v1.train.AdagradOptimizer(0.05)),
      config=_config(model_dir))


def _input_fn(num_examples=64, epochs=None, batch_size=16):
  features, labels = models.data(num_examples)

  def input_fn():
    return tf.data.Dataset.from_tensor_slices(
        (features, labels)).repeat(epochs).batch(batch_size)

  return input_fn


def _estimator(tower_devices, model_dir, **kwargs):
  canned = _canned(model_dir)
  if tower_devices is None:
    return canned
  return tf.estimator.Estimator(
      replicate.replicate_model_fn(
          canned.model_fn, devices=tower_devices, **kwargs),
      config=_config(model_dir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  results = {}
  sum_reduction = {"loss_reduction": tf.compat.v1.losses.Reduction.SUM}
  # cpu2 relies on the head's reduction being found; gpu4 passes SUM.
  for name, devices, kwargs in (("plain", None, {}), ("cpu2",
                                                      ["/cpu:0", "/cpu:1"], {}),
                                ("gpu4", GPUS, sum_reduction)):
    estimator = _estimator(devices, tmp_path_factory.mktemp(name), **kwargs)
    estimator.train(_input_fn(), steps=10)
    metrics = estimator.evaluate(_input_fn(40, epochs=1))
    predictions = list(estimator.predict(_input_fn(40, epochs=1)))
    results[name] = (estimator, metrics, predictions)
  return results


@pytest.mark.parametrize("name", ["cpu2", "gpu4"])
def test_canned_v1_matches_plain(runs, name):
  plain, expected_metrics, expected_predictions = runs["plain"]
  estimator, metrics, predictions = runs[name]
  assert sorted(estimator.get_variable_names()) == sorted(
      plain.get_variable_names())
  for variable in plain.get_variable_names():
    np.testing.assert_allclose(
        estimator.get_variable_value(variable),
        plain.get_variable_value(variable),
        rtol=1e-4,
        atol=1e-6,
        err_msg=variable)
  for key in ("accuracy", "average_loss", "loss"):
    np.testing.assert_allclose(metrics[key], expected_metrics[key], rtol=1e-4)
  assert len(predictions) == 40
  for got, want in zip(predictions, expected_predictions):
    np.testing.assert_allclose(
        got["probabilities"], want["probabilities"], rtol=1e-4, atol=1e-6)


def _serve_on_cpu_without_soft_placement(export_dir, x):
  with tf.Graph().as_default() as graph:
    config = tf.compat.v1.ConfigProto(
        allow_soft_placement=False, device_count={"GPU": 0})
    with tf.compat.v1.Session(config=config) as session:
      meta_graph = tf.compat.v1.saved_model.loader.load(session, ["serve"],
                                                        export_dir)
      nodes = {
          node.name: node.device
          for node in meta_graph.graph_def.node
          if not node.name.startswith("save/")
      }  # the Saver's: CPU
      signature = meta_graph.signature_def["predict"]
      fetch = graph.get_tensor_by_name(signature.outputs["probabilities"].name)
      feed = graph.get_tensor_by_name(signature.inputs["x"].name)
      return session.run(fetch, {feed: x}), nodes


def _receiver():
  x = tf.compat.v1.placeholder(tf.float32, [None, models.NUM_FEATURES], "x")
  return tf.estimator.export.ServingInputReceiver({"x": x}, {"x": x})


def test_export_from_gpu_towers_is_the_plain_model_and_serves_on_cpu(
    runs, tmp_path):
  estimator, _, predictions = runs["gpu4"]
  export_dir = estimator.export_saved_model(str(tmp_path / "gpu4"), _receiver)
  x = models.data(40)[0]["x"][:7]
  probabilities, nodes = _serve_on_cpu_without_soft_placement(export_dir, x)
  assert set(nodes.values()) == {""}  # no device of the training machine
  np.testing.assert_allclose(
      probabilities, [p["probabilities"] for p in predictions[:7]], rtol=1e-5)
  # One tower, not four: the same graph as the unreplicated model's export.
  plain_dir = runs["plain"][0].export_saved_model(
      str(tmp_path / "plain"), _receiver)
  _, plain_nodes = _serve_on_cpu_without_soft_placement(plain_dir, x)
  assert sorted(nodes) == sorted(plain_nodes)


def test_gpu_pinned_graph_would_not_serve_on_cpu():
  """The check above can fail: a pinned graph does not load on CPU."""
  with tf.Graph().as_default():
    with tf.device("/device:GPU:3"):
      value = tf.constant(1.0) + 1.0
    config = tf.compat.v1.ConfigProto(
        allow_soft_placement=False, device_count={"GPU": 0})
    with tf.compat.v1.Session(config=config) as session:
      with pytest.raises(tf.errors.InvalidArgumentError, match="GPU"):
        session.run(value)
