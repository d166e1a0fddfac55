"""Whole-batch values across towers give one device's result (issue 16).

Masked and weighted losses, `batch_sum` / `batch_concat` (normalisation,
in-batch negatives), batch normalization in training, clipping between
`compute_gradients` and `apply_gradients`, Keras `minimize` in both forms,
and hooks: N towers against the unwrapped model_fn on one device, same
data and initial weights, every step's loss and every trained variable.

Tolerances: rtol 1e-5 with atol 1e-6. The towers add the same float32
terms in another order (sums over a batch of 7-10 rows, a few layers, 3
steps): a few roundings of 2**-24 relative each, far below 1e-5; atol
covers values that cross zero. A wrong whole-batch value (a tower's shard
statistics, a share-weighted mean of masked means) is off by 1e-2 or more.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate._batch_norm import whole_batch
from tests import harness

TRAIN, EVAL, PREDICT = harness.TRAIN, harness.EVAL, harness.PREDICT
Reduction = tf.compat.v1.losses.Reduction
STEPS = 3
# (towers, batch, static): even and uneven splits, static and dynamic
# batches, and a batch smaller than the towers (one computes on a phantom
# row that must count nowhere).
SHAPES = [(2, 8, True), (4, 10, False), (2, 7, False), (4, 8, True),
          (4, 3, False)]


def _shape_ids(shapes):
  return [
      f"{n}towers-batch{b}-{'static' if s else 'dynamic'}" for n, b, s in shapes
  ]


SHAPE_IDS = _shape_ids(SHAPES)


def _cases(forms, form_ids, shapes, kept):
  """pytest.params of every form on every shape, ids `form-shape`.

  A form is one value or a tuple of values. The default run keeps the
  (form index, shape index) pairs in `kept`; the other cases are `wide`.
  """
  for i, (form, form_id) in enumerate(zip(forms, form_ids)):
    values = form if isinstance(form, tuple) else (form,)
    for j, (shape, shape_id) in enumerate(zip(shapes, _shape_ids(shapes))):
      param = pytest.param if (i, j) in kept else harness.wide
      yield param(*values, *shape, id=f"{form_id}-{shape_id}")


def _in_turns(forms, form_ids, shapes, first=0):
  """_cases keeping each form on one shape, the shapes taken in turn from
  `shapes[first]`, so that each shape meets a form if there are enough."""
  kept = {(i, (i + first) % len(shapes)) for i in range(len(forms))}
  return list(_cases(forms, form_ids, shapes, kept))


def _data(batch, num_batches=STEPS, image=False):
  """Rows, labels, a mask far from proportional to the shards, row positions.

  In every batch the first half of the rows and the last row are valid, so
  middle shards have no valid row at all and the last only one.
  """
  n = batch * num_batches
  rng = np.random.RandomState(batch)
  x = rng.randn(n, 4, 4, 1) if image else rng.randn(n, 5)
  position = np.arange(n) % batch
  mask = ((position < batch // 2) | (position == batch - 1)).astype(np.float32)
  features = {
      "x": x.astype(np.float32),
      "mask": mask,
      "row": position.astype(np.int64)
  }
  return features, rng.randint(0, 3, n).astype(np.int64)


def _train(model_fn,
           batch,
           steps=STEPS,
           towers=None,
           static=True,
           reduction=Reduction.SUM_BY_NONZERO_WEIGHTS,
           params=None,
           image=False,
           **replicate_kwargs):
  """Losses of every step and every global variable after them."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(
        _data(batch, steps, image), batch, static)
    wrapped = model_fn if towers is None else replicate.replicate_model_fn(
        model_fn,
        loss_reduction=reduction,
        devices=_towers(towers),
        **replicate_kwargs)
    spec = wrapped(features, labels, TRAIN, params or {})
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      return harness.run_training(session, spec, steps)


def _towers(n):
  return harness.devices(harness.VIRTUAL_CPUS, n)


def _assert_one_devices(model_fn, towers, batch, static, **kwargs):
  expected_losses, expected = _train(model_fn, batch, static=static, **kwargs)
  losses, actual = _train(
      model_fn, batch, towers=towers, static=static, **kwargs)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)
  assert sorted(actual) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(
        actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
  return expected_losses, expected


def _minimize(loss):
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.5))
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    return optimizer.minimize(loss, tf.compat.v1.train.get_global_step())


def _spec(mode, loss, predictions=None):
  return tf.estimator.EstimatorSpec(
      mode,
      loss=loss,
      predictions=predictions,
      train_op=_minimize(loss) if mode == TRAIN else None)


# Masked and weighted losses.


def _masked_model_fn(features, labels, mode, params):
  logits = tf.compat.v1.layers.dense(features["x"], 3, name="logits")
  mask = features["mask"]
  kind = params["loss"]
  if kind == "batch_sum":
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    loss = tf.reduce_sum(xent * mask) / replicate.batch_sum(tf.reduce_sum(mask))
  else:
    reduction = {
        "nonzero": Reduction.SUM_BY_NONZERO_WEIGHTS,
        "mean": Reduction.MEAN
    }[kind]
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
        labels, logits, weights=mask * 2.0, reduction=reduction)
    if params.get("regularized"):
      loss = loss + 0.01 * tf.nn.l2_loss(tf.compat.v1.trainable_variables()[0])
  return _spec(mode, loss)


MASKED_LOSSES = ["nonzero", "mean", "nonzero+l2", "batch_sum"]


# From SHAPES[1]: the even 2-tower split is left to the wide run.
@pytest.mark.parametrize("kind,towers,batch,static",
                         _in_turns(MASKED_LOSSES, MASKED_LOSSES, SHAPES, 1))
