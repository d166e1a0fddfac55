"""One device's graph for every tower's model_fn call.

A model_fn call reads the graph it builds in: collections (regularization
losses, update ops, summaries, variable lists, custom keys, scoped or
not), the variable store `get_variable` looks in, and the names in use
that new names are made unique against. In one graph holding every tower
a call would find the earlier towers' entries there, and names those
towers took. `GraphViews` gives each call what a single call reads at the
same point instead:

- collections: what was there before the towers plus what this call added;
  a shared variable the call gets back counts as created by it (it joins
  the collections its creation put it in), as on one device;
- the variable store: what was there before plus this call's variables, so
  `get_variable` creates, reuses, regularizes and refuses as on one device;
- names: a tower built before tower 0 names its ops `tower_i/...`; the names
  in use before the towers are taken under that prefix too, so the rest of
  each name is one device's.

After the last tower the graph holds one device's collections: tower 0's,
with every tower's variables, initializers and control-flow contexts, which
the step needs to run, added (`merge`).
"""

from typing import Any, Dict, List, Set, Tuple

import tensorflow as tf

from replicate import _tf

_GraphKeys = tf.compat.v1.GraphKeys
# Collections whose entries from every tower the step needs: variables to
# initialize and save, tables to initialize, queues to start, control-flow
# contexts a meta graph records. Every other collection is tower 0's.
_EVERY_TOWER = frozenset([
    _GraphKeys.GLOBAL_VARIABLES,
    _GraphKeys.LOCAL_VARIABLES,
    _GraphKeys.METRIC_VARIABLES,
    _GraphKeys.MODEL_VARIABLES,
    _GraphKeys.TRAINABLE_VARIABLES,
    _GraphKeys.TRAINABLE_RESOURCE_VARIABLES,
    _GraphKeys.MOVING_AVERAGE_VARIABLES,
    _GraphKeys.CONCATENATED_VARIABLES,
    _GraphKeys.TABLE_INITIALIZERS,
    _GraphKeys.QUEUE_RUNNERS,
    _GraphKeys.RESOURCES,
    _GraphKeys.LOCAL_RESOURCES,
    _GraphKeys.ASSET_FILEPATHS,
    _GraphKeys.SAVEABLE_OBJECTS,
    _GraphKeys.COND_CONTEXT,
    _GraphKeys.WHILE_CONTEXT,
])

_VARIABLE_KEYS = (_GraphKeys.GLOBAL_VARIABLES, _GraphKeys.LOCAL_VARIABLES)

_Collections = Dict[Any, List[Any]]
_Store = Tuple[Dict[str, Any], Dict[str, Any]]


def _copy_collections(collections: _Collections) -> _Collections:
  return {key: list(values) for key, values in collections.items()}


def _copy_store(store: _Store) -> _Store:
  return dict(store[0]), dict(store[1])


