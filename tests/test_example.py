"""Runs the examples end to end, as a user would, in a subprocess."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

# The examples' data sets come with scikit-learn (the `examples` extra).
pytest.importorskip("sklearn", reason="the examples need scikit-learn")

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_EXAMPLE = _ROOT / "examples" / "digits.py"


def _run_example(tmp_path, *flags, example=_EXAMPLE):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return subprocess.run([
      sys.executable,
      str(example), f"--model_dir={tmp_path / 'model'}", *flags
  ],
                        cwd=_ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=300)


def _number(pattern, text):
  match = re.search(pattern, text)
  assert match, f"{pattern!r} not found in the example's output:\n{text}"
  return float(match.group(1))


def test_digits_example_trains_on_two_towers(tmp_path):
  result = _run_example(tmp_path, "--steps=60", "--towers=2", "--log_every=20")
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  assert "2 towers" in result.stdout, output
  assert re.search(r"step\s+60\s+loss", result.stdout), output
  accuracy = _number(r"test accuracy: ([0-9.]+)", result.stdout)
  examples_per_sec = _number(r"training examples/sec: ([0-9.]+)", result.stdout)
  assert accuracy > 0.5, output
  assert examples_per_sec > 0, output


# README's example is digits.py, above; canned estimators replicated are
# tested in process (test_testing, test_testing_replicated and others).
@pytest.mark.wide
def test_canned_example_trains_a_replicated_canned_estimator(tmp_path):
  result = _run_example(
      tmp_path,
      "--steps=20",
      "--towers=2",
      "--log_every=10",
      example=_ROOT / "examples" / "canned.py")
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  assert "DNNLinearCombinedClassifier on 2 towers" in result.stdout, output
  assert re.search(r"step\s+20\s+loss", result.stdout), output
  assert _number(r"eval global_step: ([0-9.]+)", result.stdout) == 20
  assert _number(r"eval accuracy: ([0-9.]+)", result.stdout) > 0.5, output
  assert 0 < _number(r"eval auc: ([0-9.]+)", result.stdout) <= 1, output
  assert _number(r"training examples/sec: ([0-9.]+)", result.stdout) > 0
  # TensorBoard summaries: training's in model_dir, evaluation's in eval/.
  model_dir = tmp_path / "model"
  assert list(model_dir.glob("events.out.tfevents.*")), output
  assert list((model_dir / "eval").glob("events.out.tfevents.*")), output
  assert f"tensorboard --logdir={model_dir}" in result.stdout