def test_masked_losses_are_one_devices(kind, towers, batch, static):
  reduction = Reduction.SUM if kind == "batch_sum" else (
      Reduction.SUM_BY_NONZERO_WEIGHTS)
  params = {"loss": kind.split("+")[0], "regularized": "+l2" in kind}
  _assert_one_devices(
      _masked_model_fn,
      towers,
      batch,
      static,
      reduction=reduction,
      params=params)


def _masked_eval_loss(towers):
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(10), 10, static=False)
    wrapped = _masked_model_fn if towers is None else (
        replicate.replicate_model_fn(_masked_model_fn, devices=_towers(towers)))
    spec = wrapped(features, labels, EVAL, {"loss": "nonzero"})
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      harness.set_trainable_weights(session)
      return [session.run(spec.loss) for _ in range(STEPS)]


def test_evaluate_reports_one_devices_weighted_loss():
  expected = _masked_eval_loss(None)
  for towers in (2, 4):
    np.testing.assert_allclose(_masked_eval_loss(towers), expected, rtol=1e-5)


# batch_sum and batch_concat in the model.


def _contrastive_model_fn(features, labels, mode, params):
  """In-batch negatives: every row scored against every row of the batch."""
  del labels, params
  embeddings = tf.compat.v1.layers.dense(features["x"], 4, name="embed")
  everyone = replicate.batch_concat(embeddings)
  logits = tf.matmul(embeddings, everyone, transpose_b=True)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
      features["row"], logits)
  return _spec(mode, loss)


def _normalised_model_fn(features, labels, mode, params):
  """A hand-made batch normalisation from whole-batch sums."""
  del params
  h = tf.compat.v1.layers.dense(features["x"], 4, name="hidden")
  count = replicate.batch_sum(tf.cast(tf.shape(h)[0], tf.float32))
  mean = replicate.batch_sum(tf.reduce_sum(h, 0)) / count
  variance = replicate.batch_sum(tf.reduce_sum(tf.square(h - mean), 0)) / count
  h = (h - mean) * tf.math.rsqrt(variance + 1e-3)
  logits = tf.compat.v1.layers.dense(h, 3, name="logits")
  return _spec(mode,
               tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits))


# In-batch negatives with an empty tower (its phantom row is no one's
# negative), the hand-made normalisation on uneven shards.
@pytest.mark.parametrize(
    "model_fn,towers,batch,static",
    list(
        _cases([_contrastive_model_fn, _normalised_model_fn],
               ["contrastive", "normalised"], SHAPES, {(0, 4), (1, 1)})))
def test_batch_sum_and_concat_models_are_one_devices(model_fn, towers, batch,
                                                     static):
  _assert_one_devices(model_fn, towers, batch, static)


# Batch normalization in training.


def _batch_norm_model_fn(features, labels, mode, params):
  training = mode == TRAIN
  x = features["x"]
  if params["input"] in ("conv", "nchw"):
    x = tf.compat.v1.layers.conv2d(x, 3, 2, name="conv")
    if params["input"] == "nchw":
      x = tf.transpose(x, [0, 3, 1, 2])
  else:
    x = tf.compat.v1.layers.dense(x, 4, name="hidden")
  # Batch renormalization: corrections from the batch's statistics and its
  # own moving ones, which the layer updates inside its call.
  renorm = params.get("renorm", False)
  if params["layer"] == "v1":
    x = tf.compat.v1.layers.batch_normalization(
        x, training=training, fused=params["fused"], renorm=renorm, name="bn")
  else:
    layer = tf.keras.layers.BatchNormalization(
        axis=1 if params["input"] == "nchw" else -1,
        fused=params["fused"],
        renorm=renorm,
        name="bn")
    x = layer(x, training=training)
    # A Keras layer called in a graph keeps its moving-statistics updates
    # to itself; the train_op runs UPDATE_OPS.
    for update in layer.updates:
      tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
  x = _activated(x, params.get("activation"))
  logits = tf.compat.v1.layers.dense(
      tf.compat.v1.layers.flatten(x), 3, name="logits")
  return _spec(mode,
               tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits))


def _activated(x, activation):
  """The layers' ReLU after batch norm, as model code writes it."""
  if activation is None:
    return x
  if activation == "keras_activation":
    return tf.keras.layers.Activation("relu")(x)
  if activation == "keras_relu":
    return tf.keras.layers.ReLU()(x)
  if activation == "v1_relu":
    return tf.compat.v1.nn.relu(x)
  if activation == "residual":
    # Pre-activation style: the normalised rows feed the ReLU and the sum.
    return tf.nn.relu(x) + x
  if activation == "control_dependency":
    with tf.control_dependencies([tf.debugging.assert_all_finite(x, "bn")]):
      return tf.nn.relu(x, name="after_check")
  assert activation == "relu", activation
  return tf.nn.relu(x)


BATCH_NORMS = [
    {
        "layer": "keras",
        "input": "dense",
        "fused": None
    },
    {
        "layer": "keras",
        "input": "dense",
        "fused": False
    },
    {
        "layer": "v1",
        "input": "dense",
        "fused": None
    },
    {
        "layer": "keras",
        "input": "conv",
        "fused": None
    },  # fused kernel
    {
        "layer": "keras",
        "input": "conv",
        "fused": False
    },
    {
        "layer": "v1",
        "input": "conv",
        "fused": True
    },
    {
        "layer": "keras",
        "input": "nchw",
        "fused": None
    },  # channels first
    {
        "layer": "keras",
        "input": "conv",
        "fused": None,
        "renorm": True
    },
    {
        "layer": "v1",
        "input": "dense",
        "fused": None,
        "renorm": True
    },
]


