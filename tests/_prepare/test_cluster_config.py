"""Bad cluster input: errors that name the value, the limit and the fix.

A `TF_CONFIG` that is not JSON or names a task its cluster lacks is refused
when the model_fn is wrapped; tower devices of another task of the cluster
when the Estimator calls the wrapped model_fn (the same wrapping runs on
every task, the ps included, which never calls it).
"""

import json

import pytest
import tensorflow as tf

import replicate
from tests import models

_CLUSTER = {
    "chief": ["localhost:2222"],
    "worker": ["localhost:2223"],
    "ps": ["localhost:2224"]
}


def _set_tf_config(monkeypatch, task_type, index=0):
  monkeypatch.setenv(
      "TF_CONFIG",
      json.dumps({
          "cluster": _CLUSTER,
          "task": {
              "type": task_type,
              "index": index
          }
      }))


@pytest.mark.parametrize("text, message", [
    ('{"cluster": {"chief": ["host0:2222"]', "is not JSON"),
    ("chief", "is not JSON"),
    ('["chief"]', "is not a JSON object"),
])
def test_tf_config_not_a_json_object(monkeypatch, text, message):
  monkeypatch.setenv("TF_CONFIG", text)
  with pytest.raises(ValueError, match=message) as error:
    replicate.replicate_model_fn(models.classifier_model_fn)
  assert "set it to" in str(error.value)


def test_task_type_not_in_the_cluster(monkeypatch):
  _set_tf_config(monkeypatch, "master")
  with pytest.raises(
      ValueError,
      match=r"task type 'master' is not a job of its cluster "
      r"\(jobs: \['chief', 'ps', 'worker'\]\)"):
    replicate.replicate_model_fn(models.classifier_model_fn)


def test_task_index_out_of_range(monkeypatch):
  _set_tf_config(monkeypatch, "worker", index=1)
  with pytest.raises(
      ValueError,
      match=r"task index 1 is out of range for "
      r"job 'worker', which has 1 task\(s\); set task.index"):
    replicate.replicate_model_fn(models.classifier_model_fn)


@pytest.mark.parametrize("task_type", ["chief", "worker", "ps", "evaluator"])
def test_every_task_of_the_cluster_is_accepted(monkeypatch, task_type):
  _set_tf_config(monkeypatch, task_type)
  replicate.replicate_model_fn(models.classifier_model_fn)


def _call(model_fn, config):
  features, labels = models.data(num_examples=8)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    return model_fn(
        features,
        labels,
        tf.estimator.ModeKeys.TRAIN,
        params={"learning_rate": 0.1},
        config=config)


@pytest.mark.parametrize(
    "device",
    [
        "/job:worker/task:0/device:CPU:1",  # another job
        "/job:chief/task:1/device:CPU:1",  # another task of this job
        "/job:ps/device:CPU:0",
    ])
def test_devices_of_another_task_are_refused(monkeypatch, device):
  _set_tf_config(monkeypatch, "chief")
  config = tf.estimator.RunConfig()
  model_fn = replicate.replicate_model_fn(
      models.classifier_model_fn,
      devices=["/job:chief/task:0/device:CPU:0", device])
  with pytest.raises(
      ValueError,
      match=r"is on another machine than this "
      r"task \(/job:chief/task:0\).*name them without a job "
      r"\(e.g. '/device:CPU:"):
    _call(model_fn, config)


def test_devices_of_this_task_are_accepted(monkeypatch):
  _set_tf_config(monkeypatch, "worker")
  config = tf.estimator.RunConfig()
  model_fn = replicate.replicate_model_fn(
      models.classifier_model_fn,
      devices=["/job:worker/task:0/device:CPU:0", "/job:worker/device:CPU:1"])
  spec = _call(model_fn, config)
  assert spec.train_op is not None
