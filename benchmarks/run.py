r"""Benchmarks plain, MirroredStrategy and replicate side by side.

Each (variant, workload, tower count) trains in its own process
(`benchmarks/worker.py`), so each can configure its own virtual devices.
Variants are interleaved: every round runs every variant once per
(workload, N), in an order rotated from round to round, and ratios are
taken between runs of the same round, so that a machine whose speed drifts
still compares like with like. The table reports medians over rounds and
the min-max spread of the same-round ratios.

  .venv/bin/python benchmarks/run.py --quick
  .venv/bin/python benchmarks/run.py --out results.json --plot results.png

Figures per run, all measured by a SessionRunHook in the worker:
  ex/s     training examples/sec, median over timed windows after warm-up
  build s  from the train() call to the end of the first step
  RSS      peak resident memory of the worker process
  CPU      process CPU seconds per example over the timed windows
  loss     the loss at the last timed step (same data, seed and model)
"""

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from absl import app
from absl import flags
from absl import logging

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_WORKER = os.path.join(_HERE, "worker.py")
VARIANTS = ("plain", "mirrored", "replicate_shared", "replicate_round_robin")
WORKLOADS = ("mlp", "cnn")
REPLICATE = ("replicate_shared", "replicate_round_robin")

FLAGS = flags.FLAGS
flags.DEFINE_list("variants", list(VARIANTS), f"Subset of {VARIANTS}.")
flags.DEFINE_list("workloads", list(WORKLOADS), f"Subset of {WORKLOADS}.")
flags.DEFINE_list("towers", ["1", "2", "4", "8"], "Tower counts N.")
flags.DEFINE_integer("rounds", 3, "Rounds; each runs every variant once.")
flags.DEFINE_integer("batch_size", 256, "Global batch, same for all variants.")
flags.DEFINE_integer("examples", 2048, "Synthetic examples per workload.")
flags.DEFINE_integer("warmup_steps", 20, "Untimed steps after the first.")
flags.DEFINE_integer("window_steps", 20, "Steps per timed window.")
flags.DEFINE_integer("windows", 5, "Timed windows per run.")
flags.DEFINE_integer("seed", 0, "Data and weight seed.")
flags.DEFINE_integer("inter_op_threads", 0, "Same for all variants; 0: TF's.")
flags.DEFINE_integer("intra_op_threads", 0, "Same for all variants; 0: TF's.")
flags.DEFINE_enum("device_type", "auto", ["auto", "CPU", "GPU"],
                  "auto: GPUs if TensorFlow sees any, else virtual CPUs.")
flags.DEFINE_bool("fast_exit", False,
                  "Workers exit right after their last step (skips the "
                  "end-of-training checkpoint and teardown; no 'return s').")
flags.DEFINE_integer("run_timeout", 600, "Seconds before a run is killed.")
flags.DEFINE_bool("quick", False,
                  "Regression check, < 3 min on 2 cores: mlp, N in {1, 2}, "
                  "3 rounds of few steps (explicit flags still win).")
flags.DEFINE_bool("smoke", False,
                  "Fastest check that everything runs: mlp, N in {1, 2}, one "
                  "round of a few tiny steps (explicit flags still win).")
flags.DEFINE_string("out", None, "Write every run and the table as JSON.")
flags.DEFINE_string("plot", None, "Write a PNG (needs matplotlib).")

# Presets; a flag given on the command line overrides them.
_PRESETS = {
    "quick": dict(workloads=["mlp"], towers=["1", "2"], rounds=3,
                  warmup_steps=10, window_steps=10, windows=3,
                  fast_exit=True),
    "smoke": dict(workloads=["mlp"], towers=["1", "2"], rounds=1,
                  batch_size=64, examples=256, warmup_steps=1,
                  window_steps=2, windows=2, fast_exit=True),
}
_WORKER_FLAGS = ("batch_size", "examples", "warmup_steps", "window_steps",
                 "windows", "seed", "inter_op_threads", "intra_op_threads")