def _rotated(forms, ids):
  """Each form's cases: three of SHAPES.

  The last (4 towers, 3 rows: an empty tower) for every form, and two of
  the others in turn, so that every shape meets several forms. The default
  run keeps one of each form's three, in turn: every shape meets a form.
  """
  rest = SHAPES[:-1]
  for index, (form, form_id) in enumerate(zip(forms, ids)):
    shapes = [
        rest[index % len(rest)], rest[(index + 1) % len(rest)], SHAPES[-1]
    ]
    for position, (shape,
                   shape_id) in enumerate(zip(shapes, _shape_ids(shapes))):
      param = pytest.param if position == index % 3 else harness.wide
      yield param(form, *shape, id=f"{form_id}-{shape_id}")


@pytest.mark.parametrize(
    "params,towers,batch,static",
    list(
        _rotated(BATCH_NORMS, [
            f"{p['layer']}-{p['input']}-fused{p['fused']}" +
            ("-renorm" if p.get("renorm") else "") for p in BATCH_NORMS
        ])))
def test_batch_norm_training_is_one_devices(params, towers, batch, static):
  _, values = _assert_one_devices(
      _batch_norm_model_fn,
      towers,
      batch,
      static,
      params=params,
      image=params["input"] != "dense")
  # The moving statistics were compared after they moved (from 0 and 1).
  assert np.abs(values["bn/moving_mean"]).min() > 1e-4, values["bn/moving_mean"]
  assert np.abs(values["bn/moving_variance"] - 1.0).min() > 1e-4, (
      values["bn/moving_variance"])


def _ancestors(op):
  """Every op `op` waits for, through data and control inputs."""
  seen, pending = set(), [op]
  while pending:
    current = pending.pop()
    for parent in [t.op for t in current.inputs] + current.control_inputs:
      if parent not in seen:
        seen.add(parent)
        pending.append(parent)
  return seen


@pytest.mark.parametrize("params", BATCH_NORMS[-2:], ids=["keras", "v1"])
def test_renorm_reads_its_statistics_before_the_write_in_every_tower(params):
  # Batch renormalization reads its moving statistics, then updates them.
  # The update that runs is tower 0's: every tower's reads for its model
  # must come before it, or a tower may read the new value (a race
  # that once changed a loss by 6e-5 in one run of the test above).
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(
        _data(8, 1, params["input"] != "dense"), 8)
    replicate.replicate_model_fn(
        _batch_norm_model_fn, devices=_towers(4))(features, labels, TRAIN,
                                                  params)
  for name in ("bn/renorm_mean", "bn/renorm_stddev"):
    handle = graph.get_operation_by_name(name)
    users = [
        op for op in graph.get_operations()
        if op.inputs and op.inputs[0].op is handle
    ]
    writes = [
        op for op in users
        if op.type.startswith("Assign") and op.name != name + "/Assign"
    ]  # not the initializer
    reads = [op for op in users if op.type == "ReadVariableOp"]
    assert len(writes) == 1, writes  # tower 0's; the others' go to a sink
    before_write = _ancestors(writes[0])
    for tower in range(4):
      prefix = f"tower_{tower}/" if tower else ""
      tower_write = graph.get_operation_by_name(
          writes[0].name.replace("bn/", prefix +
                                 "bn/", 1) if tower else writes[0].name)
      # Reads inside the tower's own update feed only that dropped write.
      update_scope = tower_write.name.rsplit("/", 1)[0] + "/"
      earlier = [
          r for r in reads if r.name.startswith(prefix or "bn/") and
          r in _ancestors(tower_write) and not r.name.startswith(update_scope)
      ]
      assert earlier, (name, tower)
      assert all(r in before_write for r in earlier), (name, tower, earlier)


