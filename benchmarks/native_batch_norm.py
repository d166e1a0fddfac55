r"""What synchronised batch norm would cost on CPU towers with its own kernels.

An experiment, not the library: on one machine's CPUs `replicate` runs
each fused batch-norm layer as one TensorFlow kernel on the concatenated
batch (`hub` below), and its step stays at 0.8-0.9x unsynchronised
(benchmarks/README.md, synchronised batch norm). This script compiles three
one-pass per-channel kernels (`native_batch_norm.cc`, with TensorFlow's compile
flags and the system C++ compiler) and times the cnn_bn workload's graph, built
tower by tower by hand, in these ways:

- `unsync`: each tower's training-mode fused kernel on its shard;
- `hub`: the shards concatenated on CPU:0, one training-mode kernel, split
  back (the library's route);
- `native`: per tower, the shard's moments in one pass; the whole batch's
  mean and variance merged on CPU:0; per tower, the inference-mode fused
  kernel with them. Backward, per tower, sum(dy) and sum(dy (x - mean)) in
  one pass; merged; per tower, dx = a dy + b x + c in one pass;
- `native_backward`: `native` with the shard moments from the
  training-mode fused kernel (which part of the gain is the backward's);
- `native_relu`: `native` with the layer's ReLU in its kernels: the
  normalisation (one pass) and, backward, both passes mask dy where the
  forward's arithmetic was not positive (no ReluGrad).

Two more arrange TensorFlow's own kernels otherwise (asked for with
`--variants`): `hub`'s forward, and backward either each tower's ReluGrad
before the hub's concatenation and kernel gradient (`hub_tower_relu_grad`)
or the whole gradient per tower (`hub_tower_backward`: the inference
kernel's gradient gives a tower's share of dx and its shard's sums, merged
on CPU:0, then an affine correction and an add).

With `--replicate`, also `replicate_sync` / `replicate_unsync`: the
library's own graphs of the workload (benchmarks/workloads.py, with their
moving statistics and optimizer wrapping), for scale; with `--ungated`,
also both built with `gate_gradients=GATE_NONE` instead of the
optimizer's default GATE_OP (whether gating the towers' gradients costs
step time). Every variant gets its own graph and session in this process;
after a warm-up they take turns window by window (the order rotated each
window), and each window's step time is compared with `unsync`'s of the
same window (the library's with `replicate_unsync`'s). `--check` first
compares the first step's loss and gradients with one device's.

  python benchmarks/native_batch_norm.py --towers=2,4 --windows=20
  python benchmarks/native_batch_norm.py --check --towers=2,4 --windows=0
"""

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import workloads  # pylint: disable=g-import-not-at-top

import replicate  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_list("towers", ["2", "4"], "Tower counts N (virtual CPUs).")
flags.DEFINE_list("variants",
                  ["unsync", "hub", "native", "native_backward", "native_relu"],
                  "Hand-built variants (see the module docstring).")
flags.DEFINE_bool("replicate", True,
                  "Also time the library's sync and unsync graphs.")
flags.DEFINE_bool(
    "ungated", False, "With --replicate, also the library's graphs minimised "
    "with gate_gradients=GATE_NONE.")
flags.DEFINE_integer("batch_size", 256, "Global batch.")
flags.DEFINE_integer("warmup_steps", 20, "Untimed steps per variant.")
flags.DEFINE_integer("windows", 15, "Timed windows per variant (0: none).")
flags.DEFINE_integer("window_steps", 10, "Steps per window.")
flags.DEFINE_bool(
    "check", False, "First compare the first step with one device's (exit "
    "status 1 if a synchronised variant is too far).")
flags.DEFINE_float(
    "check_rtol", 1e-4, "--check fails where a gradient differs from one "
    "device's by more than this times its largest entry.")
flags.DEFINE_string("cxx", os.environ.get("CXX", "c++"), "C++ compiler.")

EPSILON = 1e-3  # the v1 layer's default
_SOURCE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "native_batch_norm.cc")