# The project's targets: (name, towers, variant, against, minimum ratio).
TARGETS = (
    ("1 tower: replicate within 2% of plain", 1, "replicate_shared",
     "plain", 0.98),
    ("1 tower: replicate within 2% of plain", 1, "replicate_round_robin",
     "plain", 0.98),
    ("N=2: replicate >= 1.3x mirrored", 2, "replicate_shared", "mirrored",
     1.3),
    ("N=2: replicate >= 0.95x plain", 2, "replicate_shared", "plain", 0.95),
    ("N=4: replicate >= 1.3x mirrored", 4, "replicate_shared", "mirrored",
     1.3),
    ("N=4: replicate >= 0.9x plain", 4, "replicate_shared", "plain", 0.9),
)


@dataclasses.dataclass
class Settings:
  """The resolved configuration of one benchmark."""
  variants: List[str]
  workloads: List[str]
  towers: List[int]
  rounds: int
  device_type: str
  fast_exit: bool
  worker_flags: Dict[str, Any]


def _flag(name: str, presets: Dict[str, Any]):
  if FLAGS[name].present or name not in presets:
    return FLAGS[name].value
  return presets[name]


def _check_subset(name: str, values: Sequence[str], allowed: Sequence[str]):
  unknown = [v for v in values if v not in allowed]
  if unknown or not values:
    raise app.UsageError(f"--{name}={','.join(values)}: choose from "
                         f"{','.join(allowed)}.")


def resolve_settings() -> Settings:
  """Flags, presets (--quick, --smoke) and the device type, checked."""
  presets = {}
  for preset in ("quick", "smoke"):
    if FLAGS[preset].value:
      presets.update(_PRESETS[preset])
  variants, workloads = FLAGS.variants, _flag("workloads", presets)
  _check_subset("variants", variants, VARIANTS)
  _check_subset("workloads", workloads, WORKLOADS)
  towers = sorted({int(n) for n in _flag("towers", presets)})
  batch = _flag("batch_size", presets)
  if any(n < 1 or batch % n for n in towers):
    raise app.UsageError(f"--towers={towers}: each must be >= 1 and divide "
                         f"--batch_size={batch}.")
  device_type = FLAGS.device_type
  if device_type == "auto":
    device_type = "GPU" if count_gpus() else "CPU"
  if device_type == "GPU":
    gpus = count_gpus()
    skipped = [n for n in towers if n > gpus]
    if skipped:
      logging.warning("Only %d GPUs: skipping N=%s.", gpus, skipped)
    towers = [n for n in towers if n <= gpus]
  return Settings(
      variants=list(variants), workloads=list(workloads), towers=towers,
      rounds=_flag("rounds", presets), device_type=device_type,
      fast_exit=_flag("fast_exit", presets),
      worker_flags={k: _flag(k, presets) for k in _WORKER_FLAGS})


