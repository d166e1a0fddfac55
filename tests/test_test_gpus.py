"""REPLICATE_TEST_GPUS fails the run where the GPUs it asks for are absent."""

import os
import pathlib
import subprocess
import sys

import pytest
import tensorflow as tf

_ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    bool(tf.config.list_physical_devices("GPU")),
    reason="this machine has a GPU: the variable is honoured")
def test_asking_for_gpus_without_one_fails_with_the_fix():
  env = dict(os.environ, REPLICATE_TEST_GPUS="4", TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run([
      sys.executable, "-m", "pytest", "-p", "no:xdist", "-q",
      "tests/test_public_api.py"
  ],
                        cwd=_ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=300,
                        check=False)
  assert done.returncode != 0
  output = done.stdout + done.stderr
  assert "REPLICATE_TEST_GPUS=4" in output, output[-2000:]
  assert "unset REPLICATE_TEST_GPUS" in output, output[-2000:]
  assert " passed" not in output