def compile_kernels(cxx: str, directory: str):
  """Builds native_batch_norm.cc into `directory`; returns its op module."""
  library = os.path.join(directory, "native_batch_norm.so")
  # No contraction into FMAs: the gradient's ReLU mask repeats the forward's
  # arithmetic and must round alike.
  command = ([
      cxx, "-shared", "-fPIC", "-O3", "-ffp-contract=off", _SOURCE, "-o",
      library
  ] + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags())
  subprocess.run(command, check=True)
  return tf.load_op_library(library)


@contextlib.contextmanager
def _apart(device: str):
  """Ops on `device`, not colocated with the custom gradient's IdentityN."""
  with tf.compat.v1.colocate_with(
      None, ignore_existing=True), tf.device(device):
    yield


def _native_layer(kernels, xs: List[tf.Tensor], gamma, beta,
                  native_moments: bool, relu: bool) -> List[tf.Tensor]:
  """Batch norm of every tower's shard with the whole batch's statistics.

  With `relu`, its ReLU too, in the same pass (and in its gradient's).
  """
  hub = xs[0].device

  @tf.custom_gradient
  def layer(*inputs):
    shards, scale, offset = inputs[:-2], inputs[-2], inputs[-1]
    moments = []
    for x in shards:
      with tf.device(x.device):
        count = tf.cast(tf.reduce_prod(tf.shape(x)[:-1]), tf.float32)
        if native_moments:
          mean, squared = kernels.replicate_benchmark_moments(x)
        else:
          channels = x.shape[-1]
          kernel = tf.raw_ops.FusedBatchNormV3(
              x=x,
              scale=tf.ones([channels]),
              offset=tf.ones([channels]),
              mean=tf.constant([], tf.float32),
              variance=tf.constant([], tf.float32),
              epsilon=EPSILON,
              is_training=True)
          mean = kernel.batch_mean
          squared = kernel.batch_variance * tf.maximum(count - 1.0, 1.0)
      moments.append((count, mean, squared))
    with tf.device(hub):
      # Chan et al.'s merge of the shards' (count, mean, squared distances).
      total = tf.add_n([c for c, _, _ in moments])
      mean = tf.add_n([c * m for c, m, _ in moments]) / total
      variance = tf.add_n([s + c * tf.square(m - mean) for c, m, s in moments
                          ]) / total
      r = tf.math.rsqrt(variance + EPSILON)
      a = scale * r  # y = a x + (offset - a mean)
      shift = offset - a * mean
    outputs = []
    for x in shards:
      with tf.device(x.device):
        if relu:
          outputs.append(
              kernels.replicate_benchmark_normalize_relu(x, a, shift))
        else:
          outputs.append(
              tf.compat.v1.nn.fused_batch_norm(
                  x,
                  scale,
                  offset,
                  mean,
                  variance,
                  epsilon=EPSILON,
                  is_training=False)[0])

    def gradient(*doutputs):
      sums = []
      for x, dy in zip(shards, doutputs):
        with _apart(x.device):
          sums.append(
              kernels.replicate_benchmark_gradient_sums(
                  dy, x, mean, a, shift, relu=relu))
      with _apart(hub):
        sum_dy = tf.add_n([s for s, _ in sums])
        sum_centred = tf.add_n([c for _, c in sums])
        # dx = a (dy - sum_dy / n - (x - mean) r^2 sum_centred / n).
        b = -a * r * r * sum_centred / total
        c = -a * sum_dy / total - b * mean
      dxs = []
      for x, dy in zip(shards, doutputs):
        with _apart(x.device):
          dxs.append(
              kernels.replicate_benchmark_affine(
                  dy, x, a, b, c, a, shift, relu=relu))
      return dxs + [sum_centred * r, sum_dy]

    return outputs, gradient

  return layer(*xs, gamma, beta)


