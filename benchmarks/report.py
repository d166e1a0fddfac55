"""Aggregating benchmark runs: medians, same-round ratios, targets, output.

No TensorFlow and no flags here: everything works on the JSON records the
workers write, so it can be tested and re-run on saved results.
"""

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence

from absl import logging
from common import Settings

REPLICATE = ("replicate_shared", "replicate_round_robin",
             "replicate_shared_unsynced", "replicate_mirrored")
# sync_batch_norm=True vs False: replicate_shared's ratio to this one.
UNSYNCED = "replicate_shared_unsynced"

# The project's targets: (name, towers, variant, against, minimum ratio).
TARGETS = (
    ("1 tower: replicate within 2% of plain", 1, "replicate_shared", "plain",
     0.98),
    ("1 tower: replicate within 2% of plain", 1, "replicate_round_robin",
     "plain", 0.98),
    ("N=2: replicate >= 1.3x mirrored", 2, "replicate_shared", "mirrored", 1.3),
    ("N=2: replicate >= 0.95x plain", 2, "replicate_shared", "plain", 0.95),
    ("N=4: replicate >= 1.3x mirrored", 4, "replicate_shared", "mirrored", 1.3),
    ("N=4: replicate >= 0.9x plain", 4, "replicate_shared", "plain", 0.9),
)


def _median(values: Sequence[float]) -> Optional[float]:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def ratios(records, variant: str, against: str) -> List[float]:
  """Examples/sec ratios `variant` / `against`, taken within rounds.

  Runs that took turns window by window in one process (pairing
  'windows') give one ratio per pair of windows; separate runs, one per
  round.
  """
  by_round = {}
  for r in records:
    if "error" not in r:
      by_round.setdefault(r["round"], {})[r["variant"]] = r
  found = []
  for runs in by_round.values():
    if variant == against or variant not in runs or against not in runs:
      continue
    mine, theirs = runs[variant], runs[against]
    if mine.get("pairing") == theirs.get("pairing") == "windows":
      found += [
          a / b for a, b in zip(mine["window_examples_per_sec"],
                                theirs["window_examples_per_sec"])
      ]
    else:
      found.append(mine["examples_per_sec"] / theirs["examples_per_sec"])
  return found


def spread(values: List[float]) -> Optional[Dict[str, float]]:
  """Median, min, max and count of ratios (None without any)."""
  if not values:
    return None
  return {
      "median": statistics.median(values),
      "min": min(values),
      "max": max(values),
      "pairs": len(values)
  }


def aggregate(records: List[Dict[str, Any]],
              settings: Settings) -> List[Dict[str, Any]]:
  """One row per (workload, N, variant): medians over rounds and ratios."""
  rows = []
  for workload in settings.workloads:
    for n in settings.towers:
      group = [
          r for r in records if r["workload"] == workload and r["towers"] == n
      ]
      for variant in settings.variants:
        mine = [r for r in group if r["variant"] == variant]
        ok = [r for r in mine if "error" not in r]
        row = {
            "workload": workload,
            "towers": n,
            "variant": variant,
            "runs": len(ok),
            "failed": len(mine) - len(ok)
        }
        for key in ("examples_per_sec", "build_s", "peak_rss_mib",
                    "rss_growth_mib", "cpu_s_per_example", "cores_used",
                    "final_loss", "return_after_last_step_s"):
          row[key] = _median([r.get(key) for r in ok])
        row["vs_plain"] = spread(ratios(group, variant, "plain"))
        if variant in REPLICATE:
          row["vs_mirrored"] = spread(ratios(group, variant, "mirrored"))
        if variant == "replicate_shared":
          row["vs_unsynced"] = spread(ratios(group, variant, UNSYNCED))
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
      found.append({
          "target": name,
          "workload": row["workload"],
          "variant": variant,
          "towers": n,
          "minimum": minimum,
          "ratio": spread,
          "met": spread["median"] >= minimum
      })
  return found


def _fmt(value: Optional[float], spec: str) -> str:
  return "–" if value is None or not math.isfinite(value) else format(
      value, spec)


def _fmt_ratio(spread: Optional[Dict[str, float]]) -> str:
  if spread is None:
    return "–"
  return (f"{spread['median']:.2f} "
          f"({spread['min']:.2f}–{spread['max']:.2f})")


