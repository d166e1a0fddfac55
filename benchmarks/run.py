r"""Benchmarks plain, MirroredStrategy and replicate side by side.

Each (variant, workload, tower count) trains in its own process
(`benchmarks/worker.py`), so each can configure its own virtual devices.
Variants are interleaved: every round runs every variant once per
(workload, N), in an order rotated from round to round, and ratios are
taken between runs of the same round, so that a machine whose speed drifts
still compares like with like. The table reports medians over rounds and
the min-max spread of the same-round ratios.

With --pairing=windows (what --quick uses) a round's variants share one
process per (workload, N) and take turns window by window, so the ratios
pair windows seconds apart (window k of one variant with window k of the
other); peak RSS is then the process's, so each variant reports the memory
its build and warm-up added instead, and no return time.

  .venv/bin/python benchmarks/run.py --quick
  .venv/bin/python benchmarks/run.py --out results.json --plot results.png
  .venv/bin/python benchmarks/run.py --batch_norm   # sync batch norm's cost

Figures per run, all measured by a SessionRunHook in the worker:
  ex/s     training examples/sec, median over timed windows after warm-up
  build s  from the train() call to the end of the first step
  RSS      peak resident memory of the worker process
  CPU      process CPU seconds per example over the timed windows
  cores    process CPU seconds / wall seconds over the timed windows (how
           many cores the run got: low values mean a busy machine)
  return s how long train() took to return after the last step (not with
           --fast_exit, which --quick and --smoke use)
  loss     the loss at the last timed step (same data, seed and model)
"""

from concurrent import futures
import dataclasses
import json
import os
import tempfile
import time
from typing import Any, Dict, List, Sequence

from absl import app
from absl import flags
from absl import logging
import common
from common import Settings
import report

VARIANTS = common.VARIANTS
WORKLOADS = ("mlp", "cnn", "cnn_bn", "resnet50", "mlp_top_k",
             "mlp_top_k_by_hand", "mlp_clipped_before_use")
DEFAULT_WORKLOADS = ("mlp", "cnn")

FLAGS = flags.FLAGS
flags.DEFINE_list("variants", list(common.DEFAULT_VARIANTS),
                  f"Subset of {VARIANTS}.")
flags.DEFINE_list("workloads", list(DEFAULT_WORKLOADS),
                  f"Subset of {WORKLOADS}.")
flags.DEFINE_list("towers", ["1", "2", "4", "8"], "Tower counts N.")
flags.DEFINE_integer(
    "rounds", 3, "Rounds; each runs every variant once.", lower_bound=1)
common.define_timing_flags()
flags.DEFINE_integer("seed", 0, "Data and weight seed.")
flags.DEFINE_integer("inter_op_threads", 0, "Same for all variants; 0: TF's.")
flags.DEFINE_integer("intra_op_threads", 0, "Same for all variants; 0: TF's.")
flags.DEFINE_enum("device_type", "auto", ["auto", "CPU", "GPU"],
                  "auto: GPUs if TensorFlow sees any, else virtual CPUs.")
flags.DEFINE_bool(
    "fast_exit", False, "Workers exit right after their last step (skips the "
    "end-of-training checkpoint and teardown; no 'return s').")
flags.DEFINE_integer(
    "run_timeout", 600, "Seconds before a run is killed.", lower_bound=1)
flags.DEFINE_integer(
    "jobs",
    1, "Runs at once. Keep 1 to measure: concurrent runs share "
    "the cores; --smoke uses 2 (it checks, not measures).",
    lower_bound=1)
flags.DEFINE_enum(
    "pairing", "runs", ["runs", "windows"],
    "runs: a process per variant, ratios between runs of a "
    "round; windows: the variants of a round share a process, "
    "ratios between windows taken in turn.")
flags.DEFINE_bool(
    "quick", False, "Regression check, < 3 min on 2 cores: mlp, N in {1, 2}, "
    "3 rounds of few steps (explicit flags still win).")