def _hub(xs: List[tf.Tensor], gamma, beta, with_reserve: bool = False):
  """The library's route: the shards concatenated, one kernel, ReLU, split.

  With `with_reserve`, also returns what a written-out gradient needs:
  (the batch, the kernel op's outputs).
  """
  with tf.device(xs[0].device):
    whole = tf.concat(xs, 0) if len(xs) > 1 else xs[0]
    kernel = tf.raw_ops.FusedBatchNormV3(
        x=whole,
        scale=gamma,
        offset=beta,
        mean=tf.constant([], tf.float32),
        variance=tf.constant([], tf.float32),
        epsilon=EPSILON,
        is_training=True)
    y = tf.nn.relu(kernel.y)
    parts = tf.split(y, len(xs)) if len(xs) > 1 else [y]
  outputs = []
  for x, part in zip(xs, parts):  # the ReLU ran on the hub, as the library's
    with tf.device(x.device):
      outputs.append(tf.identity(part))
  return (outputs, whole, kernel) if with_reserve else outputs


# Hub forward, TensorFlow's kernels backward: each tower's ReluGrad, then
# the concatenated gradient through the training kernel's gradient on the
# hub; or the whole backward per tower (the inference kernel's gradient for
# a tower's share and its sums, merged, and an affine correction).
_HUB_BACKWARDS = {"hub_tower_relu_grad": "hub", "hub_tower_backward": "towers"}


def _hub_with_backward(xs: List[tf.Tensor], gamma, beta, backward: str):
  """`_hub`'s forward with a written-out gradient of TensorFlow's kernels."""
  hub = xs[0].device

  @tf.custom_gradient
  def layer(*inputs):
    shards, scale = inputs[:-2], inputs[-2]
    outputs, whole, kernel = _hub(shards, scale, inputs[-1], True)
    with tf.device(hub):
      total = tf.cast(tf.reduce_prod(tf.shape(whole)[:-1]), tf.float32)
      # The kernel reports the Bessel-corrected variance; it divided by n.
      variance = kernel.batch_variance * (total - 1.0) / total

    def gradient(*doutputs):
      relu_grads = []
      for x, dy, y in zip(shards, doutputs, outputs):
        with _apart(x.device):
          relu_grads.append(tf.raw_ops.ReluGrad(gradients=dy, features=y))
      if backward == "hub":
        with _apart(hub):
          whole_grad = tf.raw_ops.FusedBatchNormGradV3(
              y_backprop=tf.concat(relu_grads, 0)
              if len(shards) > 1 else relu_grads[0],
              x=whole,
              scale=scale,
              reserve_space_1=kernel.reserve_space_1,
              reserve_space_2=kernel.reserve_space_2,
              reserve_space_3=kernel.reserve_space_3,
              epsilon=EPSILON,
              is_training=True)
          dxs = (
              tf.split(whole_grad.x_backprop, len(shards))
              if len(shards) > 1 else [whole_grad.x_backprop])
        return dxs + [whole_grad.scale_backprop, whole_grad.offset_backprop]
      shares = []
      for x, g in zip(shards, relu_grads):
        with _apart(x.device):
          # dx share g gamma r, and the shard's sum(g) and sum(g x_hat).
          shares.append(
              tf.raw_ops.FusedBatchNormGradV3(
                  y_backprop=g,
                  x=x,
                  scale=scale,
                  reserve_space_1=kernel.batch_mean,
                  reserve_space_2=variance,
                  reserve_space_3=tf.constant([], tf.float32),
                  epsilon=EPSILON,
                  is_training=False))
      with _apart(hub):
        sum_centred = tf.add_n([s.scale_backprop for s in shares])
        sum_dy = tf.add_n([s.offset_backprop for s in shares])
        r = tf.math.rsqrt(variance + EPSILON)
        # dx = gamma r (g - sum_dy / n - x_hat sum_centred / n): the share
        # plus b (x - mean) + c, the inference kernel given variance 1 - eps.
        b = -scale * r * r * sum_centred / total
        c = -scale * r * sum_dy / total
        unit = tf.fill(tf.shape(scale), 1.0 - EPSILON)
      dxs = []
      for x, share in zip(shards, shares):
        with _apart(x.device):
          dxs.append(share.x_backprop + tf.compat.v1.nn.fused_batch_norm(
              x,
              b,
              c,
              kernel.batch_mean,
              unit,
              epsilon=EPSILON,
              is_training=False)[0])
      return dxs + [sum_centred, sum_dy]

    return outputs, gradient

  return layer(*xs, gamma, beta)


