"""The gRPC server train_and_evaluate starts for a cluster of trainers only.

TensorFlow's collective ops resolve their groups through one task, the
group leader, that every task's server must name in its default session
config (`experimental.collective_group_leader`); without it each task
waits for the others alone. Estimator starts the server itself
(`_TrainingExecutor._start_std_server`, keeping only the session config's
GPU options), so on a cluster without a `ps` job the server it starts is
given the chief as leader here; a cluster with `ps` gets Estimator's own.
There, too, a trainer whose peer is gone ends (`end_on_unavailable`).
"""

from typing import Any

from absl import logging
import tensorflow as tf

# pylint: disable=protected-access,g-direct-tensorflow-import
from tensorflow.python.training import monitored_session as _monitored

__all__ = ["LEADER", "end_on_unavailable", "lead_collectives_from_chief"]

LEADER = "/job:chief/replica:0/task:0"
_PATCHED = "_replicate_leader"


def lead_collectives_from_chief() -> None:
  """Makes train_and_evaluate's servers of clusters without ps lead their
  collectives from the chief (once per process)."""
  # Imported here: on TensorFlow 2.16+ tensorflow_estimator imports only
  # after estimator_compat, which `replicate/_tf` is imported before.
  from tensorflow_estimator.python.estimator import training  # pylint: disable=g-import-not-at-top
  executor = training._TrainingExecutor
  original = executor._start_std_server
  if getattr(original, _PATCHED, False):
    return

  def start_std_server(self: Any, config: Any) -> Any:
    spec = config.cluster_spec.as_dict() if config.cluster_spec else {}
    if not config.master or "ps" in spec or "chief" not in spec:
      return original(self, config)
    session_config = tf.compat.v1.ConfigProto(log_device_placement=False)
    if config.session_config is not None:
      session_config.gpu_options.CopyFrom(config.session_config.gpu_options)
    session_config.experimental.collective_group_leader = LEADER
    logging.info("replicate: %s:%d's server leads collectives from %s",
                 config.task_type, config.task_id, LEADER)
    server = tf.distribute.Server(
        config.cluster_spec,
        job_name=config.task_type,
        task_index=config.task_id,
        config=session_config,
        start=False,
        protocol=config.protocol)
    server.start()
    return server

  setattr(start_std_server, _PATCHED, True)
  executor._start_std_server = start_std_server


def end_on_unavailable() -> None:
  """Makes an UnavailableError end training rather than recreate the session.

  MonitoredSession (so Estimator.train) recreates its session after an
  AbortedError or UnavailableError (`_PREEMPTION_ERRORS`), taken for a
  parameter server that restarted. On a trainer of a cluster without ps the
  UnavailableError is a collective whose peer is gone, after which
  TensorFlow aborts every collective of the process for good ("Restart your
  program to reset"): recreating the session fails again at once, forever.
  """
  preemption = getattr(_monitored, "_PREEMPTION_ERRORS", None)
  if not isinstance(preemption, tuple):
    return
  kept = tuple(e for e in preemption if e is not tf.errors.UnavailableError)
  if kept != preemption:
    logging.info("replicate: an UnavailableError (a trainer gone) ends "
                 "training on this trainer instead of recreating its session")
    _monitored._PREEMPTION_ERRORS = kept
