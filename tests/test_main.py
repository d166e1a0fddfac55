"""`python -m replicate`, the self-check, as a user runs it."""

import os
import pathlib
import subprocess
import sys

from replicate import __main__ as self_check

_ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_self_check_prints_the_machine_and_ends_ok():
  env = dict(os.environ, PYTHONPATH=str(_ROOT), TF_CPP_MIN_LOG_LEVEL="2")
  result = subprocess.run([sys.executable, "-m", "replicate"],
                          cwd=_ROOT,
                          env=env,
                          capture_output=True,
                          text=True,
                          timeout=300)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  lines = result.stdout.splitlines()
  assert lines[0].startswith("replicate "), output
  assert any(line.startswith("TensorFlow 2.") for line in lines), output
  assert any(line.startswith("tensorflow-estimator ") for line in lines)
  assert any(line.startswith("devices=None would use: ") for line in lines)
  assert any(line.startswith("consolidation device") for line in lines)
  assert lines[-1].startswith(
      "OK: 1 device and 2 towers trained the same 9 variables in 3 steps"), \
      output


def test_self_check_says_what_is_wrong_and_exits_1(capsys):
  assert self_check.main(["--towers=0"]) == 1
  last = capsys.readouterr().out.splitlines()[-1]
  assert last == "FAILED: ValueError: --towers=0: pass at least 1."
