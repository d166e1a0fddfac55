"""Test set-up: quiet TensorFlow logs; graph mode is per test (tf.Graph)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