def count_gpus() -> int:
  """GPUs TensorFlow sees, asked in a subprocess (no TF in this one)."""
  code = ("import tensorflow as tf; "
          "print(len(tf.config.list_physical_devices('GPU')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, env=_worker_env(), check=True).stdout
  return int(out.strip().splitlines()[-1])


def _worker_env() -> Dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


def rotated(variants: Sequence[str], round_index: int) -> List[str]:
  k = round_index % len(variants)
  return list(variants[k:]) + list(variants[:k])


def schedule(settings: Settings) -> List[Dict[str, Any]]:
  """Every run in order: by round, then workload and N, variants rotated."""
  runs = []
  for r in range(settings.rounds):
    for workload in settings.workloads:
      for n in settings.towers:
        for variant in rotated(settings.variants, r + n):
          runs.append(dict(round=r, workload=workload, towers=n,
                           variant=variant))
  return runs


def run_worker(run: Dict[str, Any], settings: Settings,
               scratch: str) -> Dict[str, Any]:
  """One run in a subprocess; its record, or one with an 'error'."""
  result = os.path.join(scratch, "result.json")
  if os.path.exists(result):
    os.remove(result)
  args = [sys.executable, _WORKER, f"--variant={run['variant']}",
          f"--workload={run['workload']}", f"--towers={run['towers']}",
          f"--device_type={settings.device_type}", f"--result_file={result}",
          f"--fast_exit={settings.fast_exit}"]
  args += [f"--{k}={v}" for k, v in settings.worker_flags.items()]
  started = time.perf_counter()
  try:
    proc = subprocess.run(args, capture_output=True, text=True,
                          env=_worker_env(), timeout=FLAGS.run_timeout)
    error = None if proc.returncode == 0 and os.path.exists(result) else (
        f"exit {proc.returncode}: {proc.stderr[-2000:]}")
  except subprocess.TimeoutExpired:
    error = f"timed out after {FLAGS.run_timeout} s"
  record = dict(run)
  if error is None:
    with open(result) as f:
      record.update(json.load(f))
  else:
    record["error"] = error
  record["process_wall_s"] = time.perf_counter() - started
  return record


def _median(values: Sequence[float]) -> Optional[float]:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def _ratios(records, variant: str, against: str) -> List[float]:
  """Same-round examples/sec ratios `variant` / `against`."""
  by_round = {}
  for r in records:
    if "error" not in r:
      by_round.setdefault(r["round"], {})[r["variant"]] = r["examples_per_sec"]
  return [v[variant] / v[against] for v in by_round.values()
          if variant in v and against in v and variant != against]


def _spread(ratios: List[float]) -> Optional[Dict[str, float]]:
  if not ratios:
    return None
  return {"median": statistics.median(ratios), "min": min(ratios),
          "max": max(ratios), "rounds": len(ratios)}


def aggregate(records: List[Dict[str, Any]],
              settings: Settings) -> List[Dict[str, Any]]:
  """One row per (workload, N, variant): medians over rounds and ratios."""
  rows = []
  for workload in settings.workloads:
    for n in settings.towers:
      group = [r for r in records
               if r["workload"] == workload and r["towers"] == n]
      for variant in settings.variants:
        mine = [r for r in group if r["variant"] == variant]
        ok = [r for r in mine if "error" not in r]
        row = {"workload": workload, "towers": n, "variant": variant,
               "runs": len(ok), "failed": len(mine) - len(ok)}
        for key in ("examples_per_sec", "build_s", "peak_rss_mib",
                    "cpu_s_per_example", "final_loss",
                    "return_after_last_step_s"):
          row[key] = _median([r.get(key) for r in ok])
        row["vs_plain"] = _spread(_ratios(group, variant, "plain"))
        if variant in REPLICATE:
          row["vs_mirrored"] = _spread(_ratios(group, variant, "mirrored"))
        rows.append(row)
  return rows


def check_targets(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """The project's ratio targets that this run measured."""
  found = []
  for name, n, variant, against, minimum in TARGETS:
    for row in rows:
      if row["towers"] != n or row["variant"] != variant:
        continue
      spread = row.get(f"vs_{against}")
      if spread is None:
        continue
      found.append({"target": name, "workload": row["workload"],
                    "variant": variant, "towers": n, "minimum": minimum,
                    "ratio": spread, "met": spread["median"] >= minimum})
  return found


def _fmt(value: Optional[float], spec: str) -> str:
  return "–" if value is None or not math.isfinite(value) else format(
      value, spec)


def _fmt_ratio(spread: Optional[Dict[str, float]]) -> str:
  if spread is None:
    return "–"
  return (f"{spread['median']:.2f} "
          f"({spread['min']:.2f}–{spread['max']:.2f})")


def markdown(rows: List[Dict[str, Any]], targets: List[Dict[str, Any]],
             settings: Settings) -> str:
  """The side-by-side table and the targets, as markdown."""
  w = settings.worker_flags
  lines = [
      f"Devices: {settings.device_type}; global batch {w['batch_size']}; "
      f"{w['warmup_steps']} warm-up steps, {w['windows']} windows of "
      f"{w['window_steps']} steps; {settings.rounds} rounds. ex/s and the "
      "other figures: median over rounds; ratios: median (min–max) of "
      "same-round ratios.", "",
      "| workload | N | variant | ex/s | × plain | × mirrored | build s "
      "| return s | peak RSS MiB | CPU µs/ex | final loss |",
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for row in rows:
    failed = f" ({row['failed']} failed)" if row["failed"] else ""
    cpu = row["cpu_s_per_example"]
    lines.append(
        f"| {row['workload']} | {row['towers']} | {row['variant']}{failed} "
        f"| {_fmt(row['examples_per_sec'], ',.0f')} "
        f"| {_fmt_ratio(row['vs_plain'])} "
        f"| {_fmt_ratio(row.get('vs_mirrored'))} "
        f"| {_fmt(row['build_s'], '.2f')} "
        f"| {_fmt(row['return_after_last_step_s'], '.2f')} "
        f"| {_fmt(row['peak_rss_mib'], '.0f')} "
        f"| {_fmt(None if cpu is None else cpu * 1e6, '.1f')} "
        f"| {_fmt(row['final_loss'], '.4f')} |")
  if targets:
    lines += ["", "| target | workload | ratio | met |", "|---|---|---:|---|"]
    for t in targets:
      lines.append(f"| {t['target']} ({t['variant']}) | {t['workload']} "
                   f"| {_fmt_ratio(t['ratio'])} | "
                   f"{'yes' if t['met'] else 'NO'} |")
  return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], settings: Settings, path: str) -> bool:
  """Examples/sec and build time vs N, one line per variant; False if no
  matplotlib."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  except ImportError:
    logging.warning("matplotlib is not installed: no plot (pip install "
                    "matplotlib, or the package's [benchmarks] extra).")
    return False
  columns = len(settings.workloads)
  figure, axes = pyplot.subplots(2, columns, figsize=(5 * columns, 7),
                                 squeeze=False)
  for col, workload in enumerate(settings.workloads):
    for variant in settings.variants:
      mine = [r for r in rows if r["workload"] == workload and
              r["variant"] == variant and r["examples_per_sec"] is not None]
      ns = [r["towers"] for r in mine]
      axes[0][col].plot(ns, [r["examples_per_sec"] for r in mine], "o-",
                        label=variant)
      axes[1][col].plot(ns, [r["build_s"] for r in mine], "o-", label=variant)
    axes[0][col].set_title(f"{workload}: training examples/sec")
    axes[1][col].set_title(f"{workload}: graph build + first step (s)")
    for ax in (axes[0][col], axes[1][col]):
      ax.set_xscale("log", base=2)
      ax.set_xticks(settings.towers, [str(n) for n in settings.towers])
      ax.set_xlabel(f"towers N ({settings.device_type})")
      ax.grid(True, alpha=0.3)
  axes[0][0].legend()
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  return True


def run_all(settings: Settings) -> List[Dict[str, Any]]:
  """Every scheduled run, in order, each in its own process."""
  runs = schedule(settings)
  records = []
  with tempfile.TemporaryDirectory(prefix="replicate_bench_") as scratch:
    for i, run in enumerate(runs, start=1):
      record = run_worker(run, settings, scratch)
      records.append(record)
      logging.info("[%d/%d] round %d %s N=%d %s: %s (%.1f s)", i, len(runs),
                   run["round"], run["workload"], run["towers"],
                   run["variant"], record.get("error") or
                   f"{record['examples_per_sec']:,.0f} ex/s",
                   record["process_wall_s"])
  return records


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  started = time.perf_counter()
  settings = resolve_settings()
  records = run_all(settings)
  rows = aggregate(records, settings)
  targets = check_targets(rows)
  print(markdown(rows, targets, settings))
  failures = [r for r in records if "error" in r]
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump({"settings": dataclasses.asdict(settings), "rows": rows,
                 "targets": targets, "runs": records,
                 "wall_s": time.perf_counter() - started}, f, indent=1)
  if FLAGS.plot:
    plot(rows, settings, FLAGS.plot)
  logging.info("Done in %.0f s.", time.perf_counter() - started)
  for failure in failures:
    logging.error("%s %s N=%d round %d failed: %s", failure["workload"],
                  failure["variant"], failure["towers"], failure["round"],
                  failure["error"])
  return 1 if failures else 0


if __name__ == "__main__":
  app.run(main)
