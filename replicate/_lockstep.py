"""Building the towers in lockstep: one thread per tower, one at a time.

A tower's model_fn may need values only the whole batch has: the sum of a
statistic over every tower's shard (`replicate.batch_sum`, synchronised
batch norm) or the gradients of the whole batch's loss
(`TowerOptimizer.compute_gradients`). Each tower's model_fn therefore runs
in a thread of its own, and these calls are meeting points: a tower that
reaches one hands its value over and pauses; when every tower has reached
the same meeting point the values are combined once, on the calling
thread, and every tower goes on with the result. Only one thread builds at
a time, in tower order, so graph names are as deterministic as in a loop.
tf.distribute's MirroredStrategy builds its replicas the same way.
"""

import threading
from typing import Any, Callable, List, Optional, Sequence


class _Aborted(BaseException):
  """Unwinds a paused tower after another tower failed.

  A BaseException, so that no `except Exception` in a model_fn swallows it.
  """


class _Meeting:
  """What one tower brings to a meeting point, and what it gets back."""

  def __init__(self, kind: str, value: Any, combine: Callable[[List[Any]], Any]):
    self.kind = kind
    self.value = value
    self.combine = combine
    self.result: Any = None


class _TowerThread(threading.Thread):
  """Runs one tower's build function, pausing at meeting points."""

  def __init__(self, index: int, build: Callable[[], Any],
               enter: Callable[[int], Any]):
    super().__init__(name=f"replicate-tower-{index}", daemon=True)
    self.index = index
    self._build = build
    self._enter = enter
    self._go = threading.Event()
    self._paused = threading.Event()
    self.meeting: Optional[_Meeting] = None
    self.done = False
    self.result: Any = None
    self.error: Optional[BaseException] = None
    self.aborted = False
    self.on_pause: Callable[[], None] = lambda: None
    self.on_resume: Callable[[], None] = lambda: None

  def run(self):
    _current.thread = self
    self._go.wait()
    self._go.clear()
    try:
      with self._enter(self.index):
        self.result = self._build()
    except _Aborted:
      pass
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e
    finally:
      self.done = True
      self.meeting = None
      self._paused.set()

  def step(self):
    """Lets the thread build until its next meeting point or its end."""
    self._go.set()
    self._paused.wait()
    self._paused.clear()

  def meet(self, meeting: _Meeting) -> Any:
    """Called on this thread: pauses until every tower met, returns its share."""
    self.meeting = meeting
    self.on_pause()
    self._paused.set()
    self._go.wait()
    self._go.clear()
    if self.aborted:
      raise _Aborted()
    self.on_resume()
    self.meeting = None
    return meeting.result


_current = threading.local()


def current_thread() -> Optional[_TowerThread]:
  """The tower thread this code runs on, if any."""
  return getattr(_current, "thread", None)


def meet(kind: str, value: Any, combine: Callable[[List[Any]], Any]) -> Any:
  """Meets the other towers: `combine(every tower's value)` for each tower.

  `combine` (the first tower's) runs once, on the thread that builds the
  towers, and returns one result per tower.

  Raises:
    ValueError: outside a tower thread (the caller checks this first).
  """
  thread = current_thread()
  if thread is None:
    raise ValueError(f"{kind} was called outside a tower.")
  return thread.meet(_Meeting(kind, value, combine))


def run_towers(builds: Sequence[Callable[[], Any]],
               enter: Callable[[int], Any],
               hooks: Callable[[_TowerThread], None]) -> List[Any]:
  """Runs `builds[i]()` for every tower i, in lockstep; returns the results.

  Args:
    builds: one function per tower, building that tower.
    enter: `enter(i)` is a context manager entered on tower i's thread
      around its build (graph, scopes).
    hooks: called with each thread before it starts, to set its
      `on_pause` / `on_resume` callbacks.

  Raises:
    whatever a tower's build raised (the first, in tower order), or
    ValueError when the towers reach different meeting points.
  """
  threads = [_TowerThread(i, build, enter) for i, build in enumerate(builds)]
  for thread in threads:
    hooks(thread)
    thread.start()
  try:
    while True:
      for thread in threads:
        if not thread.done:
          thread.step()
      failed = [t for t in threads if t.error is not None]
      if failed:
        raise failed[0].error.with_traceback(failed[0].error.__traceback__)
      if all(t.done for t in threads):
        return [t.result for t in threads]
      _combine(threads)
  finally:
    _abort(threads)


def _combine(threads: Sequence[_TowerThread]):
  """Every tower is at a meeting point: checks they agree, then combines."""
  kinds = [t.meeting.kind if t.meeting else None for t in threads]
  if len(set(kinds)) > 1:
    described = ", ".join(
        f"tower {i}: {kind or 'finished its model_fn'}"
        for i, kind in enumerate(kinds))
    raise ValueError(
        f"The towers made different calls that need the whole batch "
        f"({described}); every tower must make the same optimizer calls, "
        "tf.gradients calls of a scalar, and replicate.batch_sum and "
        "batch_concat calls in the same order (not only in one tower), so "
        "that each call can see every tower's value.")
  meetings = [t.meeting for t in threads]
  results = meetings[0].combine([m.value for m in meetings])
  for meeting, result in zip(meetings, results):
    meeting.result = result


def _abort(threads: Sequence[_TowerThread]):
  """Unwinds towers still paused (another failed) and waits for them all."""
  for thread in threads:
    if not thread.done:
      thread.aborted = True
      thread.step()
  for thread in threads:
    thread.join()
