"""benchmarks/run.py end to end in its smoke configuration, and its report.

The smoke run trains every variant for a few steps at N=1 and N=2 (two
runs at a time): it checks that everything runs and reports, not speed, so
nothing here asserts on timings.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BENCHMARKS = os.path.join(_ROOT, "benchmarks")
sys.path.insert(0, _BENCHMARKS)

import common  # noqa: E402  # pylint: disable=g-import-not-at-top,wrong-import-position
import report  # noqa: E402  # pylint: disable=g-import-not-at-top,wrong-import-position

VARIANTS = common.DEFAULT_VARIANTS


def _smoke(tmp_path, pairing, *extra):
  out = tmp_path / "smoke.json"
  proc = subprocess.run([
      sys.executable,
      os.path.join(_BENCHMARKS, "run.py"), "--smoke", "--device_type=CPU",
      f"--pairing={pairing}", f"--out={out}", *extra
  ],
                        capture_output=True,
                        text=True,
                        timeout=300,
                        cwd=_ROOT,
                        env=common.worker_env())
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc.stdout, json.loads(out.read_text())


def test_smoke_run_reports_every_variant_at_one_and_two_towers(tmp_path):
  # One process, the variants taking turns window by window.
  stdout, result = _smoke(tmp_path, "windows")
  rows = result["rows"]
  assert sorted((r["variant"], r["towers"]) for r in rows) == sorted(
      (v, n) for v in VARIANTS for n in (1, 2))
  for row in rows:
    assert row["runs"] == 1 and row["failed"] == 0, row
    assert row["examples_per_sec"] > 0, row
    assert math.isfinite(row["final_loss"]), row
    assert row["build_s"] > 0, row
    # One process: what each variant added to it, and a ratio per window.
    assert row["peak_rss_mib"] is None and row["rss_growth_mib"] > 0, row
    if row["variant"] != "plain":
      assert row["vs_plain"]["pairs"] == result["settings"]["worker_flags"][
          "windows"], row
    assert f"| mlp | {row['towers']} | {row['variant']} |" in stdout
  # Same model, seed and examples per step: every variant, the same loss.
  losses = [r["final_loss"] for r in rows]
  np.testing.assert_allclose(losses, losses[0], rtol=1e-3)
  assert all(r["vs_plain"] for r in rows if r["variant"] != "plain")
  assert all(r["vs_mirrored"] for r in rows if r["variant"] in report.REPLICATE)


# The smoke run above covers the variants; this one, the process per run.
@pytest.mark.wide
def test_smoke_runs_each_variant_in_its_own_process(tmp_path):
  # A process per run (two at a time): its peak memory, and ratios of runs.
  stdout, result = _smoke(tmp_path, "runs", "--towers=2",
                          "--variants=plain,replicate_shared")
  rows = {r["variant"]: r for r in result["rows"]}
  assert sorted(rows) == ["plain", "replicate_shared"]
  for row in rows.values():
    assert row["towers"] == 2 and row["runs"] == 1 and row["failed"] == 0, row
    assert row["examples_per_sec"] > 0 and row["peak_rss_mib"] > 0, row
    assert f"| mlp | 2 | {row['variant']} |" in stdout
  np.testing.assert_allclose(
      rows["replicate_shared"]["final_loss"],
      rows["plain"]["final_loss"],
      rtol=1e-3)
  assert rows["replicate_shared"]["vs_plain"]["median"] > 0


@pytest.mark.wide
def test_smoke_batch_norm_sync_and_unsynced_side_by_side(tmp_path):
  stdout, result = _smoke(
      tmp_path, "windows", "--workloads=cnn_bn", "--towers=2",
      "--variants=plain,replicate_shared,replicate_shared_unsynced")
  rows = {r["variant"]: r for r in result["rows"]}
  assert all(r["runs"] == 1 and r["failed"] == 0 for r in rows.values())
  assert "| × unsynced |" in stdout
  assert rows["replicate_shared"]["vs_unsynced"]["pairs"] == result["settings"][
      "worker_flags"]["windows"]
  # Synced batch norm trains as one device; per-shard statistics do not.
  plain = rows["plain"]["final_loss"]
  np.testing.assert_allclose(
      rows["replicate_shared"]["final_loss"], plain, rtol=1e-4)
  assert abs(rows["replicate_shared_unsynced"]["final_loss"] - plain) > (1e-3 *
                                                                         plain)


def _record(round_index, variant, examples_per_sec, towers=2):
  return {
      "round": round_index,
      "workload": "mlp",
      "towers": towers,
      "variant": variant,
      "examples_per_sec": examples_per_sec,
      "build_s": 1.0,
      "peak_rss_mib": 500.0,
      "cpu_s_per_example": 1e-5,
      "final_loss": 0.5
  }


def _settings(rounds, pairing="runs"):
  return common.Settings(
      variants=list(VARIANTS),
      workloads=["mlp"],
      towers=[2],
      rounds=rounds,
      device_type="CPU",
      fast_exit=True,
      jobs=1,
      worker_flags={
          "batch_size": 256,
          "warmup_steps": 1,
          "window_steps": 1,
          "windows": 1
      },
      pairing=pairing)


def test_ratios_are_taken_within_rounds_then_summarised():
  # The machine runs twice as fast in round 1: the ratios do not move.
  speeds = {
      "plain": 100.0,
      "mirrored": 50.0,
      "replicate_shared": 90.0,
      "replicate_round_robin": 80.0
  }
  records = [
      _record(r, v, s * (1 + r)) for r in range(3) for v, s in speeds.items()
  ]
  records[-2] = dict(records[-2], examples_per_sec=3 * 99.0)  # 0.99x plain
  records.append(dict(_record(2, "mirrored", 0.0), error="timed out"))
  rows = {r["variant"]: r for r in report.aggregate(records, _settings(3))}
  shared = rows["replicate_shared"]
  assert shared["vs_plain"]["median"] == 0.9
  assert shared["vs_plain"]["max"] == 0.99
  assert shared["vs_mirrored"]["median"] == 1.8
  assert rows["mirrored"]["failed"] == 1 and rows["mirrored"]["runs"] == 3
  targets = {t["target"]: t for t in report.check_targets(list(rows.values()))}
  assert targets["N=2: replicate >= 1.3x mirrored"]["met"]
  assert not targets["N=2: replicate >= 0.95x plain"]["met"]
  table = report.markdown(
      list(rows.values()), list(targets.values()), _settings(3))
  assert "| mlp | 2 | replicate_shared | 180 | 0.90 (0.90–0.99) |" in table
  assert "mirrored (1 failed)" in table


def test_windows_taken_in_turn_give_a_ratio_per_window():
  # The machine slows down window by window; each pair of windows agrees.
  drift = [1.0, 0.5, 0.25]

  def record(variant, speed):
    rates = [speed * d for d in drift]
    return dict(
        _record(0, variant, float(np.median(rates))),
        pairing="windows",
        window_examples_per_sec=rates,
        peak_rss_mib=None,
        rss_growth_mib=40.0)

  records = [
      record("plain", 100.0),
      record("mirrored", 50.0),
      record("replicate_shared", 120.0),
      record("replicate_round_robin", 100.0)
  ]
  rows = {
      r["variant"]: r
      for r in report.aggregate(records, _settings(1, "windows"))
  }
  shared = rows["replicate_shared"]
  assert shared["vs_plain"] == {
      "median": 1.2,
      "min": 1.2,
      "max": 1.2,
      "pairs": 3
  }
  assert shared["vs_mirrored"]["median"] == 2.4
  table = report.markdown(list(rows.values()), [], _settings(1, "windows"))
  assert "| mlp | 2 | replicate_shared | 60 | 1.20 (1.20–1.20) |" in table
  assert "| +40 |" in table


@pytest.mark.wide
def test_build_cost_quick_reports_ops_and_ratios(tmp_path):
  # benchmarks/build_cost.py on its small batch-norm CNN: every row, one
  # tower builds the unwrapped graph, and synchronised batch norm stays
  # within 1.2x the ops of unsynchronised (timings are not asserted).
  out = tmp_path / "build.json"
  proc = subprocess.run([
      sys.executable,
      os.path.join(_BENCHMARKS, "build_cost.py"), "--quick", "--towers=1,2",
      "--repeats=1", f"--result_file={out}"
  ],
                        capture_output=True,
                        text=True,
                        timeout=300,
                        cwd=_ROOT,
                        env=common.worker_env())
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = {
      (r["measure"], r["variant"], r["towers"]): r
      for r in json.loads(out.read_text())["rows"]
  }
  assert sorted(rows) == sorted(
      [("model_fn", "plain", 1)] +
      [("model_fn", v, n) for v in ("sync", "unsync") for n in (1, 2)] +
      [("estimator", "plain", 1)] +
      [("estimator", v, n) for v in ("sync", "mirrored") for n in (1, 2)])
  plain = rows[("model_fn", "plain", 1)]["ops"]
  assert rows[("model_fn", "sync", 1)]["ops"] == plain
  assert (rows[("model_fn", "sync", 2)]["ops"]
          <= 1.2 * rows[("model_fn", "unsync", 2)]["ops"])
  assert all(r["build_s"] > 0 and r["x_plain_s"] > 0 for r in rows.values())
  assert "| model_fn | sync | 2 |" in proc.stdout


@pytest.mark.wide
def test_op_times_lists_each_variants_step_and_op_types():
  # benchmarks/op_times.py: a step time, a traced op time and the op types
  # of each variant, in the order asked (timings are not asserted).
  proc = subprocess.run([
      sys.executable,
      os.path.join(_BENCHMARKS, "op_times.py"), "--steps=1", "--trace_steps=1",
      "--towers=2", "--variants=plain,sync", "--top=50"
  ],
                        capture_output=True,
                        text=True,
                        timeout=300,
                        cwd=_ROOT,
                        env=common.worker_env())
  assert proc.returncode == 0, proc.stderr[-4000:]
  heads = [
      line for line in proc.stdout.splitlines() if line.startswith("cnn_bn ")
  ]
  assert [line.split(":")[0] for line in heads
         ] == ["cnn_bn plain N=1", "cnn_bn sync N=2"]
  for line in heads:
    step = float(line.split("step ")[1].split(" ms")[0])
    traced = float(line.split("op time ")[1].split(" ms")[0])
    assert step > 0 and traced > 0, line
  sync = proc.stdout.split("cnn_bn sync N=2")[1]
  assert "FusedBatchNorm" in sync and "Conv2D" in sync


def test_function_calls_reports_each_mode_and_tower_count():
  # benchmarks/function_calls.py: a row per (mode, N), both step times and
  # their ratio (timings are not asserted).
  proc = subprocess.run([
      sys.executable,
      os.path.join(_BENCHMARKS, "function_calls.py"), "--towers=1,2",
      "--windows=1", "--steps=1", "--batch_size=16", "--width=8"
  ],
                        capture_output=True,
                        text=True,
                        timeout=300,
                        cwd=_ROOT,
                        env=common.worker_env())
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = [
      line.split()
      for line in proc.stdout.splitlines()
      if line.startswith(("train ", "eval "))
  ]
  assert [row[:2] for row in rows] == [["train", "1"], ["train", "2"],
                                       ["eval", "1"], ["eval", "2"]]
  for row in rows:
    inline, function, ratio = map(float, row[2:])
    assert inline > 0 and function > 0
    # The times are printed to 0.005 ms and the ratio to 0.0005, so the
    # ratio lies within what the rounded times allow, not near their ratio.
    assert ((function - 0.005) / (inline + 0.005) - 0.0005 <= ratio <=
            (function + 0.005) / (inline - 0.005) + 0.0005), row


@pytest.mark.wide
@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None,
    reason="no C++ compiler to build the experiment's kernels")
def test_native_batch_norm_kernels_give_one_devices_gradients():
  # benchmarks/native_batch_norm.py compiles its kernels against the
  # installed TensorFlow; synchronised through them (with and without the
  # ReLU folded in), or through TensorFlow's kernels with the gradient
  # written out per tower, the first step's loss and gradients are one
  # device's to float rounding (--check's 1e-4 of the largest entry; seen:
  # 1.3e-5), where each tower's own statistics are 1e-2 away. Timings not
  # asserted.
  variants = ["unsync", "hub", "native", "native_relu", "hub_tower_backward"]
  proc = subprocess.run([
      sys.executable,
      os.path.join(_BENCHMARKS, "native_batch_norm.py"), "--check",
      "--towers=2", f"--variants={','.join(variants)}", "--replicate=false",
      "--warmup_steps=1", "--windows=2", "--window_steps=1"
  ],
                        capture_output=True,
                        text=True,
                        timeout=300,
                        cwd=_ROOT,
                        env=common.worker_env())
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  differences = {
      line.split()[2][:-1]: float(line.split("one device ")[1].split()[0])
      for line in proc.stdout.splitlines()
      if line.startswith("check N=2 ")
  }
  assert sorted(differences) == sorted(variants)
  assert differences["unsync"] > 1e-3
  for variant in variants[1:]:
    assert differences[variant] <= 1e-4, (variant, differences)
  rows = [line for line in proc.stdout.splitlines() if line.startswith("| 2 |")]
  assert [row.split("|")[2].strip() for row in rows] == variants


def test_device_bytes_counts_what_each_placement_moves():
  # SHARED: every tower reads every parameter from the host and sends its
  # gradient back; ROUND_ROBIN: only the input shards leave the host, the
  # parameters move between the towers.
  import device_bytes  # pylint: disable=g-import-not-at-top
  shared = device_bytes.measure("mlp", "shared", 2, 64)
  spread = device_bytes.measure("mlp", "round_robin", 2, 64)
  parameters = shared["P_MB"]
  inputs = 64 * (784 + 1) * 4 / 1e6  # float32 features, int32 labels
  assert shared["between_towers_MB"] == 0
  assert shared["host_towers_MB"] >= 2 * 2 * parameters + inputs
  assert spread["host_towers_MB"] < inputs * 1.01
  # Each parameter crosses between the two towers twice (read, gradient)
  # when it lives on the other one: about P in each direction in all.
  assert 0.99 * 2 * parameters <= spread["between_towers_MB"] <= (2.01 *
                                                                  parameters)


@pytest.mark.parametrize("workload", ["mlp", "cnn_bn", "embedding"])
def test_mirrored_moves_the_ring_minimum_and_the_host_only_inputs(
    workload, monkeypatch):
  # Three towers: each sends and receives 2(N-1)/N of the parameters' bytes
  # (a ring all-reduce; sparse rows for the embedding), nothing is summed or
  # updated on the host, and every device holds a copy. Batch norm meets
  # as between GPUs (moments, not the concatenated batch), as the
  # benchmark runs it.
  import device_bytes  # pylint: disable=g-import-not-at-top

  from replicate._batch_norm import whole_batch  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(whole_batch, "_CONCATENATE_ON_HOST", False)
  row = device_bytes.measure(workload, "mirrored", 3, 33)
  inputs = 33 * (784 + 1) * 4 / 1e6
  assert row["host_towers_MB"] < inputs * 1.01
  assert row["sent_x_min"] <= 1.1 and row["received_x_min"] <= 1.1
  if workload != "embedding":
    assert row["sent_x_min"] >= 0.99 and row["received_x_min"] >= 0.99
  assert row["busiest_over_mean"] <= 1.1
  assert row["held_heaviest_over_mean"] <= 1.001


@pytest.mark.parametrize("workload", ["mlp", "cnn_bn"])
def test_mirrored_with_a_dynamic_loss_scale_moves_the_ring_minimum(
    workload, monkeypatch):
  # The update sits in the loss scale's tf.cond: each device runs its own
  # copy of it, so the traffic is the plain update's.
  import device_bytes  # pylint: disable=g-import-not-at-top

  from replicate._batch_norm import whole_batch  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(whole_batch, "_CONCATENATE_ON_HOST", False)
  row = device_bytes.measure(workload, "mirrored", 3, 33, precision="mixed")
  inputs = 33 * (784 + 1) * 4 / 1e6
  assert row["host_towers_MB"] < inputs * 1.01 + 0.001
  assert 0.99 <= row["sent_x_min"] <= 1.1
  assert 0.99 <= row["received_x_min"] <= 1.1
  assert row["busiest_over_mean"] <= 1.1


@pytest.mark.parametrize("mode", ["eval", "predict"])
def test_mirrored_evaluation_and_prediction_move_no_parameters(mode):
  # Each tower reads its own device's copy: between the devices only the
  # input shards, the output rows and the metrics' scalars move.
  import device_bytes  # pylint: disable=g-import-not-at-top
  row = device_bytes.measure("mlp", "mirrored", 3, 33, mode=mode)
  shards = 33 * (784 + 1) * 4 / 1e6
  assert row["between_towers_MB"] <= 0.064 * 3
  assert row["host_towers_MB"] <= 1.2 * shards + 0.064 * 3


def test_gpu_benchmark_runs_and_reports_the_machine_and_scaling(tmp_path):
  # Two virtual CPUs stand in for GPUs, tiny models, one step: the command
  # a user with GPUs runs as it is.
  out = tmp_path / "gpu.json"
  subprocess.run([
      sys.executable,
      os.path.join(_BENCHMARKS, "gpu.py"), "--tiny", "--cpus=2", "--steps=1",
      "--warmup=0", "--batch_per_device=2", "--models=transformer",
      "--precisions=mixed", f"--out={out}"
  ],
                 check=True,
                 capture_output=True,
                 timeout=600)
  results = json.loads(out.read_text())
  assert results["machine"]["tensorflow"]
  variants = {(r["variant"], r["devices"]) for r in results["results"]}
  assert variants == {("plain", 1), ("mirrored", 2), ("round_robin", 2),
                      ("strategy", 2)}
  for row in results["results"]:
    assert row["examples_per_sec"] > 0
    assert row["scaling"] > 0
