"""Test set-up: quiet TensorFlow logs; graph mode is per test (tf.Graph).

The host CPU is split into 4 logical devices before TensorFlow initialises,
so that '/device:CPU:0'..'/device:CPU:3' exist for every test, as
`replicate` checks device names against the local devices (sessions that
ask for `device_count={'CPU': 4}` get the same four). GPUs are hidden, so
the '/device:GPU:N' cases run by soft placement on the CPU on every machine
(with one real GPU, '/device:GPU:1..3' would not exist) and compare float32
results without TF32 matmuls.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
tf.config.set_visible_devices([], "GPU")
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 4)

# `pytester` runs the pytest plugin's own test in a fresh pytest.
pytest_plugins = ["pytester"]
