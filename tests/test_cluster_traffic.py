"""Cross-task traffic per step on a localhost parameter-server cluster.

`benchmarks/traffic.py` runs in a subprocess of its own (its in-process
`tf.distribute.Server`s cannot be stopped): one ps and one worker with 4
CPUs, each graph built under `replica_device_setter` as Estimator builds it
on a cluster, sessions without soft placement. Every trainer must read each
variable once per step and send one gradient per variable, whatever the
towers: the dense models' bytes per direction are their parameters' bytes
(an MLP; a Keras LSTM, whose loop reads its variables at every time step;
a conv with Keras batch normalization, whose moving statistics are written
each step), the embedding model's what the unwrapped model_fn sends (the
rows it gathers, their gradient rows, the dense variables once); with
reference variables (`_ref`, TF1's `use_resource=False`) too, among them a
partitioned table looked up as embedding columns do (the safe sparse
lookup converts its tables before it looks rows up), and a lookup given a
resource table's value rather than the variable. Losses and variables
(optimizer slots included) are one device's (the unwrapped model_fn on the
same cluster), and so is an average of the weights taken after the
train_op: it sees the updated weights, not the step's one shared read.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import harness

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 towers (uneven shares) in the default run; 1 and 2 in the wide run.
TOWERS = (harness.wide(1), harness.wide(2), 4)
# The bound on bytes per direction over the minimum (measured:
# 1.00, and 0.98 for the embedding model's ids on several towers).
_MAX_RATIO = 1.05


def _selected_towers(session):
  """The tower counts of this module's tests that this run will run."""
  return sorted({
      item.callspec.params["towers"] for item in session.items if
      item.module.__name__ == __name__ and not item.get_closest_marker("skip")
  })


@pytest.fixture(scope="module")
def traffic(request, tmp_path_factory):
  """Every selected variant's row, and the directory of their values."""
  out = tmp_path_factory.mktemp("traffic")
  towers = _selected_towers(request.session)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=_ROOT)
  env.pop("TF_CONFIG", None)
  # 30 rows: uneven on 4 towers.
  proc = subprocess.run([
      sys.executable,
      os.path.join(_ROOT, "benchmarks", "traffic.py"),
      "--towers=" + ",".join(map(str, towers)), "--batch_size=30",
      "--models=mlp,embedding,lstm,bn,ema,mlp_ref,embedding_ref,"
      "embedding_sparse_ref,embedding_converted",
      f"--result_file={out / 'rows.json'}", f"--values_dir={out}"
  ],
                        capture_output=True,
                        text=True,
                        timeout=240,
                        cwd=_ROOT,
                        env=env)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  rows = json.loads((out / "rows.json").read_text())
  return {(r["model"], r["towers"]): r for r in rows}, out


@pytest.mark.parametrize("model", [
    "mlp", "embedding", "bn", "lstm", "mlp_ref", "embedding_ref",
    "embedding_sparse_ref", "embedding_converted"
])
@pytest.mark.parametrize("towers", TOWERS)
def test_each_trainer_reads_each_variable_once_and_sends_one_gradient(
    traffic, model, towers):
  rows, _ = traffic
  row, plain = rows[(model, towers)], rows[(model, 0)]
  if model == "lstm" and towers == 1:
    # One tower is the unwrapped model_fn's graph, whose loop reads the
    # LSTM's variables at each of the 28 time steps.
    assert row["ps_to_worker"] > 20 * row["parameter_bytes"], row
    assert plain["ps_to_worker"] > 20 * plain["parameter_bytes"], plain
    return
  for direction in ("worker_to_ps", "ps_to_worker"):
    assert row[direction] > 0, row
    assert row[f"{direction}_ratio"] <= _MAX_RATIO, row


@pytest.mark.parametrize("model", [
    "mlp", "embedding", "bn", "lstm", "ema", "mlp_ref", "embedding_ref",
    "embedding_sparse_ref", "embedding_converted"
])
@pytest.mark.parametrize("towers", TOWERS)
def test_losses_and_variables_are_one_devices(traffic, model, towers):
  _, out = traffic
  expected = np.load(out / f"{model}_0.npz")
  actual = np.load(out / f"{model}_{towers}.npz")
  assert sorted(actual.files) == sorted(expected.files)
  for name in expected.files:
    # float32 sums over the towers' shares, in another order than one
    # device's; eight steps of Momentum.
    np.testing.assert_allclose(
        actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