def _raw_batch_norm_model_fn(features, labels, mode, params):
  """Batch norm written with tf.nn ops, as tf-slim and tf.contrib wrote it:
  its own moving statistics, updated through UPDATE_OPS."""
  form = params["form"]
  x = features["x"]
  if form.startswith(("fused", "moments")):
    x = tf.compat.v1.layers.conv2d(x, 3, 2, name="conv")
    if form == "fused_nchw":
      x = tf.transpose(x, [0, 3, 1, 2])
  else:
    x = tf.compat.v1.layers.dense(x, 4, name="hidden")
  channels = x.shape[1 if form == "fused_nchw" else -1]
  aggregation = params.get("aggregation", tf.VariableAggregation.MEAN)

  def variable(name, value, trainable):
    return tf.compat.v1.get_variable(
        name, [channels],
        initializer=tf.compat.v1.constant_initializer(value),
        trainable=trainable,
        aggregation=aggregation)

  gamma, beta = variable("gamma", 1.5, True), variable("beta", 0.1, True)
  moving_mean = variable("moving_mean", 0.0, False)
  moving_variance = variable("moving_variance", 1.0, False)
  decay = 0.9
  if form.startswith("fused"):
    if form == "fused_average":
      # The kernel moves the running statistics itself.
      x, mean, variance = tf.compat.v1.nn.fused_batch_norm(
          x,
          gamma,
          beta,
          moving_mean,
          moving_variance,
          epsilon=1e-3,
          is_training=True,
          exponential_avg_factor=1.0 - decay)
      updates = [moving_mean.assign(mean), moving_variance.assign(variance)]
    else:
      x, mean, variance = tf.compat.v1.nn.fused_batch_norm(
          x,
          gamma,
          beta,
          epsilon=1e-3,
          data_format="NCHW" if form == "fused_nchw" else "NHWC")
  else:
    if form.startswith("weighted"):
      # "weighted_mask": the middle towers' rows all weigh 0.
      weights = features["mask"][:, None] + (0.5 if form == "weighted" else 0)
      mean, variance = tf.nn.weighted_moments(x, [0], weights)
    elif form == "moments_keep_dims":
      mean, variance = tf.compat.v1.nn.moments(x, [0, 1, 2], keep_dims=True)
      mean, variance = tf.squeeze(mean), tf.squeeze(variance)
    else:
      mean, variance = tf.nn.moments(x,
                                     [0, 1, 2] if form == "moments" else [-2])
    x = tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-3)
  if form != "fused_average":
    updates = [
        tf.compat.v1.assign_sub(moving, (moving - value) * (1 - decay))
        for moving, value in ((moving_mean, mean), (moving_variance, variance))
    ]
  for update in updates:
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
  x = _activated(x, params.get("activation"))
  logits = tf.compat.v1.layers.dense(
      tf.compat.v1.layers.flatten(x), 3, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if form == "fused_stats_in_loss":
    # TensorFlow's gradient of the training kernel passes none back from
    # the batch statistics it returns: neither do the towers.
    loss += 0.1 * tf.reduce_sum(tf.square(mean)) + 0.1 * tf.reduce_sum(variance)
  return _spec(mode, loss)


RAW_BATCH_NORMS = [
    "fused", "fused_nchw", "fused_average", "fused_stats_in_loss", "moments",
    "moments_keep_dims", "dense", "weighted", "weighted_mask"
]


@pytest.mark.parametrize("form,towers,batch,static",
                         list(_rotated(RAW_BATCH_NORMS, RAW_BATCH_NORMS)))
def test_tf_nn_batch_norm_training_is_one_devices(form, towers, batch, static):
  # tf.compat.v1.nn.fused_batch_norm in training, tf.nn.moments,
  # tf.compat.v1.nn.moments and tf.nn.weighted_moments over the batch axis:
  # the whole batch's statistics, its moving averages and gradients.
  _assert_one_devices(
      _raw_batch_norm_model_fn,
      towers,
      batch,
      static,
      params={"form": form},
      image=form not in ("dense", "weighted", "weighted_mask"))


FUSED_FORMS = ([("layer", p)
                for p in BATCH_NORMS
                if p["fused"] is not False and p["input"] != "dense"] +
               [("tf_nn", {
                   "form": f
               }) for f in RAW_BATCH_NORMS if f.startswith("fused")])

# A static batch smaller than the towers: the last tower's phantom row is
# known when the graph is built.
STATIC_PHANTOM = (4, 3, True)
FUSED_FORM_IDS = [
    f"{k}-{p.get('form') or p['layer'] + '-' + p['input']}"
    for k, p in FUSED_FORMS
]


def _assert_fused_is_one_devices(kind, params, towers, batch, static):
  model_fn = (
      _batch_norm_model_fn if kind == "layer" else _raw_batch_norm_model_fn)
  _assert_one_devices(
      model_fn, towers, batch, static, params=params, image=True)


def _through_the_hub_cases():
  """Each fused form on the static phantom row and two of SHAPES, in turn.

  As in the tests above (the concatenating route), every shape meets
  several forms rather than all of them: the layers share their code. The
  default run keeps one case of each form: the first forms on SHAPES in
  turn, the others on the static phantom row.
  """
  for index, ((kind, params),
              form_id) in enumerate(zip(FUSED_FORMS, FUSED_FORM_IDS)):
    shapes = [
        STATIC_PHANTOM, SHAPES[index % len(SHAPES)],
        SHAPES[(index + 2) % len(SHAPES)]
    ]
    kept = 1 if index < len(SHAPES) else 0
    for position, (shape,
                   shape_id) in enumerate(zip(shapes, _shape_ids(shapes))):
      param = pytest.param if position == kept else harness.wide
      yield param(kind, params, *shape, id=f"{form_id}-{shape_id}")


@pytest.mark.parametrize("kind,params,towers,batch,static",
                         list(_through_the_hub_cases()))
def test_fused_batch_norm_through_the_hub_is_one_devices(
    kind, params, towers, batch, static, monkeypatch):
  # Towers apart (GPUs) meet with their shards' moments on the hub: that
  # way forced here on virtual CPUs, which otherwise concatenate.
  monkeypatch.setattr(whole_batch, "_CONCATENATE_ON_HOST", False)
  _assert_fused_is_one_devices(kind, params, towers, batch, static)


@pytest.mark.parametrize("kind,params", FUSED_FORMS, ids=FUSED_FORM_IDS)
def test_fused_batch_norm_with_a_static_phantom_row_is_one_devices(
    kind, params):
  # The concatenation leaves out a tower known to hold a phantom row (the
  # dynamic ones are in the tests above, through SHAPES).
  _assert_fused_is_one_devices(kind, params, *STATIC_PHANTOM)


def _training_kernels(device_kind, towers):
  """(device, type of the op making its input x) of each FusedBatchNormV3
  in training mode in a one-layer TRAIN graph."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(8, 1, image=True), 8)
    spec = replicate.replicate_model_fn(
        _batch_norm_model_fn,
        devices=harness.devices(device_kind, towers))(features, labels, TRAIN,
                                                      BATCH_NORMS[3])
    ops = _run_ops(spec)
  return [(op.device, op.inputs[0].op.type)
          for op in ops
          if op.type == "FusedBatchNormV3" and op.get_attr("is_training")]


@pytest.mark.parametrize("towers", [harness.wide(2), 4])
def test_fused_batch_norm_on_one_hosts_cpus_runs_once_on_the_batch(towers):
  # Virtual CPUs share one memory: one training kernel, on the hub, reads
  # the towers' shards concatenated.
  assert _training_kernels(harness.VIRTUAL_CPUS,
                           towers) == [("/device:CPU:0", "ConcatV2")]
  # GPUs (names here, soft placement) each compute their shard's moments
  # with the kernel in training mode, in their own tower.
  kernels = _training_kernels(harness.GPU_NAMES, towers)
  assert sorted(device for device, _ in kernels) == [
      f"/device:GPU:{i}" for i in range(towers)
  ]


# The ReLU after a fused layer: where the kernel ran on the concatenated
# batch, it runs there too (see replicate/_host_relu.py).
ACTIVATIONS = [
    ("layer", dict(BATCH_NORMS[5], activation="relu")),  # v1 fused
    ("layer", dict(BATCH_NORMS[3], activation="keras_activation")),
    ("layer", dict(BATCH_NORMS[6], activation="keras_relu")),  # NCHW
    ("tf_nn", {
        "form": "fused_average",
        "activation": "v1_relu"
    }),
    ("layer", dict(BATCH_NORMS[3], activation="residual")),
    ("layer", dict(BATCH_NORMS[5], activation="control_dependency")),
]
ACTIVATION_IDS = [p["activation"] for _, p in ACTIVATIONS]
# Even and uneven, static and dynamic, phantom rows known when built and not.
ACTIVATION_SHAPES = [(2, 8, True), (4, 10, False), (4, 3, True), (4, 3, False)]


@pytest.mark.parametrize(
    "kind,params,towers,batch,static",
    _in_turns(ACTIVATIONS, ACTIVATION_IDS, ACTIVATION_SHAPES))
def test_relu_after_a_concatenated_layer_is_one_devices(kind, params, towers,
                                                        batch, static):
  _assert_fused_is_one_devices(kind, params, towers, batch, static)


def _relus(device_kind, towers, activation):
  """(name, device, type of its input) of each Relu of a one-layer TRAIN
  graph, and the graph."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(8, 1, image=True), 8)
    spec = replicate.replicate_model_fn(
        _batch_norm_model_fn, devices=harness.devices(
            device_kind, towers))(features, labels, TRAIN,
                                  dict(BATCH_NORMS[5], activation=activation))
    ops = _run_ops(spec)
  return [(op.name, op.device, op.inputs[0].op.type)
          for op in ops
          if op.type == "Relu"], graph


@pytest.mark.parametrize("towers", [harness.wide(2), 4])
def test_relu_after_a_concatenated_layer_runs_once_on_the_batch(towers):
  # One ReLU runs, on the hub, reading the kernel (grappler fuses the two);
  # each tower reads its rows of it.
  relus, _ = _relus(harness.VIRTUAL_CPUS, towers, "relu")
  assert [(device, source) for _, device, source in relus
         ] == [("/device:CPU:0", "FusedBatchNormV3")]
  # Towers apart (GPU names) normalise in their own towers: their ReLUs too.
  relus, _ = _relus(harness.GPU_NAMES, towers, "relu")
  assert sorted(device for _, device, _ in relus) == [
      f"/device:GPU:{i}" for i in range(towers)
  ]


def test_relu_after_a_concatenated_layer_keeps_the_towers_dependencies():
  # The ReLU each tower built under its control dependencies waits for that
  # tower's check, and reads the ReLU on the batch, which waits for none.
  relus, graph = _relus(harness.VIRTUAL_CPUS, 2, "control_dependency")
  whole = graph.get_operation_by_name(relus[0][0])
  assert not whole.control_inputs
  for scope in ("", "tower_1/"):
    op = graph.get_operation_by_name(scope + "after_check")
    assert [c.name for c in op.control_inputs
           ] == [scope + "VerifyFinite/control_dependency"]


def test_tf_nn_batch_norm_moving_statistics_need_no_aggregation():
  # Every tower writes the hub's statistics, computed from no input of its
  # own: tower 0's write is one device's, declared aggregation or not
  # (tf-slim declares none).
  for form in ("fused", "moments"):
    _assert_one_devices(
        _raw_batch_norm_model_fn,
        2,
        8,
        True,
        image=True,
        params={
            "form": form,
            "aggregation": tf.VariableAggregation.NONE
        })


def test_tf_nn_moments_off_the_batch_axis_do_not_meet():
  # Moments over the features of each row (layer norm) are each row's: no
  # meeting, no ops on the hub.
  def normalise(x, mode):
    del mode  # unused
    mean, variance = tf.nn.moments(x, [-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-3)

  model_fn = _normalised_dense_model_fn(normalise)
  _assert_one_devices(model_fn, 2, 8, True)
  assert not _hub_ops(model_fn)
  assert _hub_ops(_raw_batch_norm_model_fn, {"form": "dense"})


def _normalised_dense_model_fn(normalise):
  """A dense layer, `normalise(x, mode)` of it, a dense head."""

  def model_fn(features, labels, mode, params):
    del params  # unused
    x = tf.compat.v1.layers.dense(features["x"], 4, name="hidden")
    logits = tf.compat.v1.layers.dense(normalise(x, mode), 3, name="logits")
    return _spec(
        mode, tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits))

  return model_fn


def _run_ops(spec):
  """The ops a TRAIN step of `spec` runs (its train_op's and loss's)."""
  pending, seen = [spec.train_op, spec.loss.op], set()
  while pending:
    op = pending.pop()
    op = getattr(op, "op", op)
    if op in seen:
      continue
    seen.add(op)
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
  return seen


def _hub_ops(model_fn, params=None):
  """Names of the ops a 2-tower TRAIN step runs to combine the towers'
  batch statistics (the whole batch's values of their reductions)."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(8, 1), 8)
    spec = replicate.replicate_model_fn(
        model_fn, devices=_towers(2))(features, labels, TRAIN, params or {})
    ops = _run_ops(spec)
  return [
      op.name
      for op in ops
      if "whole_batch" in op.name and not op.name.startswith(
          ("loss", "sparse_softmax",
           "tower_1/sparse")) and "cross_entropy" not in op.name
  ]


def _per_example_statistics_model_fn(features, labels, mode, params):
  """Statistics of each example, over axis 0 of a tensor whose axis 0 is
  not the batch: Keras' LayerNormalization (its fused kernel sees the
  batch folded into channels) and moments over time, time-major."""
  hidden = tf.compat.v1.layers.dense(features["x"], 6, name="hidden")
  sequence = tf.reshape(hidden, [-1, 3, 2])
  if params["form"] == "layer_norm":
    x = tf.keras.layers.LayerNormalization(name="ln")(sequence)
  else:
    # "time_major": over time, each example's; "time_major_batch": over
    # time and the batch, the whole batch's.
    time_major = tf.transpose(sequence, [1, 0, 2])
    mean, variance = tf.nn.moments(
        time_major, [0] if params["form"] == "time_major" else [0, 1],
        keepdims=True)
    x = tf.transpose((time_major - mean) * tf.math.rsqrt(variance + 1e-3),
                     [1, 0, 2])
  logits = tf.compat.v1.layers.dense(tf.reshape(x, [-1, 6]), 3, name="logits")
  return _spec(mode,
               tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits))


# Each form on a static batch (where the hub is checked too), time_major
# also on a dynamic one with an empty tower.
@pytest.mark.parametrize(
    "form,towers,batch,static",
    list(
        _cases(["layer_norm", "time_major"], ["layer_norm", "time_major"],
               SHAPES, {(0, 3), (1, 0), (1, 4)})))
def test_statistics_of_each_example_do_not_meet(form, towers, batch, static):
  _assert_one_devices(
      _per_example_statistics_model_fn,
      towers,
      batch,
      static,
      params={"form": form})
  if static:
    assert not _hub_ops(_per_example_statistics_model_fn, {"form": form})


# The dynamic batches on 4 towers: uneven shards, and an empty tower.
@pytest.mark.parametrize(
    "towers,batch,static",
    [(pytest.param if shape in (SHAPES[1], SHAPES[4]) else harness.wide)(
        *shape, id=shape_id) for shape, shape_id in zip(SHAPES, SHAPE_IDS)])
def test_time_major_batch_statistics_are_one_devices(towers, batch, static):
  params = {"form": "time_major_batch"}
  _assert_one_devices(
      _per_example_statistics_model_fn, towers, batch, static, params=params)
  assert _hub_ops(_per_example_statistics_model_fn, params)


def _moments_in_a_cond(x, mode):
  del mode  # unused
  mean, variance = tf.cond(
      tf.constant(True), lambda: tf.nn.moments(x, [0]), lambda:
      (tf.zeros([4]), tf.ones([4])))
  return (x - mean) * tf.math.rsqrt(variance + 1e-3)


@pytest.mark.parametrize("towers,batch,static",
                         [harness.wide(2, 7, False), (4, 3, True)])
def test_tf_nn_moments_in_a_cond_run_once_on_the_whole_batch(
    towers, batch, static):
  # A tf.cond whose branch reduces the rows runs once, on every tower's
  # rows concatenated: one device's statistics.
  _assert_one_devices(
      _normalised_dense_model_fn(_moments_in_a_cond), towers, batch, static)


def test_ghost_batch_norm_is_refused_naming_its_reshape():
  # Keras' ghost batches (virtual_batch_size) are chunks of the whole batch
  # on one device; a tower's chunks are of its shard: no tower can compute
  # one device's, and the error names the reshape that makes them.
  def normalise(x, mode):
    return tf.keras.layers.BatchNormalization(
        virtual_batch_size=2, name="bn")(
            x, training=mode == TRAIN)

  with pytest.raises(ValueError, match=r"bn/Reshape.*reshapes rows.*\[2, -1"):
    _hub_ops(_normalised_dense_model_fn(normalise))


def _half_precision_gradient_model_fn(features, labels, mode, params):
  """The input gradient of a fused float16 batch norm in training, whose
  incoming gradient is almost constant per channel: the input's gradient
  is a small difference of large terms."""
  del labels, params  # unused
  x = tf.identity(tf.cast(3.0 * features["x"] + 5.0, tf.float16))
  bn = tf.keras.layers.BatchNormalization(
      dtype=tf.keras.mixed_precision.Policy("mixed_float16"), name="bn")
  y = tf.cast(bn(x, training=True), tf.float32)
  ripple = 1e-2 * tf.sin(tf.range(16, dtype=tf.float32))
  loss = tf.reduce_sum(y * (0.5 + tf.reshape(ripple, [1, 4, 4, 1])))
  grad, = tf.gradients(loss, [x])
  return tf.estimator.EstimatorSpec(
      mode, predictions={"grad": tf.cast(grad, tf.float32)})


@pytest.mark.parametrize("towers", [harness.wide(2), 4])
def test_half_precision_fused_batch_norm_gradient_is_one_devices(towers):
  # One device's kernel adds the gradient's terms in float32 and rounds
  # once (values up to 8e-5 with the seeded gamma, float16 steps 6e-8
  # there: 2e-7 is three); rounding each term to float16 first (terms
  # ~4e-3, steps ~4e-6) missed by 1.7e-6.
  features = _data(8, 1, image=True)[0]
  expected = harness.predict(_half_precision_gradient_model_fn, features, 8, 1)
  actual = harness.predict(_half_precision_gradient_model_fn, features, 8, 1,
                           _towers(towers))
  grad = expected[0][0]["grad"]
  assert 1e-5 < np.abs(grad).max() < 1e-3
  np.testing.assert_allclose(actual[0][0]["grad"], grad, rtol=0, atol=2e-7)


def test_unsynchronised_batch_norm_uses_each_towers_statistics():
  params = BATCH_NORMS[0]
  expected_losses, _ = _train(_batch_norm_model_fn, 8, params=params)
  losses, _ = _train(
      _batch_norm_model_fn, 8, towers=2, params=params, sync_batch_norm=False)
  # The first step's loss already normalises by the shards' statistics.
  assert abs(losses[0] - expected_losses[0]) > 1e-3


def _graph_ops(model_fn, towers, params, **replicate_kwargs):
  """Ops of a TRAIN graph built on `towers` towers (none run)."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(8, 1, image=True), 8)
    replicate.replicate_model_fn(
        model_fn, devices=_towers(towers), **replicate_kwargs)(features, labels,
                                                               TRAIN, params)
    return len(graph.get_operations())