class GraphViews:
  """Per-tower views of one graph's collections, variable store and names.

  Args:
    graph: the graph the towers are built in.
    names_before: the graph's names in use before the model_fn's inputs were
      split (what one device's call finds taken).
  """

  def __init__(self, graph: tf.Graph, names_before: Dict[str, int]) -> None:
    self._graph = graph
    self._store = _tf.variable_store(graph)
    self._collections_before = _copy_collections(_tf.collections(graph))
    self._store_before = _copy_store(_tf.store_contents(self._store))
    self._names_before = names_before
    self._views: Dict[int, Tuple[_Collections, _Store]] = {}
    # id(variable) -> the collection keys its creation put it in.
    self._memberships: Dict[int, List[Any]] = {}
    self._created: List[Any] = []
    # In a tower that creates no variable: the created variables it has not
    # got back yet, by the op its reads take (handle or ref), and how far
    # its ops were looked through for such reads.
    self._unread: Dict[tf.Operation, Any] = {}
    self._looked = 0
    self._merged = False

  def enter(self, prefix: str, home: str, creating: bool) -> None:
    """A tower whose names start with `prefix` starts its call; tower 0's
    (one device's) start with `home`; `creating`: the first tower built."""
    _tf.set_collections(self._graph,
                        _copy_collections(self._collections_before))
    _tf.set_store_contents(self._store, _copy_store(self._store_before))
    self._unread = {} if creating else {
        variable.op: variable for variable in self._created
    }
    self._looked = self._graph.version
    prefix, home = prefix.lower(), home.lower()
    if prefix == home:
      return
    names = _tf.names_in_use(self._graph)
    for name, count in self._names_before.items():
      if name.startswith(home):
        own = prefix + name[len(home):]
        names[own] = max(names.get(own, 0), count)

  def leave(self, index: int) -> None:
    """Tower `index`'s call ended: its view is kept for `merge`."""
    self._views[index] = (_tf.collections(self._graph),
                          _tf.store_contents(self._store))

  def lengths(self) -> Dict[Any, int]:
    """The current view's collection lengths, for `record_created`."""
    return {
        key: len(values) for key, values in _tf.collections(self._graph).items()
    }

  def record_created(self, variable: Any, lengths: Dict[Any, int]) -> None:
    """Notes the collections `variable`'s creation put it in (those grown
    since `lengths` and holding it)."""
    keys = []
    for key, values in _tf.collections(self._graph).items():
      if len(values) > lengths.get(key, 0) and any(
          value is variable for value in values[lengths.get(key, 0):]):
        keys.append(key)
    self._memberships[id(variable)] = keys
    self._created.append(variable)

  def read(self, key: Any = None) -> None:
    """Before the call reads collection `key`: a shared variable the tower's
    ops read but never created (a Keras layer object called in every tower
    is built in the first) is the tower's own from its first read, as on
    one device, where that call built it. The global step an earlier tower
    created is the tower's when it looks for it (`get_or_create_global_step`
    finds it, as one device's call finds the one it created)."""
    if key == _GraphKeys.GLOBAL_STEP:
      for variable in list(self._unread.values()):
        if key in self._memberships.get(id(variable), ()):
          self.obtained(variable)
    if not self._unread or self._graph.version == self._looked:
      return
    ops = self._graph.get_operations()[self._looked:]
    self._looked = self._graph.version
    for op in ops:
      for tensor in op.inputs:
        variable = self._unread.get(tensor.op)
        if variable is not None:
          self.obtained(variable)

  def obtained(self, variable: Any) -> None:
    """A tower got a shared `variable` back: it joins the collections its
    creation put it in, in this tower's view, as if created here."""
    self.read()  # what the tower read before comes first
    self._unread.pop(variable.op, None)
    collections = _tf.collections(self._graph)
    for key in self._memberships.get(id(variable), ()):
      values = collections.setdefault(key, [])
      if not any(value is variable for value in values):
        values.append(variable)

  def share_imported(self) -> None:
    """Variables a call imported (a TF1 Hub module, `import_meta_graph`)
    are one device's: tower 0's.

    An imported variable is made from the graph's ops, not created through
    the towers' variable creator, so each tower has its own, named in its
    scope. In tower 0 (its view current), each other tower's reads and
    writes of its own are made reads and writes of tower 0's of the same
    name, and it leaves that tower's collections.
    """
    mine = self._imported(_tf.collections(self._graph), "")
    if not mine:
      return
    for index, (collections, _) in self._views.items():
      if index == 0:
        continue
      theirs = self._imported(collections, f"tower_{index}")
      shared = {id(theirs[name]): mine[name] for name in theirs if name in mine}
      if not shared:
        continue
      for variable in theirs.values():
        if id(variable) in shared:
          _tf.share_variable(variable, shared[id(variable)])
      for values in collections.values():
        values[:] = [value for value in values if id(value) not in shared]

  def _imported(self, collections: _Collections,
                segment: str) -> Dict[str, Any]:
    """Imported variables of a view by name without `segment`."""
    before = {
        id(value)
        for key in _VARIABLE_KEYS
        for value in self._collections_before.get(key, ())
    }
    found = {}
    for key in _VARIABLE_KEYS:
      for value in collections.get(key, ()):
        if (isinstance(value, tf.Variable) and
            id(value) not in self._memberships and id(value) not in before):
          found[_tf.without_segment(value.op.name, segment)] = value
    return found

  def unseen_variables(self) -> List[Any]:
    """Variables of the graph tower 0's call did not see: other towers' own,
    and what the library created after the towers (a model_fn's own
    `Scaffold(local_init_op=...)` built in tower 0 does not initialize
    them)."""
    seen = self._views.get(0, ({}, None))[0]
    known = {id(value) for key in _VARIABLE_KEYS for value in seen.get(key, ())}
    collections = _tf.collections(self._graph)
    return [
        value for key in _VARIABLE_KEYS for value in collections.get(key, ())
        if isinstance(value, tf.Variable) and id(value) not in known
    ]

  def merge(self) -> None:
    """After the towers: the graph's collections and store as one device's.

    Tower 0's view (or, if tower 0 was never built, the last tower's), with
    the entries of `_EVERY_TOWER` every other tower added.
    """
    if self._merged:
      return
    self._merged = True
    if not self._views:
      return
    order = sorted(self._views, key=lambda index: (index == 0, index))
    main = self._views[order[-1]]
    merged = _copy_collections(main[0])
    before = {
        key: {id(value) for value in values}
        for key, values in self._collections_before.items()
    }
    for index in order[:-1]:
      for key, values in self._views[index][0].items():
        if key not in _EVERY_TOWER:
          continue
        kept = merged.setdefault(key, [])
        present: Set[int] = {id(value) for value in kept}
        present |= before.get(key, set())
        for value in values:
          if id(value) not in present:
            kept.append(value)
            present.add(id(value))
    _tf.set_collections(self._graph, merged)
    variables: Dict[str, Any] = {}
    partitioned: Dict[str, Any] = {}
    for index in order:
      variables.update(self._views[index][1][0])
      partitioned.update(self._views[index][1][1])
    _tf.set_store_contents(self._store, (variables, partitioned))
