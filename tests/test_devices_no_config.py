"""A model_fn called without `config`: the caller's session makes the CPUs.

tests/raw_graph_harness.py runs in a fresh process with no CPU split (this
one has four logical CPUs, see conftest.py): the replicated model_fn called
directly in a `tf.Graph`, run in its own `Session(device_count={'CPU': 4})`
without soft placement, trains like the unwrapped one (an embedding lookup
included); names that provably do not exist are still
refused with the same messages.
"""

import json
import os
import pathlib
import subprocess
import sys
from unittest import mock

from absl.testing import absltest
import numpy as np
import pytest

import replicate
from replicate._prepare import devices as _devices

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def raw_graph():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  done = subprocess.run([sys.executable, "-m", "tests.raw_graph_harness"],
                        cwd=ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=300,
                        check=False)
  lines = [
      line for line in done.stdout.splitlines() if line.startswith("RESULT ")
  ]
  assert done.returncode == 0 and lines, done.stderr[-3000:]
  return json.loads(lines[-1][len("RESULT "):])


def test_the_harness_process_has_no_cpu_split(raw_graph):
  assert raw_graph["logical_cpus"] == 1


@pytest.mark.parametrize("case", [0, 1])
def test_towers_train_like_one_device_in_the_callers_session(raw_graph, case):
  result = raw_graph["cases"][case]
  towers = result["num_towers"]
  replicated, one_device = result["replicated"], result["one_device"]
  assert replicated["devices"] == [f"/device:CPU:{i}" for i in range(towers)]
  np.testing.assert_allclose(
      replicated["losses"], one_device["losses"], rtol=1e-5, atol=1e-6)
  assert sorted(
      replicated["weights"]) == ["embedding", "logits/bias", "logits/kernel"]
  for name, value in one_device["weights"].items():
    np.testing.assert_allclose(
        replicated["weights"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [0, 1])
def test_one_warning_names_the_devices_the_session_must_make(raw_graph, case):
  result = raw_graph["cases"][case]
  missing = [f"/device:CPU:{i}" for i in range(1, result["num_towers"])]
  assert len(result["warnings"]) == 1, result["warnings"]
  assert "the model_fn got no config" in result["warnings"][0]
  assert repr(missing) in result["warnings"][0]


def test_provably_missing_devices_are_still_refused(raw_graph):
  errors = raw_graph["errors"]
  assert errors["unknown_type"].startswith(
      "Device '/device:CPUU:0' does not exist: this machine has no CPUU "
      "device; the local devices are '/device:CPU:0'."), errors
  assert errors["beyond_device_count"].startswith(
      "Device '/device:CPU:3' does not exist: this machine has 2 CPU "
      "device(s)"), errors
  assert "device_count={'CPU': N}" in errors["beyond_device_count"]
  assert errors["run_config_without_device_count"].startswith(
      "Device '/device:CPU:1' does not exist: this machine has 1 CPU "
      "device(s)"), errors


class KnownDevicesTest(absltest.TestCase):
  """Cases decided from the device counts alone (no session needed)."""

  def _check(self, devices, counts, config=None):
    with mock.patch.object(
        _devices, "_local_device_counts", return_value=counts):
      _devices.check_local_devices(devices, config)

  def test_gpu_index_beyond_the_machines_gpus_is_refused_without_config(self):
    with self.assertRaisesRegex(
        ValueError, r"Device '/device:GPU:2' does not exist: this machine "
        r"has 2 GPU device\(s\)"):
      self._check(["/device:GPU:0", "/device:GPU:2"], {"CPU": 1, "GPU": 2})

  def test_cpu_index_beyond_an_explicit_split_is_refused_without_config(self):
    with self.assertRaisesRegex(ValueError, "has 4 CPU device"):
      self._check(["/device:CPU:0", "/device:CPU:4"], {"CPU": 4})

  def test_unknown_cpus_without_config_warn_once(self):
    with self.assertLogs("absl", "WARNING") as logs:
      self._check(["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"],
                  {"CPU": 1})
    self.assertLen(logs.records, 1)
    self.assertIn("['/device:CPU:1', '/device:CPU:2']",
                  logs.records[0].getMessage())

  def test_malformed_and_repeated_names_are_refused(self):
    with self.assertRaisesRegex(ValueError, "is not a valid device name"):
      replicate.replicate_model_fn(
          lambda features, labels, mode: None, devices=["/device:CPU"])
    with self.assertRaisesRegex(ValueError, "is listed twice"):
      replicate.replicate_model_fn(
          lambda features, labels, mode: None,
          devices=["/cpu:1", "/device:CPU:1"])
