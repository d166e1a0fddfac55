"""Gradients a model_fn takes itself (`tf.gradients`, a tape), as one device's.

Research code often differentiates its loss itself and hands the result,
clipped, to `apply_gradients` (BERT's `optimization.py`:
`tf.gradients(loss, tvars)`, `tf.clip_by_global_norm`, its own
optimizer's `apply_gradients`). On one device that is the gradient of the
whole batch's loss. While towers are built (`routed`), the public
`tf.gradients` / `tf.compat.v1.gradients` and `tf.GradientTape.gradient`
called in a tower are a meeting (`_meet.meetings`): tower 0, the last to make
the call, differentiates once what one device would: each of its `ys`
that is one device's value (a loss: see `_meet.rewiring`) as it is, each with
rows as every tower's rows (with their `grad_ys`), each gradient op colocated
with its forward op. Every tower gets the gradient with respect to each of its
`xs`: for a shared variable one device's gradient, for a tensor of the tower (an
activation, its inputs) that tower's rows of one device's gradient. TensorFlow's
own calls (optimizers call `gradients.gradients`, a module function this leaves
alone) and the library's pass straight through.
"""

import functools
import inspect
from typing import Any, Callable, ContextManager, Dict, List, Sequence

import tensorflow as tf

from replicate import _context
from replicate import _tf
from replicate._batch import row_kinds
from replicate._meet import meetings
from replicate._meet import optimizer_calls
from replicate._meet import routing

_ORIGINAL_V1 = tf.compat.v1.gradients
_ORIGINAL_V2 = tf.gradients
_KIND = "tf.gradients"
_ORIGINAL_TAPE = tf.GradientTape.gradient
_TAPE_KIND = "GradientTape.gradient"


def _api_modules() -> List[Any]:
  """The public API modules holding `gradients` (each once)."""
  modules: List[Any]
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


def _bound(original: Callable[..., Any], args: Sequence[Any],
           kwargs: Dict[str, Any]) -> Dict[str, Any]:
  """The call's arguments by name, defaults included."""
  bound = inspect.signature(original).bind(*args, **kwargs)
  bound.apply_defaults()
  return dict(bound.arguments)


def _key(x: Any) -> Any:
  return x.ref() if isinstance(x, (tf.Tensor, tf.Variable)) else id(x)


def _whole_batch(replication: _context.Replication,
                 calls: Sequence[Dict[str, Any]]) -> List[List[Any]]:
  """One differentiation of what one device would, for every tower's call."""
  rewiring = replication.rewiring
  first = calls[0]
  ys, grad_ys = [], []
  for k, y0 in enumerate(first["ys"]):
    y0 = rewiring.resolve(y0)
    kind = rewiring.kind(y0)
    if row_kinds.shares_value(kind):
      ys.append(y0)
      grad_ys.append(first["grad_ys"][k] if first["grad_ys"] else None)
      continue
    if not isinstance(kind, row_kinds.Rows):
      raise ValueError(
          optimizer_calls.not_whole_batch(
              y0, kind, "the tensor differentiated by tf.gradients"))
    for index, call in enumerate(calls):
      valid = replication.is_valid(index)
      if valid is False:
        continue
      y = call["ys"][k]
      grad = call["grad_ys"][k] if call["grad_ys"] else None
      if valid is not True:
        grad = tf.ones_like(y) if grad is None else grad
        grad = tf.where(valid, grad, tf.zeros_like(grad))
      if replication.trainers is not None:
        # W-fold, as a value of the global batch's is (`_meet.trainers`).
        y = replication.trainers.rows_loss(y)
      ys.append(y)
      grad_ys.append(grad)
  union: Dict[Any, Any]
  stops: Dict[Any, Any]
  union, stops = {}, {}
  for call in calls:
    for x in call["xs"]:
      union.setdefault(_key(x), x)
    for stop in call["stop_gradients"]:
      stops.setdefault(_key(stop), stop)
  windows = [w for call in calls for w in call.get("recorded", ())]
  for stop in optimizer_calls.unrecorded(replication, windows, ys,
                                         list(union.values())):
    stops.setdefault(_key(stop), stop)
  xs = [rewiring.resolve(x) for x in union.values()]
  with optimizer_calls.meeting_scope(replication, pure=True):
    grads = _ORIGINAL_V1(
        ys,
        xs,
        grad_ys=grad_ys if any(g is not None for g in grad_ys) else None,
        name=first["name"],
        colocate_gradients_with_ops=True,
        gate_gradients=first["gate_gradients"],
        aggregation_method=first["aggregation_method"],
        stop_gradients=list(stops.values()) or None,
        unconnected_gradients=first["unconnected_gradients"])
    if replication.trainers is not None:
      grads = _among_trainers(replication, xs, grads)
  by_key = {}
  for x, grad in zip(union.values(), grads):
    if isinstance(x, tf.Variable):
      # One device's rows for a lookup of unique ids.
      grad = optimizer_calls.one_device_slices([(grad, x)])[0][0]
    elif grad is not None and not isinstance(grad, tf.IndexedSlices):
      rewiring.declare(grad, row_kinds.Like(x))
    by_key[_key(x)] = grad
  return [[
      _phantom_zeros(replication, index, x, by_key[_key(x)]) for x in call["xs"]
  ] for index, call in enumerate(calls)]