@pytest.mark.parametrize("params,towers", [
    pytest.param(BATCH_NORMS[3], 4, id="fused-4"),
    harness.wide(BATCH_NORMS[3], 2, id="fused-2"),
    pytest.param(BATCH_NORMS[4], 2, id="unfused-2"),
    harness.wide(BATCH_NORMS[4], 4, id="unfused-4"),
])
def test_synchronised_batch_norm_adds_few_ops(params, towers):
  # A conv, one batch-norm layer, a dense head. Whole-batch statistics take
  # one meeting per layer: on these virtual CPUs a fused layer's kernel runs
  # once on the concatenated shards, 367 ops against 429 unsynchronised at
  # 2 towers, 587 against 727 at 4 (447 and 719 with the hub's merge of
  # moments and its gradient written out; two batch_sums and automatic
  # differentiation built 660 and 1174).
  synced = _graph_ops(_batch_norm_model_fn, towers, params)
  unsynced = _graph_ops(
      _batch_norm_model_fn, towers, params, sync_batch_norm=False)
  assert synced <= 1.2 * unsynced, (synced, unsynced)


def _wide_batch_norm_model_fn(features, labels, mode, params):
  """A conv and a fused Keras batch norm on 10x10x16 maps; no ReLU or pool,
  whose ties rounding could break either way."""
  del params  # unused
  x = tf.keras.layers.Conv2D(
      16,
      3,
      use_bias=False,
      name="conv",
      kernel_initializer=tf.keras.initializers.GlorotUniform(1))(
          features["x"])
  x = tf.keras.layers.BatchNormalization(name="bn")(x, training=mode == TRAIN)
  logits = tf.keras.layers.Dense(
      3,
      name="logits",
      kernel_initializer=tf.keras.initializers.GlorotUniform(2))(
          tf.reshape(x, [-1, 10 * 10 * 16]))
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("static", [harness.wide(True), False])
def test_fused_batch_norm_on_wider_maps_is_one_devices(static):
  # 1,600 values per channel and shard (the unit tests' maps have 4): the
  # size at which TensorFlow's CPU kernels (oneDNN on x86) take their
  # vectorised paths, for the shard moments and their gradient too.
  rng = np.random.RandomState(0)
  images = (rng.randn(64, 12, 12, 3) * 2 + 1).astype(np.float32)
  labels = rng.randint(0, 3, 64).astype(np.int64)

  def input_fn():
    return tf.data.Dataset.from_tensor_slices(({
        "x": images
    }, labels)).repeat().batch(
        32, drop_remainder=static)

  replicate.testing.assert_replicates(
      _wide_batch_norm_model_fn,
      input_fn,
      towers=(2, 4),
      steps=3,
      modes=("train", "eval"))