def _memory(row: Dict[str, Any]) -> str:
  if row.get("peak_rss_mib") is None and row.get("rss_growth_mib") is not None:
    return "+" + _fmt(row["rss_growth_mib"], ".0f")
  return _fmt(row.get("peak_rss_mib"), ".0f")


def markdown(rows: List[Dict[str, Any]], targets: List[Dict[str, Any]],
             settings: Settings) -> str:
  """The side-by-side table and the targets, as markdown."""
  w = settings.worker_flags
  if settings.pairing == "windows":
    pairing = ("variants of a round in one process, taking turns window by "
               "window; ratios: median (min–max) of the ratios of windows "
               "taken in turn; memory: '+' what the variant's build and "
               "warm-up added to the shared process")
  else:
    pairing = ("a process per run; ratios: median (min–max) of same-round "
               "ratios")
  # A "× unsynced" column (sync_batch_norm True / False) when measured.
  unsynced = UNSYNCED in settings.variants
  lines = [
      f"Devices: {settings.device_type}; global batch {w['batch_size']}; "
      f"{w['warmup_steps']} warm-up steps, {w['windows']} windows of "
      f"{w['window_steps']} steps; {settings.rounds} rounds; {pairing}. "
      "ex/s and the other figures: median over rounds.", "",
      "| workload | N | variant | ex/s | × plain | × mirrored " +
      ("| × unsynced " if unsynced else "") + "| build s "
      "| return s | peak RSS MiB | CPU µs/ex | cores | final loss |",
      "|---|---:|---|---:|---:|---:|" + ("---:|" if unsynced else "") +
      "---:|---:|---:|---:|---:|---:|"
  ]
  for row in rows:
    failed = f" ({row['failed']} failed)" if row["failed"] else ""
    cpu = row["cpu_s_per_example"]
    lines.append(
        f"| {row['workload']} | {row['towers']} | {row['variant']}{failed} "
        f"| {_fmt(row['examples_per_sec'], ',.0f')} "
        f"| {_fmt_ratio(row['vs_plain'])} "
        f"| {_fmt_ratio(row.get('vs_mirrored'))} " +
        (f"| {_fmt_ratio(row.get('vs_unsynced'))} " if unsynced else "") +
        f"| {_fmt(row['build_s'], '.2f')} "
        f"| {_fmt(row['return_after_last_step_s'], '.2f')} "
        f"| {_memory(row)} "
        f"| {_fmt(None if cpu is None else cpu * 1e6, '.1f')} "
        f"| {_fmt(row['cores_used'], '.2f')} "
        f"| {_fmt(row['final_loss'], '.4f')} |")
  if targets:
    lines += ["", "| target | workload | ratio | met |", "|---|---|---:|---|"]
    for t in targets:
      lines.append(f"| {t['target']} ({t['variant']}) | {t['workload']} "
                   f"| {_fmt_ratio(t['ratio'])} | "
                   f"{'yes' if t['met'] else 'NO'} |")
  return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], settings: Settings, path: str) -> bool:
  """Examples/sec and build time vs N per variant; False without matplotlib."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  except ImportError:
    logging.warning("matplotlib is not installed: no plot (pip install "
                    "matplotlib, or the package's [benchmarks] extra).")
    return False
  columns = len(settings.workloads)
  figure, axes = pyplot.subplots(
      2, columns, figsize=(5 * columns, 7), squeeze=False)
  for col, workload in enumerate(settings.workloads):
    for variant in settings.variants:
      mine = [
          r for r in rows if r["workload"] == workload and
          r["variant"] == variant and r["examples_per_sec"] is not None
      ]
      ns = [r["towers"] for r in mine]
      axes[0][col].plot(
          ns, [r["examples_per_sec"] for r in mine], "o-", label=variant)
      axes[1][col].plot(ns, [r["build_s"] for r in mine], "o-", label=variant)
    axes[0][col].set_title(f"{workload}: training examples/sec")
    axes[1][col].set_title(f"{workload}: graph build + first step (s)")
    for ax in (axes[0][col], axes[1][col]):
      ax.set_xscale("log", base=2)
      ax.set_xticks(settings.towers, [str(n) for n in settings.towers])
      ax.set_xlabel(f"towers N ({settings.device_type})")
      ax.set_ylim(bottom=0)
      ax.grid(True, alpha=0.3)
  axes[0][0].legend()
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  return True
