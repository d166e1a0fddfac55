"""Session and Estimator configs with N virtual CPU devices, for tests.

`virtual_cpus` splits the host CPU into N devices (for eager code and
`tf.distribute`); `run_config` and `session_config` give an Estimator a
session with N CPU devices, which is all a graph-mode Estimator needs.
"""

from typing import Any, List, Optional

import tensorflow as tf


def virtual_cpus(num_devices: int) -> List[str]:
  """Splits the host CPU into `num_devices` virtual devices.

  Must run before anything initialises TensorFlow's devices (first thing in
  `conftest.py` or `main`); calling it again with the same number is fine.
  Graph-mode Estimators do not need it: a session made with
  `session_config(num_devices)` has that many CPU devices of its own.

  Args:
    num_devices: how many CPU devices to make, at least 1.

  Returns:
    The device names, `['/device:CPU:0', ..., '/device:CPU:<N-1>']`.

  Raises:
    ValueError: `num_devices` is less than 1.
    RuntimeError: TensorFlow's devices are already initialised with another
      number of CPU devices.
  """
  check_count(num_devices)
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
  except RuntimeError:
    have = len(tf.config.list_logical_devices("CPU"))
    if have != num_devices:
      raise RuntimeError(
          f"virtual_cpus({num_devices}): TensorFlow's devices are already "
          f"initialised with {have} CPU device(s) and cannot be split again; "
          f"call replicate.testing.virtual_cpus({num_devices}) before "
          "anything lists or uses devices (at the top of conftest.py, or "
          "first in main), with the same number everywhere in the process. "
          "A graph-mode Estimator needs only "
          f"replicate.testing.run_config({num_devices}).") from None
  return cpu_names(num_devices)


def session_config(
    num_devices: int,
    base: Optional[tf.compat.v1.ConfigProto] = None,
) -> tf.compat.v1.ConfigProto:
  """A session config with `num_devices` CPU devices.

  Without `device_count` a session has one CPU device, and ops placed on
  '/device:CPU:1' fail to place. `base`, when given, is copied and kept;
  only its CPU count is set. Without it, soft placement is on, as in
  Estimator's default session config. A GPU split into logical GPUs with
  `tf.config.set_logical_device_configuration` stays split in the session
  (a v1 session makes its own devices from its config, and would have one
  GPU), unless `base` sets its own GPU list or split, or hides the GPUs.

  Args:
    num_devices: CPU devices the session must have, at least 1.
    base: your own session config, merged (not replaced).

  Returns:
    A new `tf.compat.v1.ConfigProto`.

  Raises:
    ValueError: `num_devices` is less than 1, or `base` already sets another
      CPU count.
  """
  return merged_session_config(num_devices, base)


def merged_session_config(
    num_devices: int,
    base: Optional[tf.compat.v1.ConfigProto]) -> tf.compat.v1.ConfigProto:
  check_count(num_devices)
  config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
  if base is not None:
    config.CopyFrom(base)
  given = config.device_count.get("CPU")
  if given not in (None, num_devices):
    raise ValueError(
        f"session_config: base sets device_count={{'CPU': {given}}} but "
        f"{num_devices} CPU devices are needed; remove 'CPU' from the base "
        f"config's device_count or set it to {num_devices}.")
  config.device_count["CPU"] = num_devices
  if config.device_count.get("GPU") != 0:
    _carry_logical_gpus(config.gpu_options)
  return config


def _carry_logical_gpus(gpu_options: tf.compat.v1.GPUOptions) -> None:
  """Repeats tf.config's logical split of the visible GPUs in `gpu_options`.

  As TensorFlow's eager context writes it (a GPU with no split of its own
  gets one device), and only when some visible GPU is split and the options
  name no GPUs or split of their own.
  """
  if (gpu_options.visible_device_list or
      gpu_options.experimental.virtual_devices):
    return
  gpus = tf.config.list_physical_devices("GPU")
  visible = set(tf.config.get_visible_devices("GPU"))
  splits = {
      gpu: tf.config.get_logical_device_configuration(gpu) or []
      for gpu in gpus
      if gpu in visible
  }
  if not any(splits.values()):
    return
  gpu_options.visible_device_list = ",".join(
      str(index) for index, gpu in enumerate(gpus) if gpu in visible)
  for gpu in gpus:
    if gpu not in visible:
      continue
    devices = gpu_options.experimental.virtual_devices.add()
    split = splits[gpu]
    devices.memory_limit_mb.extend(d.memory_limit for d in split)
    devices.priority.extend(d.experimental_priority
                            for d in split
                            if d.experimental_priority is not None)
    devices.device_ordinal.extend(d.experimental_device_ordinal
                                  for d in split
                                  if d.experimental_device_ordinal is not None)


def run_config(
    num_devices: int,
    session_config: Optional[tf.compat.v1.ConfigProto] = None,  # pylint: disable=redefined-outer-name
    **run_config_kwargs: Any,
) -> tf.estimator.RunConfig:
  """An Estimator RunConfig whose sessions have `num_devices` CPU devices.

      config = replicate.testing.run_config(4, model_dir=tmp, tf_random_seed=0)
      est = tf.estimator.Estimator(
          replicate.replicate_model_fn(
              model_fn, devices=replicate.testing.virtual_cpus(4)),
          config=config)

  Args:
    num_devices: CPU devices the sessions must have.
    session_config: your own session config, merged (see `session_config`).
    **run_config_kwargs: any other `tf.estimator.RunConfig` arguments.

  Returns:
    A `tf.estimator.RunConfig`.
  """
  return tf.estimator.RunConfig(
      session_config=merged_session_config(num_devices, session_config),
      **run_config_kwargs)


def check_count(num_devices: int) -> None:
  if not isinstance(num_devices, int) or isinstance(num_devices, bool):
    raise TypeError(
        f"{num_devices!r} devices is of type {type(num_devices).__name__}; "
        "pass a number of devices, an int of at least 1.")
  if num_devices < 1:
    raise ValueError(
        f"{num_devices!r} devices: pass a number of devices of at least 1.")


def cpu_names(num_devices: int) -> List[str]:
  return [f"/device:CPU:{i}" for i in range(num_devices)]