def _among_trainers(replication: _context.Replication, xs: Sequence[Any],
                    grads: Sequence[Any]) -> List[Any]:
  """One device's gradients on the global batch from this trainer's (each
  W-fold, `_meet.trainers`): a variable's (or a value every trainer
  shares) all-reduced among the trainers, a tensor of this trainer's rows
  its own."""
  trainers = replication.trainers
  variables = [
      i for i, x in enumerate(xs) if isinstance(x, tf.Variable) or
      row_kinds.shares_value(replication.rewiring.kind(x))
  ]
  reduced = trainers.gradients([grads[i] for i in variables])
  result = [trainers.own_rows_gradient(g) for g in grads]
  for i, grad in zip(variables, reduced):
    result[i] = grad
  return result


def _phantom_zeros(replication: _context.Replication, index: int, x: Any,
                   grad: Any) -> Any:
  """Zeros for a tensor of a tower computing on a phantom row (see
  `_prepare.split`).

  Such a tower adds nothing to the whole batch's value, so its tensors have
  no gradient; it still gets zeros, as the towers holding examples get
  tensors, so that its model_fn builds as theirs do.
  """
  if grad is None and isinstance(x, tf.Tensor) and (replication.is_valid(index)
                                                    is False):
    return tf.zeros_like(x)
  return grad


def _spec(call: Dict[str, Any]) -> List[Any]:
  """The gradients' structure, for a tower built before tower 0."""
  ancestors = optimizer_calls.ancestors(call["ys"])
  specs = []
  for x in call["xs"]:
    if isinstance(x, tf.Variable):
      specs.append(
          optimizer_calls.gradient_spec(call["ys"][0], [x], False
                                       )[0] if len(call["ys"]) ==
          1 else meetings.TensorSpec(x.shape, x.dtype.base_dtype))
    elif isinstance(x, tf.Tensor) and x.op in ancestors:
      specs.append(meetings.TensorSpec(x.shape, x.dtype, row_kinds.Like(x)))
    else:
      specs.append(None)
  return specs


def _routed(original: Callable[..., Any]) -> Callable[..., Any]:
  """`original` (a public gradients function), meeting the towers."""

  @functools.wraps(original)
  def gradients(*args: Any, **kwargs: Any) -> Any:
    replication = routing.routes()
    if replication is None:
      return original(*args, **kwargs)
    arguments = _bound(original, args, kwargs)
    ys = [tf.convert_to_tensor(y) for y in tf.nest.flatten(arguments["ys"])]
    grad_ys = arguments["grad_ys"]
    call = dict(
        arguments,
        ys=ys,
        xs=tf.nest.flatten(arguments["xs"]),
        grad_ys=None if grad_ys is None else tf.nest.flatten(grad_ys),
        stop_gradients=tf.nest.flatten(arguments.get("stop_gradients") or []))
    grads = replication.meetings.meet(
        _KIND,
        call,
        functools.partial(_whole_batch, replication),
        _spec,
        signature=(len(ys), len(call["xs"])))
    return grads

  return gradients


def _routed_tape(original: Callable[..., Any]) -> Callable[..., Any]:
  """`GradientTape.gradient`, meeting the towers as `tf.gradients` does.

  In a graph the tape differentiates the ops it recorded, which for a loss
  built inside it are the ops `tf.gradients` follows; a variable the tape
  did not watch gets no gradient, as from the tape.
  """

  @functools.wraps(original)
  def gradient(
      self: tf.GradientTape,
      target: Any,
      sources: Any,
      output_gradients: Any = None,
      unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
    replication = routing.routes()
    if replication is None:
      return original(self, target, sources, output_gradients,
                      unconnected_gradients)
    targets = [tf.convert_to_tensor(t) for t in tf.nest.flatten(target)]
    call = dict(
        ys=targets,
        xs=tf.nest.flatten(sources),
        recorded=optimizer_calls.tape_windows(self, replication.graph),
        stop_gradients=[],
        grad_ys=None
        if output_gradients is None else tf.nest.flatten(output_gradients),
        name="gradients",
        gate_gradients=False,
        aggregation_method=None,
        unconnected_gradients=unconnected_gradients)
    grads = replication.meetings.meet(
        _TAPE_KIND,
        call,
        functools.partial(_whole_batch, replication),
        _spec,
        signature=(len(targets), len(call["xs"])))
    # A variable the tape never saw read has no gradient from it.
    watched = {v.ref() for v in self.watched_variables()}
    grads = [
        None if isinstance(x, tf.Variable) and x.ref() not in watched else grad
        for x, grad in zip(call["xs"], grads)
    ]
    return tf.nest.pack_sequence_as(sources, grads)

  return gradient


def _install() -> _tf.Patched:
  originals = [
      _tf.patch(tf.GradientTape, "__enter__", optimizer_calls.entered_tape),
      _tf.patch(tf.GradientTape, "__exit__", optimizer_calls.exited_tape),
  ]
  for module in _api_modules():
    function = module.__dict__.get("gradients")
    if function is _ORIGINAL_V1 or function is _ORIGINAL_V2:
      originals.append(_tf.patch(module, "gradients", _routed(function)))
  originals.append(
      _tf.patch(tf.GradientTape, "gradient", _routed_tape(_ORIGINAL_TAPE)))
  return originals


_PATCHES = _tf.Patches("tf.gradients in towers", _install)


def routed(replication: _context.Replication) -> ContextManager[None]:
  """`tf.gradients` calls in the towers meet while inside."""
  return _PATCHES.applied(replication.num_towers > 1)