# Keras optimizers in a custom model_fn.


def _keras_model_fn(features, labels, mode, params):
  dense = tf.keras.layers.Dense(3, name="logits")
  loss_fn = lambda: tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, dense(features["x"]))
  optimizer = replicate.TowerOptimizer(tf.keras.optimizers.legacy.Adam(1e-2))
  form = params["form"]
  if form == "callables":
    train_op = optimizer.minimize(loss_fn, lambda: dense.trainable_weights)
    loss = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.LOSSES)[-1]
  else:
    with tf.GradientTape() as tape:
      loss = loss_fn()
    variables = dense.trainable_weights
    if form == "no_gradient":
      variables = [tf.compat.v1.get_variable("unused", [2])]
    train_op = optimizer.minimize(loss, variables, tape=tape)
  step = tf.compat.v1.train.get_global_step()
  with tf.control_dependencies([train_op]):
    train_op = step.assign_add(1)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize(
    "form,towers,batch,static",
    _in_turns(["tape", "callables"], ["tape", "callables"], SHAPES[:2], 1))
def test_keras_minimize_is_one_devices(form, towers, batch, static):
  expected_losses, _ = _assert_one_devices(
      _keras_model_fn, towers, batch, static, params={"form": form})
  assert expected_losses[0] != expected_losses[-1]  # it trained