flags.DEFINE_bool(
    "batch_norm", False, "Cost of sync batch norm (issue 16): cnn_bn, plain vs "
    "replicate_shared (sync_batch_norm=True) vs "
    "replicate_shared_unsynced (False), N in {1, 2, 4}, "
    "paired windows (explicit flags still win).")
flags.DEFINE_bool(
    "smoke", False, "Fastest check that everything runs: mlp, N in {1, 2}, one "
    "round of a few tiny steps (explicit flags still win).")
flags.DEFINE_string("out", None, "Write every run and the table as JSON.")
flags.DEFINE_string("plot", None, "Write a PNG (needs matplotlib).")
flags.DEFINE_string(
    "from_json", None,
    "Run nothing: report (and --plot) the runs saved in this "
    "--out file.")

# Presets; a flag given on the command line overrides them.
_PRESETS = {
    "batch_norm":
        dict(
            workloads=["cnn_bn"],
            towers=["1", "2", "4"],
            variants=["plain", "replicate_shared", "replicate_shared_unsynced"],
            rounds=3,
            warmup_steps=10,
            window_steps=20,
            windows=6,
            fast_exit=True,
            pairing="windows"),
    "quick":
        dict(
            workloads=["mlp"],
            towers=["1", "2"],
            rounds=3,
            warmup_steps=10,
            window_steps=50,
            windows=6,
            fast_exit=True,
            pairing="windows"),
    "smoke":
        dict(
            workloads=["mlp"],
            towers=["1", "2"],
            rounds=1,
            batch_size=64,
            examples=256,
            warmup_steps=1,
            window_steps=2,
            windows=2,
            fast_exit=True,
            jobs=2),
}
_WORKER_FLAGS = ("batch_size", "examples", "warmup_steps", "window_steps",
                 "windows", "seed", "inter_op_threads", "intra_op_threads",
                 "logical_gpus", "gpu_memory_mb")


def _flag(name: str, presets: Dict[str, Any]):
  """The flag's value if given on the command line, else the preset's."""
  if FLAGS[name].present or name not in presets:
    return FLAGS[name].value
  return presets[name]


def _check_subset(name: str, values: Sequence[str], allowed: Sequence[str]):
  """Refuses empty lists and unknown names."""
  unknown = [v for v in values if v not in allowed]
  if unknown or not values:
    raise app.UsageError(f"--{name}={','.join(values)}: choose from "
                         f"{','.join(allowed)}.")


def resolve_settings() -> Settings:
  """Flags, presets (--quick, --smoke) and the device type, checked."""
  presets = {}
  for preset in ("batch_norm", "quick", "smoke"):
    if FLAGS[preset].value:
      presets.update(_PRESETS[preset])
  variants, workloads = _flag("variants", presets), _flag("workloads", presets)
  _check_subset("variants", variants, VARIANTS)
  _check_subset("workloads", workloads, WORKLOADS)
  towers = sorted({int(n) for n in _flag("towers", presets)})
  batch = _flag("batch_size", presets)
  if any(n < 1 or batch % n for n in towers):
    raise app.UsageError(f"--towers={towers}: each must be >= 1 and divide "
                         f"--batch_size={batch}.")
  device_type = FLAGS.device_type
  gpus = 0 if device_type == "CPU" else common.count_gpus(
      _flag("logical_gpus", presets))
  if device_type == "auto":
    device_type = "GPU" if gpus else "CPU"
  if device_type == "GPU":
    skipped = [n for n in towers if n > gpus]
    if skipped:
      logging.warning("Only %d GPUs: skipping N=%s.", gpus, skipped)
    towers = [n for n in towers if n <= gpus]
  return Settings(
      variants=list(variants),
      workloads=list(workloads),
      towers=towers,
      rounds=_flag("rounds", presets),
      device_type=device_type,
      fast_exit=_flag("fast_exit", presets),
      jobs=_flag("jobs", presets),
      worker_flags={k: _flag(k, presets) for k in _WORKER_FLAGS},
      pairing=_flag("pairing", presets))


