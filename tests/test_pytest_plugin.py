"""replicate.pytest_plugin: the one line a user's conftest.py needs."""

import os
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parent.parent

_USER_TEST = """
import tensorflow as tf

def test_devices_and_config(replicate_devices, replicate_run_config,
                            tmp_path):
  assert replicate_devices == ["/device:CPU:0", "/device:CPU:1",
                               "/device:CPU:2"]
  assert [d.name for d in tf.config.list_logical_devices("CPU")] == (
      replicate_devices)
  assert replicate_run_config.session_config.device_count["CPU"] == 3
  assert replicate_run_config.model_dir == str(tmp_path)
  assert replicate_run_config.tf_random_seed == 0
"""


def test_conftest_one_liner_gives_devices_and_run_config(pytester, monkeypatch):
  monkeypatch.setenv(
      "PYTHONPATH",
      os.pathsep.join([str(_ROOT)] +
                      [p for p in [os.environ.get("PYTHONPATH")] if p]))
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
  pytester.makeconftest('pytest_plugins = ["replicate.pytest_plugin"]')
  pytester.makepyfile(test_user=_USER_TEST)
  # A subprocess: the plugin must make the devices before TensorFlow does.
  result = pytester.runpytest_subprocess("--replicate-cpus=3", "-q", "-p",
                                         "no:cacheprovider")
  result.assert_outcomes(passed=1)
