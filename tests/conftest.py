"""Test set-up: quiet TensorFlow logs; graph mode is per test (tf.Graph)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)

# `pytester` runs the pytest plugin's own test in a fresh pytest.
pytest_plugins = ["pytester"]
