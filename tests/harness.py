"""Runs a model_fn unreplicated and replicated on the same data and weights.

Initial weights come from each variable's name (a seeded draw), so two graphs
that name their variables alike start from the same point whatever
initializers the model_fn uses; the decisive tests compare what follows.
"""

import zlib

import numpy as np
import pytest
import tensorflow as tf

import replicate

TRAIN = tf.estimator.ModeKeys.TRAIN
EVAL = tf.estimator.ModeKeys.EVAL
PREDICT = tf.estimator.ModeKeys.PREDICT
Reduction = tf.compat.v1.losses.Reduction

# Two ways to get several devices without GPUs (see DESIGN.md).
GPU_NAMES = "gpu_names"  # GPU device names, soft placement onto CPU
VIRTUAL_CPUS = "virtual_cpus"  # separate CPU devices of one session


def devices(kind, n):
  if kind == GPU_NAMES:
    return [f"/device:GPU:{i}" for i in range(n)]
  return [f"/device:CPU:{i}" for i in range(n)]


def session_config(kind=VIRTUAL_CPUS, soft=None):
  soft = (kind == GPU_NAMES) if soft is None else soft
  config = tf.compat.v1.ConfigProto(
      device_count={"CPU": 4},
      allow_soft_placement=soft,
      inter_op_parallelism_threads=2,
      intra_op_parallelism_threads=1)
  # Grappler's rewrites cost more than these tiny graphs take to run.
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  # With REPLICATE_TEST_GPUS (conftest.py), the session keeps the GPU split.
  return replicate.testing.session_config(4, config)


def estimator_config(model_dir, seed):
  """RunConfig for the Estimator tests: 4 CPU devices, no periodic saves."""
  return tf.estimator.RunConfig(
      model_dir=str(model_dir),
      tf_random_seed=seed,
      save_checkpoints_steps=1000,
      save_summary_steps=1000,
      log_step_count_steps=1000,
      session_config=replicate.testing.session_config(
          4,
          tf.compat.v1.ConfigProto(
              allow_soft_placement=True,
              inter_op_parallelism_threads=2,
              intra_op_parallelism_threads=1)))


def initial_value(name, shape, dtype):
  rng = np.random.RandomState(zlib.crc32(name.encode()) % (2**31))
  if dtype.is_integer:
    return np.zeros(shape, dtype.as_numpy_dtype)
  return rng.uniform(-0.5, 0.5, shape).astype(dtype.as_numpy_dtype)


def set_trainable_weights(session):
  for v in tf.compat.v1.trainable_variables():
    v.load(initial_value(v.op.name, v.shape, v.dtype), session)


def batches(data, batch_size, static=True):
  """One-shot iterator over `data` (a nest of arrays) in order, repeating."""
  dataset = tf.data.Dataset.from_tensor_slices(data).repeat()
  dataset = dataset.batch(batch_size, drop_remainder=static)
  return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def wrap(model_fn,
         tower_devices,
         reduction=Reduction.SUM_BY_NONZERO_WEIGHTS,
         placement=None):
  """The model_fn itself (tower_devices None) or replicated over them."""
  if tower_devices is None:
    return model_fn
  return replicate.replicate_model_fn(
      model_fn,
      loss_reduction=reduction,
      devices=tower_devices,
      variable_placement=placement)


def run_training(session, spec, steps):
  """Initialises, loads the seeded weights and runs `steps` train steps.

  Returns the losses and every global variable's value afterwards.
  """
  session.run([
      tf.compat.v1.global_variables_initializer(),
      tf.compat.v1.local_variables_initializer()
  ])
  set_trainable_weights(session)
  losses = [session.run([spec.loss, spec.train_op])[0] for _ in range(steps)]
  values = {v.op.name: session.run(v) for v in tf.compat.v1.global_variables()}
  return np.array(losses), values


def train(model_fn,
          data,
          batch_size,
          steps,
          tower_devices=None,
          reduction=Reduction.SUM_BY_NONZERO_WEIGHTS,
          placement=None,
          kind=VIRTUAL_CPUS,
          params=None,
          static=True):
  """Trains `steps` steps; returns the losses and the trained variables."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = batches(data, batch_size, static)
    spec = wrap(model_fn, tower_devices, reduction,
                placement)(features, labels, TRAIN, params or {})
    with tf.compat.v1.Session(config=session_config(kind)) as session:
      return run_training(session, spec, steps)


def evaluate(model_fn,
             data,
             batch_size,
             steps,
             tower_devices=None,
             reduction=Reduction.SUM_BY_NONZERO_WEIGHTS,
             kind=VIRTUAL_CPUS,
             params=None,
             static=True):
  """Runs `steps` eval batches; returns the mean loss and metric values."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = batches(data, batch_size, static)
    spec = wrap(model_fn, tower_devices, reduction)(features, labels, EVAL,
                                                    params or {})
    updates = [op for _, op in spec.eval_metric_ops.values()]
    with tf.compat.v1.Session(config=session_config(kind)) as session:
      session.run([
          tf.compat.v1.global_variables_initializer(),
          tf.compat.v1.local_variables_initializer()
      ])
      set_trainable_weights(session)
      losses = [session.run([spec.loss, updates])[0] for _ in range(steps)]
      metrics = session.run({
          k: v for k, (v, _) in spec.eval_metric_ops.items()
      })
  return np.array(losses), metrics


def predict(model_fn,
            data,
            batch_size,
            steps,
            tower_devices=None,
            kind=VIRTUAL_CPUS,
            params=None,
            static=True):
  """Runs `steps` predict batches; returns predictions and export outputs."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features = batches(data, batch_size, static)
    spec = wrap(model_fn, tower_devices)(features, None, PREDICT, params or {})
    outputs = {
        k:
            getattr(o, "outputs", None) or {
                n: t
                for n, t in (("scores", getattr(o, "scores", None)),
                             ("classes", getattr(o, "classes", None)),
                             ("value", getattr(o, "value", None)))
                if t is not None
            } for k, o in (spec.export_outputs or {}).items()
    }
    with tf.compat.v1.Session(config=session_config(kind)) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      set_trainable_weights(session)
      runs = [session.run((spec.predictions, outputs)) for _ in range(steps)]
  return runs


def assert_close_nests(actual, expected, rtol=1e-5, atol=1e-5):
  """Asserts two nests of arrays are equal to float tolerance."""
  tf.nest.assert_same_structure(actual, expected)
  for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected)):
    if np.asarray(e).dtype.kind in "SUO":
      np.testing.assert_array_equal(a, e)
    else:
      np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def wide(*values, **kwargs):
  """A parameter set the default run skips (`-m wide` runs it): a case
  beside the one kept for the same behaviour."""
  return pytest.param(*values, marks=pytest.mark.wide, **kwargs)


def in_turns(cases, variants, kept):
  """(default, wide) parameter dicts for absl's `parameterized`: each case
  (a dict) merged with each variant (a dict: a shape, a tower count);
  `kept(i, j)` says whether case i with variant j is in the default run."""
  default, wide = [], []
  for i, case in enumerate(cases):
    for j, variant in enumerate(variants):
      (default if kept(i, j) else wide).append({**variant, **case})
  return default, wide
