"""A pytest plugin: virtual CPU devices and Estimator configs for tests.

One line in a `conftest.py` gives every test N CPU devices (made before
anything initialises TensorFlow's devices) and two fixtures:

    pytest_plugins = ["replicate.pytest_plugin"]

    def test_model_fn_replicates(replicate_devices):
      replicate.testing.assert_replicates(model_fn, input_fn)

    def test_canned_on_towers(replicate_devices, replicate_run_config):
      est = tf.estimator.Estimator(
          replicate.replicate_model_fn(canned.model_fn,
                                       devices=replicate_devices),
          config=replicate_run_config)

`pytest --replicate-cpus=N` sets the number of devices (default 4).
"""

import pathlib
from typing import List

import pytest
import tensorflow as tf

from replicate import testing

__all__ = ("replicate_devices", "replicate_run_config")

_DEFAULT_CPUS = 4


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption(
      "--replicate-cpus",
      type=int,
      default=_DEFAULT_CPUS,
      help="virtual CPU devices replicate.pytest_plugin makes (default "
      f"{_DEFAULT_CPUS})")


def pytest_configure(config: pytest.Config) -> None:
  testing.virtual_cpus(config.getoption("replicate_cpus"))


@pytest.fixture(scope="session")
def replicate_devices(pytestconfig: pytest.Config) -> List[str]:
  """The virtual CPU device names, '/device:CPU:0' to '/device:CPU:<N-1>'."""
  return testing.virtual_cpus(pytestconfig.getoption("replicate_cpus"))


@pytest.fixture
def replicate_run_config(
    replicate_devices: List[str],  # pylint: disable=redefined-outer-name
    tmp_path: pathlib.Path
) -> tf.estimator.RunConfig:
  """A RunConfig with as many CPU devices, a fresh model_dir, seed 0."""
  return testing.run_config(
      len(replicate_devices), model_dir=str(tmp_path), tf_random_seed=0)