def rotated(variants: Sequence[str], round_index: int) -> List[str]:
  """The variants, starting at a position that moves each round."""
  k = round_index % len(variants)
  return list(variants[k:]) + list(variants[:k])


def schedule(settings: Settings) -> List[Dict[str, Any]]:
  """Every process in order: by round, then workload and N, variants rotated.

  Each entry lists the variants its process runs: one, or (pairing by
  windows) all of them.
  """
  runs = []
  for r in range(settings.rounds):
    for workload in settings.workloads:
      for n in settings.towers:
        order = rotated(settings.variants, r + n)
        groups = ([order] if settings.pairing == "windows" else
                  [[variant] for variant in order])
        runs += [
            dict(round=r, workload=workload, towers=n, variants=group)
            for group in groups
        ]
  return runs


def run_worker(run: Dict[str, Any], settings: Settings,
               result_file: str) -> List[Dict[str, Any]]:
  """One process; a record per variant (with an 'error' if it failed)."""
  worker_flags = dict(
      workload=run["workload"],
      towers=run["towers"],
      device_type=settings.device_type,
      fast_exit=settings.fast_exit,
      **settings.worker_flags)
  if settings.pairing == "windows":
    worker_flags["together"] = ",".join(run["variants"])
  else:
    worker_flags["variant"] = run["variants"][0]
  result = common.run_worker(worker_flags, result_file, FLAGS.run_timeout)
  wall = result.pop("process_wall_s")
  found = result.pop("records", [result])
  by_variant = {r.get("variant"): r for r in found}
  records = []
  for variant in run["variants"]:
    record = dict(
        round=run["round"],
        workload=run["workload"],
        towers=run["towers"],
        variant=variant,
        process_wall_s=wall)
    record.update(
        by_variant.get(variant) or {"error": result.get("error", "no record")})
    records.append(record)
  return records


def run_all(settings: Settings) -> List[Dict[str, Any]]:
  """Every scheduled run, in order (--jobs at once), each in its process."""
  runs = schedule(settings)
  done = []

  def one(index: int, run: Dict[str, Any], scratch: str):
    result_file = os.path.join(scratch, f"result_{index}.json")
    records = run_worker(run, settings, result_file)
    done.append(index)
    for record in records:
      logging.info(
          "[%d/%d] round %d %s N=%d %s: %s (%.1f s)", len(done), len(runs),
          run["round"], run["workload"], run["towers"], record["variant"],
          record.get("error", "")[:200] or
          f"{record['examples_per_sec']:,.0f} ex/s", record["process_wall_s"])
    return records

  with tempfile.TemporaryDirectory(prefix="replicate_bench_") as scratch:
    with futures.ThreadPoolExecutor(max_workers=settings.jobs) as pool:
      return [
          record
          for records in pool.map(one, range(len(runs)), runs, [scratch] *
                                  len(runs))
          for record in records
      ]


def load_runs(path: str):
  """Settings and records saved by --out."""
  with open(path) as f:
    saved = json.load(f)
  return Settings(**saved["settings"]), saved["runs"]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  started = time.perf_counter()
  if FLAGS.from_json:
    settings, records = load_runs(FLAGS.from_json)
  else:
    settings = resolve_settings()
    records = run_all(settings)
  rows = report.aggregate(records, settings)
  targets = report.check_targets(rows)
  print(report.markdown(rows, targets, settings))
  failures = [r for r in records if "error" in r]
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(
          {
              "settings": dataclasses.asdict(settings),
              "rows": rows,
              "targets": targets,
              "runs": records,
              "wall_s": time.perf_counter() - started
          },
          f,
          indent=1)
  if FLAGS.plot:
    report.plot(rows, settings, FLAGS.plot)
  logging.info("Done in %.0f s.", time.perf_counter() - started)
  for failure in failures:
    logging.error("%s %s N=%d round %d failed: %s", failure["workload"],
                  failure["variant"], failure["towers"], failure["round"],
                  failure["error"])
  return 1 if failures else 0


if __name__ == "__main__":
  app.run(main)
