"""Gradients a model_fn takes itself (`tf.gradients`), as one device's.

Research code often differentiates its loss itself and hands the result,
clipped, to `apply_gradients` (BERT's `optimization.py`:
`tf.gradients(loss, tvars)`, `tf.clip_by_global_norm`, its own
optimizer's `apply_gradients`). On one device that is the gradient of the
whole batch's loss. While towers are built (`routed`), the public
`tf.gradients` / `tf.compat.v1.gradients` called on a tower thread with a
scalar `ys` (each a scalar, no `grad_ys`) is a meeting point of the towers:
their `ys` are combined into the whole batch's (a sum over the rows is
added up, any other scalar is combined as the loss is, see `_loss`) and
differentiated once, each gradient op colocated
with its forward op. Every tower gets the gradient with respect to each of
its `xs`: for a shared variable one device's gradient (recorded as the
whole batch's, so `apply_gradients` applies it once, not summed); for a
tensor of the tower (an activation, its inputs) that tower's rows of one
device's gradient. Other calls (a non-scalar `ys`, `grad_ys` given) are
each tower's own, as TensorFlow computes them. The library's own calls and
TensorFlow's (optimizers call `gradients.gradients`, a module function
this leaves alone) pass straight through. `tf.GradientTape.gradient` of a
scalar target (no `output_gradients`) in a tower meets the towers the same
way: TF2-style model_fns differentiate with a tape.
"""

import functools
import inspect
from typing import Any, List

import tensorflow as tf
from absl import logging

from replicate import _aggregate
from replicate import _context
from replicate import _gather
from replicate import _inputs
from replicate import _lockstep
from replicate import _loss
from replicate import _patches
from replicate import _routing

_ORIGINAL_V1 = tf.compat.v1.gradients
_ORIGINAL_V2 = tf.gradients
_KIND = "tf.gradients"
_ORIGINAL_TAPE = tf.GradientTape.gradient
_TAPE_KIND = "GradientTape.gradient"


def _api_modules() -> List[Any]:
  """The public API modules holding `gradients` (each once)."""
  modules, pending = [], [tf]
  while pending:
    module = pending.pop()
    if any(module is m for m in modules):
      continue
    modules.append(module)
    compat = getattr(module, "compat", None)
    for version in ("v1", "v2"):
      child = getattr(compat, version, None)
      if child is not None:
        pending.append(child)
  return modules


def _bound(original, args, kwargs):
  """The call's arguments by name, defaults included."""
  bound = inspect.signature(original).bind(*args, **kwargs)
  bound.apply_defaults()
  return dict(bound.arguments)


def _is_scalar(tensor) -> bool:
  return isinstance(tensor, tf.Tensor) and tensor.shape.rank == 0


def _key(x):
  return x.ref() if isinstance(x, (tf.Tensor, tf.Variable)) else id(x)


def _sums_rows(tensor) -> bool:
  """Whether a scalar is a `reduce_sum` over all of a tensor's axes."""
  while tensor.op.type == "Identity":
    tensor = tensor.op.inputs[0]
  return tensor.op.type == "Sum" and tensor.op.inputs[0].shape.rank != 0


def _combine(replication, terms):
  """The whole batch's value of the towers' scalars `terms`.

  A sum over the rows (`tf.reduce_sum(logits)`, of a saliency map, say) is
  one device's summed over the towers, whatever the loss reduction; any
  other scalar is combined as the loss is (`_loss`).
  """
  if (not _aggregate.is_sum(replication.loss_reduction) and
      all(map(_sums_rows, terms)) and replication.inputs and
      _inputs.reads_batch(terms, replication.inputs)):
    logging.info("replicate: tf.gradients of a sum over the rows: the "
                 "towers' sums are added")
    with tf.device(replication.hub), tf.name_scope("whole_batch_sum"):
      return _aggregate.real_sum(terms, replication.validity)
  return _loss.combine(replication, terms)