def _batch_norm_relu(kernels, variant: str, hs: List[tf.Tensor],
                     name: str) -> List[tf.Tensor]:
  channels = hs[0].shape[-1]
  with tf.compat.v1.variable_scope(name):
    gamma = tf.compat.v1.get_variable(
        "gamma", [channels], initializer=tf.ones_initializer())
    beta = tf.compat.v1.get_variable(
        "beta", [channels], initializer=tf.zeros_initializer())
  if variant == "unsync":
    ys = []
    for h in hs:
      with tf.device(h.device):
        ys.append(
            tf.compat.v1.nn.fused_batch_norm(
                h, gamma, beta, epsilon=EPSILON, is_training=True)[0])
  elif variant == "hub":
    return _hub(hs, gamma, beta)
  elif variant in _HUB_BACKWARDS:
    return _hub_with_backward(hs, gamma, beta, _HUB_BACKWARDS[variant])
  elif variant == "native_relu":
    return _native_layer(kernels, hs, gamma, beta, True, relu=True)
  else:
    ys = _native_layer(
        kernels, hs, gamma, beta, variant == "native", relu=False)
  outputs = []
  for h, y in zip(hs, ys):
    with tf.device(h.device):
      outputs.append(tf.nn.relu(y))
  return outputs


def _hand_built(kernels, variant: str, towers: int, features, labels):
  """The cnn_bn workload tower by tower; returns (loss, grads, train_op)."""
  devices = [f"/device:CPU:{i}" for i in range(towers)]
  xs, ys = tf.split(features, towers), tf.split(labels, towers)

  def each(fn, hs):
    out = []
    for device, h in zip(devices, hs):
      with tf.device(device), tf.compat.v1.variable_scope(
          "", reuse=tf.compat.v1.AUTO_REUSE):
        out.append(fn(h))
    return out

  def conv(filters, name, seed):
    return lambda h: tf.compat.v1.layers.conv2d(
        h,
        filters,
        3,
        padding="same",
        use_bias=False,
        name=name,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=seed))

  def pool(h):
    return tf.compat.v1.layers.max_pooling2d(h, 2, 2)

  def head(h):
    h = tf.compat.v1.layers.flatten(pool(h))
    h = tf.compat.v1.layers.dense(
        h,
        64,
        tf.nn.relu,
        name="dense",
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=3))
    return tf.compat.v1.layers.dense(
        h,
        workloads.NUM_CLASSES,
        name="logits",
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=4))

  hs = each(
      lambda x: conv(16, "conv1", 1)
      (tf.reshape(x, (-1,) + workloads.IMAGE_SHAPE)), xs)
  hs = _batch_norm_relu(kernels, variant, hs, "conv1_bn")
  hs = each(lambda h: conv(32, "conv2", 2)(pool(h)), hs)
  hs = _batch_norm_relu(kernels, variant, hs, "conv2_bn")
  logits = each(head, hs)
  losses = []
  for device, logit, label in zip(devices, logits, ys):
    with tf.device(device):
      losses.append(
          tf.reduce_sum(
              tf.nn.sparse_softmax_cross_entropy_with_logits(
                  labels=label, logits=logit)))
  loss = tf.add_n(losses) / FLAGS.batch_size
  variables = tf.compat.v1.trainable_variables()
  grads = tf.compat.v1.gradients(
      loss, variables, colocate_gradients_with_ops=True)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9)
  return loss, grads, optimizer.apply_gradients(zip(grads, variables))


def _library(variant: str, towers: int, features, labels):
  tf.compat.v1.train.create_global_step()
  model_fn = replicate.replicate_model_fn(
      workloads.model_fn,
      devices=[f"/device:CPU:{i}" for i in range(towers)],
      sync_batch_norm=variant.startswith("replicate_sync"))
  params = dict(workload="cnn_bn", learning_rate=0.01, momentum=0.9)
  if variant.endswith("_ungated"):
    params["gate_gradients"] = tf.compat.v1.train.Optimizer.GATE_NONE
  spec = model_fn({"x": features}, labels, tf.estimator.ModeKeys.TRAIN, params)
  return spec.loss, [], spec.train_op


