"""The audit's building-block walker: an abstract evaluation that finds every flow of client data to the server.

Every value is replaced by its aggregation level (the longest chain of client-to-server aggregations it depends
on), so a flow's pass and each call site's static count follow; what it cannot see through is an undecided place.
It reads TFF's building blocks through `tff.framework`'s public names; which intrinsics TFF defines, and which are
secure, only TFF's internals say (`tff_gma.tff_internals`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_gma import tff_internals
from tff_gma.audit.policy import KEYED_SELECT_INTRINSICS
from tff_gma.audit.report import DYNAMIC
from tff_gma.audit.report import json_default

# Name of the static parameter (second argument) of each secure-sum intrinsic.
_SECURE_PARAMETER_NAMES = {
    'federated_secure_sum': 'max_input',
    'federated_secure_sum_bitwidth': 'bitwidth',
    'federated_secure_modular_sum': 'modulus',
}
# Traced federated computations name their locals `fc_<python function>_symbol_<i>`.
_TRACED_LOCAL_NAME = re.compile(r'^fc_(?P<function>.+)_symbol_(?P<index>\d+)$')


# ---------------------------------------------------------------------------------------------------------------
# Abstract values of the evaluation.


@dataclasses.dataclass(frozen=True)
class _Const:
  """A constant the building block fixes (a literal, or a parameterless TF computation returning a `Const`)."""

  value: Any


@dataclasses.dataclass(frozen=True)
class _Data:
  """A non-function value: the longest chain of aggregations it depends on, and its value if constant.

  `sources` are the indices of the flow sites whose results reach this value directly, i.e. through no later
  client-to-server flow (a flow's result has its own site only); they say which flow feeds which output.
  """

  level: int
  const: Optional[_Const] = None
  sources: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class StructValue:
  elements: tuple[tuple[Optional[str], '_Value'], ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Closure:
  function: tff.framework.Lambda
  env: 'Env'


@dataclasses.dataclass(frozen=True, eq=False)
class _IntrinsicFunction:
  intrinsic: tff.framework.Intrinsic


@dataclasses.dataclass(frozen=True, eq=False)
class _OpaqueFunction:
  """A function the audit cannot see into: a TensorFlow computation, a `Data` block, an unbound reference, or a
  function the computation takes as (part of) its parameter. `what` names it in an undecided place's reason."""

  type_signature: tff.Type
  what: str
  block: Optional[tff.framework.ComputationBuildingBlock] = None


_Value = Union[_Data, StructValue, Closure, _IntrinsicFunction, _OpaqueFunction]
FUNCTIONS = (Closure, _IntrinsicFunction, _OpaqueFunction)  # The abstract values that are functions.
LEVEL_0 = _Data(0)


@dataclasses.dataclass(frozen=True)
class UndecidedPlace:
  """A place whose effect the walk cannot see: `where` (as a flow's) and, in words, why."""

  where: str
  reason: str


class Env:
  """Lexical scope: reference name -> abstract value."""

  def __init__(self, parent: Optional['Env'] = None):
    self._parent = parent
    self._values: dict[str, _Value] = {}
    self._version = 0  # Bumped by each `bind`: a memoized call is replayed only in the scope it was made in.

  def bind(self, name: str, value: _Value) -> None:
    self._values[name] = value
    self._version += 1

  def state(self) -> tuple[Any, ...]:
    """What a lookup in this scope depends on: each scope of the chain, as it stands now."""
    states = []
    env = self
    while env is not None:
      states.append((id(env), env._version))  # pylint: disable=protected-access
      env = env._parent  # pylint: disable=protected-access
    return tuple(states)

  def lookup(self, name: str) -> Optional[_Value]:
    env = self
    while env is not None:
      if name in env._values:  # pylint: disable=protected-access
        return env._values[name]  # pylint: disable=protected-access
      env = env._parent  # pylint: disable=protected-access
    return None


def _level(value: _Value) -> int:
  """Largest aggregation level in a value (functions count through what they close over only when called)."""
  if isinstance(value, _Data):
    return value.level
  if isinstance(value, StructValue):
    return max((_level(v) for _, v in value.elements), default=0)
  return 0


def sources_of(value: _Value) -> frozenset[int]:
  """The flow sites that reach a value directly (see `_Data.sources`)."""
  if isinstance(value, _Data):
    return value.sources
  if isinstance(value, StructValue):
    return frozenset().union(*(sources_of(v) for _, v in value.elements))
  return frozenset()


def _join(values: Iterable[_Value], extra: int = 0, site: Optional[int] = None) -> _Data:
  """One value depending on all of `values`; `site`: the result of that flow site (its level one higher)."""
  values = list(values)
  sources = frozenset([site]) if site is not None else frozenset().union(*(sources_of(v) for v in values))
  return _Data(max((_level(v) for v in values), default=0) + extra, sources=sources)


# ---------------------------------------------------------------------------------------------------------------
# Types.


def contains_placement(type_spec: tff.Type, placement) -> bool:
  """Whether a value of `type_spec` holds data at `placement` (functions are not data and are not looked into)."""
  if isinstance(type_spec, tff.FederatedType):
    return type_spec.placement is placement
  if isinstance(type_spec, tff.StructType):
    return any(contains_placement(t, placement) for _, t in tff.structure.iter_elements(type_spec))
  return False


def mentions_placement(type_spec: tff.Type) -> bool:
  """Whether a type holds a federated type anywhere, inside function types too."""
  if isinstance(type_spec, tff.FederatedType):
    return True
  if isinstance(type_spec, tff.StructType):
    return any(mentions_placement(t) for _, t in tff.structure.iter_elements(type_spec))
  if isinstance(type_spec, tff.FunctionType):
    return ((type_spec.parameter is not None and mentions_placement(type_spec.parameter))
            or mentions_placement(type_spec.result))
  if isinstance(type_spec, tff.SequenceType):
    return mentions_placement(type_spec.element)
  return False


def placed_function_types(type_spec: tff.Type) -> list[tff.FunctionType]:
  """The function types in a value's type that mention a placement: functions whose type does not rule out a flow
  (a function from CLIENTS to CLIENTS can sum at the server and broadcast back)."""
  if isinstance(type_spec, tff.FunctionType):
    return [type_spec] if mentions_placement(type_spec) else []
  if isinstance(type_spec, tff.StructType):
    return [f for _, t in tff.structure.iter_elements(type_spec) for f in placed_function_types(t)]
  return []


def _holds_function(type_spec: tff.Type) -> bool:
  if isinstance(type_spec, tff.FunctionType):
    return True
  return isinstance(type_spec, tff.StructType) and any(
      _holds_function(t) for _, t in tff.structure.iter_elements(type_spec))


def typed_value(type_spec: tff.Type, data: _Data, label: str) -> _Value:
  """A value of `type_spec` for a parameter: its functions opaque (named from `label`), the rest `data`."""
  if isinstance(type_spec, tff.FunctionType):
    return _OpaqueFunction(type_spec, f'the functional parameter `{label}`')
  if isinstance(type_spec, tff.StructType) and _holds_function(type_spec):
    return StructValue(tuple(
        (name, typed_value(element, data, f'{label}.{name}' if name else f'{label}[{i}]'))
        for i, (name, element) in enumerate(tff.structure.iter_elements(type_spec))))
  return data


def _function_type(value: _Value) -> Optional[tff.Type]:
  if isinstance(value, Closure):
    return value.function.type_signature
  if isinstance(value, _IntrinsicFunction):
    return value.intrinsic.type_signature
  if isinstance(value, _OpaqueFunction):
    return value.type_signature
  return None


def _functions_in(value: Optional[_Value]) -> list[_Value]:
  """The function values in a (possibly structured) value."""
  if isinstance(value, FUNCTIONS):
    return [value]
  if isinstance(value, StructValue):
    return [f for _, v in value.elements for f in _functions_in(v)]
  return []


def _is_client_to_server(function_type: tff.Type) -> bool:
  return (isinstance(function_type, tff.FunctionType) and function_type.parameter is not None
          and contains_placement(function_type.parameter, tff.CLIENTS)
          and contains_placement(function_type.result, tff.SERVER))


def _carries_data(function_type: tff.FunctionType) -> bool:
  """Whether the client-placed argument holds any tensor: aggregating `<>` (TFF's null aggregations) moves nothing."""
  return tff.types.contains(_client_part_type(function_type.parameter), lambda t: isinstance(t, tff.TensorType))


def _client_part_type(parameter_type: tff.Type) -> tff.Type:
  """The client-placed part of an intrinsic's parameter: the element itself, or the struct's first such element."""
  if isinstance(parameter_type, tff.StructType):
    for _, element in tff.structure.iter_elements(parameter_type):
      if contains_placement(element, tff.CLIENTS):
        return element
  return parameter_type


# ---------------------------------------------------------------------------------------------------------------
# Constants.


def _literal_const(block: tff.framework.Literal) -> _Const:
  return _Const(np.asarray(block.value).tolist())


def _compiled_const(block: tff.framework.CompiledComputation) -> Optional[_Const]:
  """Value of a parameterless TensorFlow computation whose outputs are `Const` ops, else `None`."""
  proto = block.proto
  if proto.WhichOneof('computation') != 'tensorflow' or block.type_signature.parameter is not None:
    return None
  graph_def = tf.compat.v1.GraphDef()
  try:
    unpacked = proto.tensorflow.graph_def.Unpack(graph_def)
  except Exception:  # pylint: disable=broad-except
    unpacked = False
  if not unpacked:
    return None  # Not a graph we can read: the value is reported as dynamic.
  nodes = {node.name: node for node in graph_def.node}

  def const_of(tensor_name: str) -> Optional[Any]:
    name = tensor_name.split(':')[0]
    for _ in range(len(nodes)):
      node = nodes.get(name)
      if node is None:
        return None
      if node.op == 'Const':
        return tf.make_ndarray(node.attr['value'].tensor).tolist()
      if node.op not in ('Identity', 'IdentityN') or not node.input:
        return None
      name = node.input[0].split(':')[0].lstrip('^')
    return None

  def binding_value(binding) -> Optional[Any]:
    kind = binding.WhichOneof('binding')
    if kind == 'tensor':
      return const_of(binding.tensor.tensor_name)
    if kind == 'struct':
      values = [binding_value(b) for b in binding.struct.element]
      return None if any(v is None for v in values) else values
    return None

  value = binding_value(proto.tensorflow.result)
  return None if value is None else _Const(value)


def _const_of(value: _Value) -> Any:
  """A constant's plain value, or `DYNAMIC`."""
  if isinstance(value, _Data):
    return value.const.value if value.const is not None else DYNAMIC
  if isinstance(value, StructValue):
    parts = [_const_of(v) for _, v in value.elements]
    return DYNAMIC if any(p == DYNAMIC for p in parts) else parts
  return DYNAMIC


# ---------------------------------------------------------------------------------------------------------------
# Memoizing calls.


class AnalysisTimeout(Exception):
  """The walk ran past its deadline (`Evaluator`'s `deadline`)."""


# How many evaluation steps the walk takes between two looks at the clock.
_STEPS_PER_CLOCK_CHECK = 1024


def value_key(value: Optional[_Value]) -> Any:
  """A hashable key that is equal for two abstract values only when the walk treats them alike.

  Functions are keyed by identity (the memo keeps the values it keys alive, so an id is never reused meanwhile).
  """
  if value is None:
    return None
  if isinstance(value, _Data):
    const = None if value.const is None else json.dumps(value.const.value, default=json_default, sort_keys=True)
    return ('data', value.level, const, tuple(sorted(value.sources)))
  if isinstance(value, StructValue):
    return ('struct', tuple((name, value_key(v)) for name, v in value.elements))
  if isinstance(value, Closure):
    return ('closure', id(value.function), value.env.state())
  if isinstance(value, _IntrinsicFunction):
    return ('intrinsic', id(value.intrinsic))
  return ('function', id(value))


@dataclasses.dataclass
class _Run:
  """What one call of a closure did to the evaluator, to replay it: the runs it added to each site (by site key).

  Its other effects need no replay: reached calls and undecided places are sets, and a replay in the same place
  adds no new site (a site's key is its call node, path, pass and parameters, all the same there)."""

  counts: dict[tuple[Any, ...], int] = dataclasses.field(default_factory=dict)

  def add(self, key: tuple[Any, ...], runs: int) -> None:
    self.counts[key] = self.counts.get(key, 0) + runs


# ---------------------------------------------------------------------------------------------------------------
# The evaluation.


@dataclasses.dataclass
class Site:
  """What the evaluation found at one intrinsic call site (a `Call` node and the path that reached it)."""

  intrinsic: str
  value_type: str
  secure: bool
  parameters: dict[str, Any]
  aggregation_pass: int
  where: str
  count: int = 0
  index: int = -1  # Its position among the evaluation's sites (the id in `_Data.sources`).
  top_local: Optional[str] = None  # The local of the computation's top-level block it sits in, if any.


def _format_local(name: str) -> str:
  match = _TRACED_LOCAL_NAME.match(name)
  return f'{match["function"]}[{match["index"]}]' if match else name


class Evaluator:
  """Evaluates a building block over `_Value`s, recording each client-to-server call."""

  def __init__(self, root_name: str, top_block: Optional[tff.framework.Block] = None,
               deadline: Optional[float] = None):
    """`deadline`: a `time.monotonic()` time past which the walk raises `AnalysisTimeout`."""
    self._path: list[str] = [root_name]
    self._sites: dict[tuple[Any, ...], Site] = {}
    self.reached_calls: set[int] = set()
    # The computation's top-level block (the body of the lambda it is): which of its locals a site sits in, and
    # the scope its locals end up in (see `tff_gma.audit.components`).
    self._top_block = top_block
    self._top_local: Optional[str] = None
    self.top_scope: Optional[Env] = None
    self._undecided: dict[tuple[str, str], UndecidedPlace] = {}
    # A lambda called twice in the same place with the same argument does the same again: its first run is kept
    # and replayed (its site counts added again), so that a chain of lambdas each calling the one before twice
    # costs one run per level, not 2**levels. Counts are added as numbers: they may still be 2**levels.
    self._memo: dict[tuple[Any, ...], tuple[_Value, _Run, tuple[Any, ...]]] = {}
    self._runs: list[_Run] = []  # The calls being recorded, innermost last.
    self._deadline = deadline
    self._steps = 0

  @property
  def sites(self) -> list[Site]:
    return list(self._sites.values())

  @property
  def undecided(self) -> list[UndecidedPlace]:
    """The places the walk could not see through, in the order it met them."""
    return list(self._undecided.values())

  def undecide(self, reason: str) -> None:
    """Records that what happens here cannot be decided (once per place and reason)."""
    where = ' > '.join(self._path)
    self._undecided.setdefault((where, reason), UndecidedPlace(where, reason))

  def _tick(self) -> None:
    """Counts one step of the walk; past the deadline, stops it."""
    self._steps += 1
    if (self._deadline is not None and self._steps % _STEPS_PER_CLOCK_CHECK == 0
        and time.monotonic() > self._deadline):
      raise AnalysisTimeout(f'the walk did not finish by its deadline ({self._steps} steps taken)')

  def evaluate(self, block: tff.framework.ComputationBuildingBlock, env: Env) -> _Value:
    self._tick()
    if isinstance(block, tff.framework.Reference):
      value = env.lookup(block.name)
      if value is not None:
        return value
      if isinstance(block.type_signature, tff.FunctionType):
        return _OpaqueFunction(block.type_signature, f'the unbound name `{block.name}`', block)
      return LEVEL_0
    if isinstance(block, tff.framework.Selection):
      source = self.evaluate(block.source, env)
      if isinstance(source, StructValue):
        return source.elements[block.as_index()][1]
      return source
    if isinstance(block, tff.framework.Struct):
      return StructValue(
          tuple((name, self.evaluate(element, env)) for name, element in tff.structure.iter_elements(block)))
    if isinstance(block, tff.framework.Lambda):
      return Closure(block, env)
    if isinstance(block, tff.framework.Block):
      scope = Env(env)
      top = block is self._top_block and self.top_scope is None
      if top:
        self.top_scope = scope
      for name, local in block.locals:
        self._path.append(_format_local(name))
        if top:
          self._top_local = name
        try:
          scope.bind(name, self.evaluate(local, scope))
        finally:
          self._path.pop()
          if top:
            self._top_local = None
      return self.evaluate(block.result, scope)
    if isinstance(block, tff.framework.Call):
      function = self.evaluate(block.function, env)
      argument = None if block.argument is None else self.evaluate(block.argument, env)
      return self.call(function, argument, block)
    if isinstance(block, tff.framework.Intrinsic):
      return _IntrinsicFunction(block)
    if isinstance(block, tff.framework.CompiledComputation):
      return _OpaqueFunction(block.type_signature, 'a TensorFlow computation', block)
    if isinstance(block, tff.framework.Literal):
      return _Data(0, _literal_const(block))
    if isinstance(block, tff.framework.Data):
      if isinstance(block.type_signature, tff.FunctionType):
        return _OpaqueFunction(block.type_signature, 'a `Data` block', block)
      return LEVEL_0
    if isinstance(block, tff.framework.Placement):
      return LEVEL_0
    raise TypeError(f'unsupported building block {type(block).__name__}: {block.compact_representation()}')

  def call(self, function: _Value, argument: Optional[_Value], call: Optional[tff.framework.Call]) -> _Value:
    """Applies an abstract function; `call` is the `Call` node when there is one (it identifies the site)."""
    if isinstance(function, Closure):
      return self._call_closure(function, argument)
    if isinstance(function, _IntrinsicFunction):
      if call is None and mentions_placement(function.intrinsic.type_signature):
        # Not at a `Call` of its own (e.g. handed to another function): the walk has no call site to count.
        self.undecide(f'the intrinsic `{function.intrinsic.uri}` is called as a value passed along, where the walk '
                      'cannot place its call')
      return self._call_intrinsic(function.intrinsic, argument, call)
    if isinstance(function, _OpaqueFunction):
      return self._call_opaque(function, argument)
    # A data value in call position: the walk has lost track of what is called.
    self.undecide('calls a value the walk cannot resolve to a function')
    return _join([function] + ([argument] if argument is not None else []))

  def _call_closure(self, function: Closure, argument: Optional[_Value]) -> _Value:
    """Runs a closure's body, or replays its earlier run in the same place with the same argument."""
    key = (id(function.function), function.env.state(), value_key(argument), tuple(self._path), self._top_local)
    memoized = self._memo.get(key)
    if memoized is not None:
      result, run, _ = memoized
      for site_key, runs in run.counts.items():
        self._add_runs(site_key, runs)
      return result
    run = _Run()
    self._runs.append(run)
    try:
      result = self._run_closure(function, argument)
    finally:
      self._runs.pop()
    if self._runs:  # The enclosing call's run includes this one's.
      for site_key, runs in run.counts.items():
        self._runs[-1].add(site_key, runs)
    self._memo[key] = (result, run, (function, argument))  # The values keyed by identity, kept alive.
    return result

  def _add_runs(self, site_key: tuple[Any, ...], runs: int) -> None:
    self._sites[site_key].count += runs
    if self._runs:
      self._runs[-1].add(site_key, runs)

  def _run_closure(self, function: Closure, argument: Optional[_Value]) -> _Value:
    scope = Env(function.env)
    name = function.function.parameter_name
    if name is not None:
      argument = argument if argument is not None else LEVEL_0
      if isinstance(argument, _Data):  # Data standing for a whole parameter: give its functions a name.
        argument = typed_value(function.function.parameter_type, argument, name)
      scope.bind(name, argument)
    return self.evaluate(function.function.result, scope)

  def _call_opaque(self, function: _OpaqueFunction, argument: Optional[_Value]) -> _Value:
    """A call into what the walk cannot see: undecided unless its type rules out a flow."""
    if argument is None and isinstance(function.block, tff.framework.CompiledComputation):
      return _Data(0, _compiled_const(function.block))
    if mentions_placement(function.type_signature):
      self.undecide(f'calls {function.what} of type `{function.type_signature}`, which the audit cannot see into; '
                    'its type does not rule out a flow of client data to the server')
    for passed in _functions_in(argument):
      passed_type = _function_type(passed)
      if mentions_placement(passed_type):
        self.undecide(f'passes a function of type `{passed_type}` to {function.what}, which the audit cannot see '
                      'into; what it does with the function, the audit cannot know')
    return _join([argument] if argument is not None else [])

  def _call_intrinsic(self, intrinsic: tff.framework.Intrinsic, argument: Optional[_Value],
                      call: Optional[tff.framework.Call]) -> _Value:
    uri = intrinsic.uri
    arguments = list(argument.elements) if isinstance(argument, StructValue) else [(None, argument)]
    values = [v for _, v in arguments if v is not None]
    data = [v for v in values if not isinstance(v, FUNCTIONS)]
    functions = [v for v in values if isinstance(v, FUNCTIONS)]
    for function in functions:  # TFF's own intrinsics take functions over unplaced values only.
      if mentions_placement(_function_type(function)):
        self.undecide(f'passes a function of type `{_function_type(function)}` to `{uri}`, which the walk cannot '
                      'follow')

    if uri in ('federated_broadcast', 'federated_value_at_clients', 'federated_value_at_server'):
      return argument  # Moves or places a value: same dependencies.
    if uri in ('federated_zip_at_clients', 'federated_zip_at_server'):
      return argument  # Struct of federated values -> federated struct: same structure, same dependencies.
    if uri in ('federated_apply', 'federated_map', 'federated_map_all_equal', 'sequence_map') and len(values) == 2:
      return self.call(values[0], values[1], None)
    if uri in ('federated_eval_at_clients', 'federated_eval_at_server') and len(values) == 1:
      return self.call(values[0], None, None)

    # Generic intrinsic: its functions see (and its result depends on) all of its data arguments.
    data_level = _join(data)
    results = [self.call(f, data_level, None) for f in functions]
    inputs = data + results
    intrinsic_type = intrinsic.type_signature
    if (call is not None and (uri in KEYED_SELECT_INTRINSICS or _is_client_to_server(intrinsic_type))
        and _carries_data(intrinsic_type)):
      parameters = {}
      if uri in _SECURE_PARAMETER_NAMES and len(values) == 2:
        parameters[_SECURE_PARAMETER_NAMES[uri]] = _const_of(values[1])
      site = self._record(call, uri, _client_part_type(intrinsic_type.parameter), secure=_is_secure(intrinsic),
                          parameters=parameters, inputs=inputs)
      return _join(inputs, extra=1, site=site)
    if not tff_internals.is_known_intrinsic(uri) and mentions_placement(intrinsic_type):
      # Not a flow by its type, but the walk does not know what it does with the federated values it touches.
      self.undecide(f'calls the intrinsic `{uri}` of type `{intrinsic_type}`, which the audit does not know')
    return _join(inputs)

  def _record(self, call: tff.framework.Call, uri: str, value_type: tff.Type, secure: bool,
              parameters: dict[str, Any], inputs: Sequence[Optional[_Value]]) -> int:
    """Counts one run of a flow site; returns the site's index."""
    self.reached_calls.add(id(call))
    aggregation_pass = _join([v for v in inputs if v is not None]).level + 1
    where = ' > '.join(self._path)
    key = (id(call), where, aggregation_pass, json.dumps(parameters, default=json_default, sort_keys=True))
    site = self._sites.get(key)
    if site is None:
      site = Site(uri, str(value_type), secure, parameters, aggregation_pass, where, index=len(self._sites),
                  top_local=self._top_local)
      self._sites[key] = site
    self._add_runs(key, 1)
    return site.index


def _is_secure(intrinsic: tff.framework.Intrinsic) -> bool:
  return tff_internals.is_secure_intrinsic(intrinsic.uri)


def unreached_sites(root: tff.framework.ComputationBuildingBlock, reached: set[int], root_name: str,
                    top_block: Optional[tff.framework.Block] = None) -> list[Site]:
  """Client-to-server intrinsic calls in the tree that the evaluation never reached (count 0)."""
  sites = []

  def visit(block, path, top_local):
    if (isinstance(block, tff.framework.Call) and isinstance(block.function, tff.framework.Intrinsic)
        and id(block) not in reached):
      intrinsic = block.function
      if ((intrinsic.uri in KEYED_SELECT_INTRINSICS or _is_client_to_server(intrinsic.type_signature))
          and _carries_data(intrinsic.type_signature)):
        sites.append(Site(intrinsic.uri, str(_client_part_type(intrinsic.type_signature.parameter)),
                          _is_secure(intrinsic), {}, 0, ' > '.join(path), count=0, top_local=top_local))
    if isinstance(block, tff.framework.Block):
      for name, local in block.locals:
        visit(local, path + [_format_local(name)], name if block is top_block else top_local)
      visit(block.result, path, top_local)
    else:
      for child in block.children():
        visit(child, path, top_local)

  visit(root, [root_name], None)
  return sites