def _whole_batch(replication, calls):
  """One differentiation of the combined `ys` for every tower's call."""
  counts = {len(call["ys"]) for call in calls}
  if len(counts) != 1:
    raise ValueError(
        f"tf.gradients was called with {sorted(counts)} scalars in `ys` in "
        "different towers; every tower must differentiate the same terms.")
  combined = [_combine(replication, [call["ys"][k] for call in calls])
              for k in range(counts.pop())]
  union, stops = {}, {}
  for call in calls:
    for x in call["xs"]:
      union.setdefault(_key(x), x)
    for stop in call["stop_gradients"]:
      stops.setdefault(_key(stop), stop)
  first = calls[0]
  xs = list(union.values())
  grads = _ORIGINAL_V1(
      combined, xs, name=first["name"], colocate_gradients_with_ops=True,
      gate_gradients=first["gate_gradients"],
      aggregation_method=first["aggregation_method"],
      stop_gradients=list(stops.values()) or None,
      unconnected_gradients=first["unconnected_gradients"])
  by_key = {}
  for x, grad in zip(xs, grads):
    if isinstance(x, tf.Variable):
      # One device's rows for a lookup of unique ids; recorded as the whole
      # batch's, so that apply_gradients applies it once.
      grad = _gather.one_device_slices([(grad, x)])[0][0]
      replication.whole_batch_gradients.update(
          t.ref() for t in tf.nest.flatten(grad, expand_composites=True)
          if isinstance(t, tf.Tensor))
    by_key[_key(x)] = grad
  return [[_phantom_zeros(replication, index, x, by_key[_key(x)])
           for x in call["xs"]] for index, call in enumerate(calls)]


def _phantom_zeros(replication, index: int, x, grad):
  """Zeros for a tensor of a tower computing on a phantom row (see `_split`).

  Such a tower adds nothing to the whole batch's value, so its tensors have
  no gradient; it still gets zeros, as the towers holding examples get
  tensors, so that its model_fn builds as theirs do.
  """
  if grad is None and isinstance(x, tf.Tensor) and (
      replication.is_valid(index) is False):
    return tf.zeros_like(x)
  return grad


def _routed(original):
  """`original` (a public gradients function), meeting the towers."""

  @functools.wraps(original)
  def gradients(*args, **kwargs):
    replication = _routing.routes()
    if replication is None:
      return original(*args, **kwargs)
    arguments = _bound(original, args, kwargs)
    ys = tf.nest.flatten(arguments["ys"])
    if arguments["grad_ys"] is not None or not all(map(_is_scalar, ys)):
      logging.info("replicate: tf.gradients of a non-scalar ys or with "
                   "grad_ys: each tower's own")
      return original(*args, **kwargs)
    call = dict(arguments, ys=ys, xs=tf.nest.flatten(arguments["xs"]),
                stop_gradients=tf.nest.flatten(
                    arguments.get("stop_gradients") or []))
    return _lockstep.meet(
        _KIND, call, functools.partial(_whole_batch, replication))

  return gradients


def _routed_tape(original):
  """`GradientTape.gradient`, meeting the towers as `tf.gradients` does.

  In a graph the tape differentiates the ops it recorded, which for a loss
  built inside it are the ops `tf.gradients` follows; a variable the tape
  did not watch gets no gradient, as from the tape.
  """

  @functools.wraps(original)
  def gradient(self, target, sources, output_gradients=None,
               unconnected_gradients=tf.UnconnectedGradients.NONE):
    replication = _routing.routes()
    targets = tf.nest.flatten(target)
    if (replication is None or output_gradients is not None or
        not all(map(_is_scalar, targets))):
      if replication is not None:
        logging.info("replicate: GradientTape.gradient of a non-scalar "
                     "target or with output_gradients: each tower's own")
      return original(self, target, sources, output_gradients,
                      unconnected_gradients)
    call = dict(ys=targets, xs=tf.nest.flatten(sources), stop_gradients=[],
                name="gradients", gate_gradients=False,
                aggregation_method=None,
                unconnected_gradients=unconnected_gradients)
    grads = _lockstep.meet(_TAPE_KIND, call,
                           functools.partial(_whole_batch, replication))
    # A variable the tape never saw read has no gradient from it.
    watched = {v.ref() for v in self.watched_variables()}
    grads = [None if isinstance(x, tf.Variable) and x.ref() not in watched
             else grad for x, grad in zip(call["xs"], grads)]
    return tf.nest.pack_sequence_as(sources, grads)

  return gradient


def _install() -> _patches.Patched:
  originals = []
  for module in _api_modules():
    function = module.__dict__.get("gradients")
    if function is _ORIGINAL_V1 or function is _ORIGINAL_V2:
      originals.append((module, "gradients", function))
      setattr(module, "gradients", _routed(function))
  originals.append((tf.GradientTape, "gradient", _ORIGINAL_TAPE))
  tf.GradientTape.gradient = _routed_tape(_ORIGINAL_TAPE)
  return originals


_PATCHES = _patches.Patches("tf.gradients in towers", _install)


def routed(replication: _context.Replication):
  """`tf.gradients` calls on the towers' threads meet while inside."""
  return _PATCHES.applied(replication.num_towers > 1)