def _session(kernels, variant: str, towers: int):
  """(session, loss, grads, train_op) of `variant` on `towers` CPUs."""
  graph = tf.Graph()
  with graph.as_default():
    rng = np.random.RandomState(0)
    features = tf.constant(
        rng.randn(FLAGS.batch_size, workloads.NUM_INPUTS).astype(np.float32))
    labels = tf.constant(
        rng.randint(0, workloads.NUM_CLASSES,
                    FLAGS.batch_size).astype(np.int32))
    if variant.startswith("replicate_"):
      built = _library(variant, towers, features, labels)
    else:
      built = _hand_built(kernels, variant, towers, features, labels)
    init = tf.compat.v1.global_variables_initializer()
  session = tf.compat.v1.Session(
      graph=graph,
      config=tf.compat.v1.ConfigProto(device_count={"CPU": towers}))
  session.run(init)
  return (session,) + built


def _check(kernels, towers: Sequence[int]) -> bool:
  """Prints each variant's first step against one device's; True if close."""
  session, loss, grads, _ = _session(kernels, "unsync", 1)
  expected = session.run([loss] + grads)
  session.close()
  ok = True
  for n in towers:
    for variant in FLAGS.variants:
      session, loss, grads, _ = _session(kernels, variant, n)
      actual = session.run([loss] + grads)
      session.close()
      worst = max(
          float(np.max(np.abs(a - e)) / np.max(np.abs(e)))
          for a, e in zip(actual, expected))
      synchronised = variant != "unsync"
      close = worst <= FLAGS.check_rtol
      ok &= close or not synchronised
      print(f"check N={n} {variant}: largest difference from one device "
            f"{worst:.1e} of the largest entry"
            f"{'' if close or not synchronised else ' (too far)'}")
  return ok


def _time(sessions: Dict[str, Tuple]) -> Dict[str, List[float]]:
  """Step seconds per window, per variant, in rotating order."""
  for session, _, _, train_op in sessions.values():
    for _ in range(FLAGS.warmup_steps):
      session.run(train_op)
  names = list(sessions)
  steps = {name: [] for name in names}
  for window in range(FLAGS.windows):
    for name in names[window % len(names):] + names[:window % len(names)]:
      session, _, _, train_op = sessions[name]
      start = time.perf_counter()
      for _ in range(FLAGS.window_steps):
        session.run(train_op)
      steps[name].append((time.perf_counter() - start) / FLAGS.window_steps)
  return steps


def main(argv):
  del argv  # unused
  tf.compat.v1.disable_eager_execution()
  if "unsync" not in FLAGS.variants:
    raise app.UsageError(f"--variants={','.join(FLAGS.variants)} lacks "
                         "unsync, which the others are compared with: add it")
  with tempfile.TemporaryDirectory() as directory:
    kernels = compile_kernels(FLAGS.cxx, directory)
    towers = [int(n) for n in FLAGS.towers]
    if FLAGS.check and not _check(kernels, towers):
      sys.exit(1)
    if not FLAGS.windows:
      return
    library = (["replicate_unsync", "replicate_sync"]
               if FLAGS.replicate else [])
    if FLAGS.replicate and FLAGS.ungated:
      library += ["replicate_unsync_ungated", "replicate_sync_ungated"]
    print("| N | variant | step ms (median) | × its unsync (min–max) |")
    print("|---:|---|---:|---:|")
    for n in towers:
      sessions = {v: _session(kernels, v, n) for v in FLAGS.variants + library}
      steps = _time(sessions)
      for session, _, _, _ in sessions.values():
        session.close()
      for variant, times in steps.items():
        base = steps["replicate_unsync" if variant.startswith("replicate_"
                                                             ) else "unsync"]
        ratios = [b / t for b, t in zip(base, times)]
        print(
            f"| {n} | {variant} | {statistics.median(times) * 1e3:.2f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–"
            f"{max(ratios):.2f}) |",
            flush=True)


if __name__ == "__main__":
  app.run(main)
