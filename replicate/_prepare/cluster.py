"""Checks of a TF_CONFIG cluster: the environment and the towers' devices.

Estimator reads `TF_CONFIG` itself; these checks only fail earlier, with
messages that name the fix, for what it would refuse with a bare parse
error or run wrongly: a value that is not JSON, a task the cluster does not
have, tower devices on another task's machine.
"""

import json
import os
from typing import Any, Dict, Optional, Sequence

import tensorflow as tf

_TF_CONFIG = "TF_CONFIG"
# Task types that run outside the cluster's jobs.
_OUTSIDE_CLUSTER = frozenset(["evaluator"])
_EXAMPLE = ('{"cluster": {"chief": ["host0:2222"], "ps": ["host1:2222"]}, '
            '"task": {"type": "chief", "index": 0}}')


def check_tf_config() -> None:
  """Checks the `TF_CONFIG` environment variable, when it is set.

  Raises:
    ValueError: it is not a JSON object, or its task is not in its cluster.
  """
  text = os.environ.get(_TF_CONFIG)
  if not text:
    return
  try:
    config = json.loads(text)
  except ValueError as e:
    raise ValueError(
        f"TF_CONFIG={text!r} is not JSON ({e}); set it to a JSON object "
        f"such as {_EXAMPLE}, or unset it to train on this machine alone."
    ) from None
  if not isinstance(config, dict):
    raise ValueError(
        f"TF_CONFIG={text!r} is not a JSON object; set it to one such as "
        f"{_EXAMPLE}.")
  _check_task(config.get("cluster") or {}, config.get("task") or {})


def trainers_only() -> bool:
  """Whether `TF_CONFIG` names a cluster of two or more trainers (chief and
  workers) without a `ps` job: they train by all-reduce among them."""
  try:
    config = json.loads(os.environ.get(_TF_CONFIG) or "{}")
  except ValueError:
    return False
  cluster = config.get("cluster") or {} if isinstance(config, dict) else {}
  trainers = len(cluster.get("chief", [])) + len(cluster.get("worker", []))
  return "ps" not in cluster and "chief" in cluster and trainers > 1


def _check_task(cluster: Dict[str, Any], task: Dict[str, Any]) -> None:
  """Raises ValueError unless `task` names a task of `cluster`."""
  task_type, index = task.get("type"), task.get("index", 0)
  if not cluster or task_type is None or task_type in _OUTSIDE_CLUSTER:
    return
  jobs = sorted(cluster)
  if task_type not in cluster:
    raise ValueError(
        f"TF_CONFIG's task type {task_type!r} is not a job of its cluster "
        f"(jobs: {jobs}); set task.type to one of them (or 'evaluator'), or "
        f"add a {task_type!r} job to the cluster.")
  size = len(cluster[task_type])
  if not isinstance(index, int) or not 0 <= index < size:
    raise ValueError(
        f"TF_CONFIG's task index {index!r} is out of range for job "
        f"{task_type!r}, which has {size} task(s); set task.index to 0.."
        f"{size - 1}.")


def check_devices(devices: Sequence[str],
                  config: Optional[tf.estimator.RunConfig]) -> None:
  """Checks that devices naming a job name this trainer's own task.

  Args:
    devices: the towers' device names.
    config: the Estimator's RunConfig; without a cluster nothing is checked.

  Raises:
    ValueError: a device names another job or task of the cluster.
  """
  if config is None or not config.cluster_spec.jobs or not config.task_type:
    return
  own_job, own_task = config.task_type, config.task_id
  for device in devices:
    spec = tf.DeviceSpec.from_string(device)
    if spec.job is None:
      continue
    if spec.job != own_job or spec.task not in (None, own_task):
      local = tf.DeviceSpec(
          device_type=spec.device_type,
          device_index=spec.device_index).to_string()
      raise ValueError(
          f"Device {device!r} is on another machine than this task "
          f"(/job:{own_job}/task:{own_task}): a trainer's towers run on its "
          f"own devices; name them without a job (e.g. {local!r}) or with "
          f"'/job:{own_job}/task:{own_task}'.")


def on_cluster(consolidation_device: Optional[str]) -> bool:
  """Whether the towers' ops are placed on a cluster's task (the
  consolidation device, as the caller's device function placed the input
  split, names a job)."""
  return bool(tf.DeviceSpec.from_string(consolidation_device or "").job)
