"""One device's values against 2 and 4 towers, one line a case.

The cases of tests/test_by_construction.py (tf-slim's arg_scope around
batch norm, a model object keeping tensors on `self`, a hand-written
masked mean, scaled and weighted losses, a py_func metric, Keras'
`minimize(loss_fn, var_list_fn)`, gradient accumulation in a tf.cond),
printed as a report; the tests assert the same values.

  python -m tests.report_cases
"""
# pylint: disable=protected-access

from typing import Any, Callable, Dict, Optional

import numpy as np

import tests.conftest  # noqa: F401  # isort: skip  (virtual CPUs first)
from tests import harness
from tests import test_by_construction as cases


def _towers(n: int) -> Any:
  return harness.devices(harness.VIRTUAL_CPUS, n)


def _train(name: str,
           model_fn: Callable[..., Any],
           data: Any,
           batch: int,
           steps: int,
           params: Optional[Dict[str, Any]] = None,
           static: bool = True) -> None:
  one, one_vars = harness.train(
      model_fn, data, batch, steps, params=params, static=static)
  row = [f"{name}: loss step 1 one device {one[0]:.6f}"]
  for n in (2, 4):
    losses, variables = harness.train(
        model_fn,
        data,
        batch,
        steps,
        tower_devices=_towers(n),
        params=params,
        static=static)
    worst = max(
        float(np.max(np.abs(variables[k] - one_vars[k]))) for k in one_vars)
    row.append(f"{n} towers {losses[0]:.6f} (max |loss diff| "
               f"{np.max(np.abs(losses - one)):.1e}, max |variable diff| "
               f"{worst:.1e})")
  print("; ".join(row))


def _evaluate(name: str,
              model_fn: Callable[..., Any],
              data: Any,
              batch: int,
              steps: int,
              params: Optional[Dict[str, Any]] = None) -> None:
  one = harness.evaluate(model_fn, data, batch, steps, params=params)
  row = [f"{name}: eval one device {one[1]}"]
  for n in (2, 4):
    metrics = harness.evaluate(
        model_fn, data, batch, steps, _towers(n), params=params)[1]
    row.append(f"{n} towers {metrics}")
  print("; ".join(row))


def main() -> None:
  _train("tf-slim arg_scope, second conv outside", cases._slim_model_fn,
         cases._images(), 6, 3, {"both_inside": False})
  _train("tf-slim arg_scope, both inside", cases._slim_model_fn,
         cases._images(), 6, 3, {"both_inside": True})
  _train(
      "model object (TF-Ranking style), batch 9",
      cases._ranking_model_fn(cases._Ranker()),
      cases._data(30),
      9,
      3,
      static=False)
  _train("hand-written masked mean, 6 rows 3+1 valid",
         cases._masked_mean_model_fn, cases._masked_data(), 6, 2)
  for form in cases.FORMS:
    _train(f"loss form {form}", cases._loss_form_model_fn, cases._data(14), 7,
           2, {"form": form})
    _evaluate(f"loss form {form}", cases._loss_form_model_fn, cases._data(14),
              7, 2, {"form": form})
  _evaluate("py_func metric (BLEU-like)", cases._py_func_metric_model_fn,
            cases._data(21), 7, 3)
  _train("Keras minimize(loss_fn, var_list_fn)", cases._keras_minimize_model_fn,
         cases._data(), 8, 5)
  for adam in (False, True):
    _train(f"gradient accumulation in tf.cond, {'Adam' if adam else 'SGD'}",
           cases._accumulating_model_fn, cases._data(), 8, 7, {"adam": adam})


if __name__ == "__main__":
  main()
