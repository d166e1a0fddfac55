"""Many short train/evaluate cycles on one machine hold steady.

`train_and_evaluate` saves a checkpoint every step and evaluates each one:
ROUNDS evaluation graphs and sessions. The replicated estimator (2 towers)
must leave no per-graph state behind (every graph it built is freed, the
library's per-graph tables are empty), keep its memory flat, and end with
the plain estimator's weights and metrics.
"""

import gc
import os
import weakref

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate import _tf
from tests import harness
from tests import test_estimator

pytestmark = [pytest.mark.slow, pytest.mark.wide]

# Train steps, checkpoints and evaluations (e.g. 30 to watch memory longer).
ROUNDS = int(os.environ.get("REPLICATE_LONG_RUN_ROUNDS", "10"))
WARM_UP = 3  # rounds before memory is compared
# Allowed RSS growth from round WARM_UP to the last. Measured here: about
# 0.3 MB a round (7 MB from round 5 to 30: allocator pools settling); with
# each round's graphs kept alive, about 5 MB a round (73 MB over 15 rounds;
# 35 MB over the 7 rounds compared by default).
RSS_GROWTH_BYTES = 20 * 2**20


def _rss_bytes():
  with open("/proc/self/statm") as statm:
    return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Recorder:
  """Wraps a model_fn: a weak reference to each graph, RSS at each eval."""

  def __init__(self, model_fn):
    self._model_fn = model_fn
    self.graphs, self.rss = [], []

  def __call__(self, features, labels, mode, params, config):
    self.graphs.append(weakref.ref(tf.compat.v1.get_default_graph()))
    if mode == tf.estimator.ModeKeys.EVAL:
      gc.collect()
      self.rss.append(_rss_bytes())
    return self._model_fn(features, labels, mode, params=params, config=config)


def _estimator(model_fn, model_dir):
  config = harness.estimator_config(
      model_dir, seed=42).replace(save_checkpoints_steps=1)
  return tf.estimator.Estimator(
      model_fn, config=config, params={"learning_rate": 0.05})


def _variables(estimator):
  return {
      v: estimator.get_variable_value(v) for v in estimator.get_variable_names()
  }


def _run_cycles(model_fn, model_dir):
  """train_and_evaluate, one evaluation per step; final metrics, variables."""
  estimator = _estimator(model_fn, model_dir)
  train_spec = tf.estimator.TrainSpec(
      test_estimator._input_fn(),  # pylint: disable=protected-access
      max_steps=ROUNDS)
  eval_spec = tf.estimator.EvalSpec(
      test_estimator._input_fn(50, epochs=1),  # pylint: disable=protected-access
      steps=None,
      start_delay_secs=0,
      throttle_secs=0)
  metrics, _ = tf.estimator.train_and_evaluate(estimator, train_spec, eval_spec)
  return metrics, _variables(estimator)


def _run_plain(model_dir):
  """The plain estimator: the same steps, evaluated once at the end.

  Evaluations do not touch training, which runs in one session between
  them: the final weights and metrics are those of the cycles.
  """
  estimator = _estimator(test_estimator.model_fn, model_dir)
  estimator.train(test_estimator._input_fn(), max_steps=ROUNDS)  # pylint: disable=protected-access
  metrics = estimator.evaluate(test_estimator._input_fn(50, epochs=1))  # pylint: disable=protected-access
  return metrics, _variables(estimator)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  recorder = _Recorder(
      replicate.replicate_model_fn(
          test_estimator.model_fn, devices=["/device:CPU:0", "/device:CPU:1"]))
  replicated = _run_cycles(recorder, tmp_path_factory.mktemp("replicated"))
  plain = _run_plain(tmp_path_factory.mktemp("plain"))
  gc.collect()
  return recorder, replicated, plain


def test_every_round_is_evaluated(runs):
  recorder, (metrics, variables), _ = runs
  # Rounds 1..ROUNDS, and the final evaluation again at the end.
  assert ROUNDS <= len(recorder.rss) <= ROUNDS + 1
  assert metrics["global_step"] == variables["global_step"] == ROUNDS


def test_no_graph_or_library_state_is_left_behind(runs):
  recorder, _, _ = runs
  alive = [ref for ref in recorder.graphs if ref() is not None]
  assert not alive, f"{len(alive)} of {len(recorder.graphs)} graphs alive"
  # Every patch the towers' build installs is undone after it.
  every = _tf.Patches.every()
  assert len(every) >= 6, [p.what for p in every]
  assert not [p.what for p in every if p.installed]


def test_memory_stays_flat(runs):
  recorder, _, _ = runs
  start, end = recorder.rss[WARM_UP - 1], recorder.rss[-1]
  print(f"RSS at round 1 {recorder.rss[0] / 2**20:.1f} MiB, round {WARM_UP} "
        f"{start / 2**20:.1f} MiB, round {len(recorder.rss)} "
        f"{end / 2**20:.1f} MiB")
  assert end - start < RSS_GROWTH_BYTES, [r // 2**20 for r in recorder.rss]


def test_final_weights_and_metrics_are_the_plain_estimators(runs):
  _, (metrics, variables), (plain_metrics, plain_variables) = runs
  assert sorted(variables) == sorted(plain_variables)
  # Float32 sums of 2 towers in another order, through 30 Adam steps (as
  # test_estimator's 12): rtol 1e-4 on values of order 1, atol near 0.
  for name, value in plain_variables.items():
    np.testing.assert_allclose(
        variables[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
  for key, value in plain_metrics.items():
    np.testing.assert_allclose(metrics[key], value, rtol=1e-4, err_msg=key)