@pytest.mark.parametrize("towers", [None, 2])
def test_keras_minimize_without_gradients_is_an_error(towers):
  with pytest.raises(
      ValueError, match="No gradients provided for any "
      "variable"):
    _train(_keras_model_fn, 8, towers=towers, params={"form": "no_gradient"})


# Hooks fetch the whole batch's loss and predictions.


class _Recorder(tf.compat.v1.train.SessionRunHook):
  """Records what it fetches: a custom hook, no special case."""

  def __init__(self, fetches):
    self._fetches = fetches
    self.seen = []

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._fetches)

  def after_run(self, run_context, run_values):
    self.seen.append(run_values.results)


def _hooked_model_fn(features, labels, mode, params):
  del params
  logits = tf.compat.v1.layers.dense(features["x"], 3, name="logits")
  predictions = {"logits": logits}
  if mode == PREDICT:
    hook = _Recorder({"logits": logits})
    return tf.estimator.EstimatorSpec(
        mode, predictions=predictions, prediction_hooks=[hook])
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  hook = _Recorder({"loss": loss, "loss_name": loss.name})
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=_minimize(loss), training_hooks=[hook])


def _hooked_run(mode, towers):
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(10), 10, static=False)
    wrapped = _hooked_model_fn if towers is None else (
        replicate.replicate_model_fn(_hooked_model_fn, devices=_towers(towers)))
    spec = wrapped(features, labels if mode == TRAIN else None, mode, {})
    hooks = spec.training_hooks if mode == TRAIN else spec.prediction_hooks
    fetch = spec.train_op if mode == TRAIN else spec.predictions
    init = tf.compat.v1.train.Scaffold(
        init_fn=lambda _, s: (harness.set_trainable_weights(s)))
    with tf.compat.v1.train.SingularMonitoredSession(
        hooks=hooks, scaffold=init, config=harness.session_config()) as session:
      for _ in range(2):
        session.run(fetch)
  assert len(hooks) == 1 and isinstance(hooks[0], _Recorder)
  return hooks[0].seen


@pytest.mark.parametrize("mode", [TRAIN, PREDICT])
def test_custom_hooks_see_the_whole_batch(mode):
  expected = _hooked_run(mode, None)
  for towers in (2, 4):
    harness.assert_close_nests(
        _hooked_run(mode, towers), expected, rtol=1e-5, atol=1e-6)


# The public functions themselves.


def test_outside_replication_and_with_one_tower_they_return_x():
  with tf.Graph().as_default():
    x = tf.constant([[1.0], [2.0]])
    assert replicate.batch_sum(x) is x
    assert replicate.batch_concat(x) is x

    def model_fn(features, labels, mode):
      del labels
      assert replicate.batch_sum(features) is features
      assert replicate.batch_concat(features) is features
      return tf.estimator.EstimatorSpec(mode, predictions=features)

    before = len(tf.compat.v1.get_default_graph().get_operations())
    replicate.replicate_model_fn(model_fn, devices=_towers(1))(x, None, PREDICT)
    assert len(tf.compat.v1.get_default_graph().get_operations()) == before


def _collected(values_fn, towers=2):
  """What every tower's `values_fn(features)` returned, run once."""
  seen = []

  def model_fn(features, labels, mode):
    del labels
    seen.append(values_fn(features))
    return tf.estimator.EstimatorSpec(mode, predictions=features["x"])

  with tf.Graph().as_default():
    x = tf.reshape(tf.range(8, dtype=tf.float32), [4, 2])
    features = {"x": x, "ids": tf.sparse.from_dense(tf.cast(x, tf.int64))}
    replicate.replicate_model_fn(
        model_fn, devices=_towers(towers))(features, None, PREDICT)
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      return session.run(seen)


def test_nests_sums_and_sparse_concatenation():
  towers = _collected(
      lambda f: {
          "sum":
              replicate.batch_sum((tf.reduce_sum(f["x"]), tf.shape(f["x"])[0])),
          "concat":
              replicate.batch_concat([f["x"] * 2, f["ids"]])
      })
  for tower in towers:
    assert tower["sum"] == (28.0, 4)
    np.testing.assert_array_equal(tower["concat"][0],
                                  np.arange(8).reshape(4, 2) * 2)
    np.testing.assert_array_equal(
        tf.compat.v1.SparseTensorValue(*tower["concat"][1]).dense_shape, [4, 2])
    np.testing.assert_array_equal(tower["concat"][1].values, np.arange(1, 8))


def test_concatenating_a_scalar_is_an_error():
  with pytest.raises(
      ValueError,
      match="got a scalar .* use "
      "replicate.batch_sum for partial sums"):
    _collected(lambda f: replicate.batch_concat(tf.reduce_sum(f["x"])))


def test_summing_a_sparse_tensor_is_a_type_error():
  with pytest.raises(
      TypeError, match="batch_sum got a SparseTensor.* "
      "tf.sparse.reduce_sum"):
    _collected(lambda f: replicate.batch_sum(f["ids"]))


def test_inside_a_cond_is_an_error():
  with pytest.raises(
      ValueError,
      match="batch_sum was called inside a "
      "tf.cond, tf.while_loop or tf.function of a tower"):
    _collected(lambda f: tf.cond(
        tf.reduce_sum(f["x"]) > 0, lambda: replicate.batch_sum(f["x"]), lambda:
        f["x"]))
