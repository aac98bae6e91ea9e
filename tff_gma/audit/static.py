"""Static privacy audit of TFF computations: where client data reaches the server, and how.

`audit_computation` walks a computation's building blocks (the compiled form TFF executes, not the Python that
built it) and lists every *flow*: a call to an intrinsic whose argument holds a `tff.CLIENTS`-placed value and
whose result holds a `tff.SERVER`-placed one (`federated_sum`, `federated_mean`, `federated_aggregate`, the
secure-sum family, ... and any intrinsic with that signature, known or not), plus the two `federated_select`
intrinsics, which move the clients' *keys* to the server. Each flow is checked against an `AuditPolicy`; by
default only the means and the secure sums may carry client data to the server.

How the walk works. The building block is evaluated abstractly: every value is replaced by its *aggregation
level*, the length of the longest chain of client-to-server aggregations it depends on (0 for the parameters and
constants). Structures keep one level per element and functions are closures, so selecting the untouched part
of a zipped state does not inherit the level of an aggregate next to it. Calls to lambdas are inlined (a lambda
called twice runs, and is counted, twice); block locals are evaluated once, in order, as TFF's runtime does. A
flow's *pass* is one more than the largest level among its inputs: an aggregate whose input was computed at the
clients from a broadcast of an earlier aggregate is in a later pass; independent aggregates share a pass. The
number of passes of a computation (`aggregation_passes`) is the largest pass of its flows: the number of
sequential client-server round trips one call needs. (TFF's `transformations.to_call_dominant` would inline in
the same way, but it renames every local, losing the traced function names that `Flow.where` shows.)

Counts are static: `Flow.count` is the number of times the call site is reached by this evaluation per call of
the computation, with lambdas inlined; there is no data-dependent control flow in TFF's federated language, so
this is what the runtime executes. Secure-sum parameters (`bitwidth`, `max_input`, `modulus`) are read from the
building block when they are constants (a literal, or a TensorFlow computation without parameter whose output is a
`Const` op) and reported as `'dynamic'` otherwise (e.g. bounds taken from the aggregator's state). Intrinsic calls
that the evaluation never reaches (inside a function that is never called, or handed to an opaque call) are still
listed, with count 0, so that nothing is hidden. Aggregations of values holding no tensor (TFF's null aggregations
of `<>`) move nothing and are not listed. A select counts as a round trip like an aggregation (the keys go up, the
selected values come back).

Components. For the `next` of a learning process composed by `tff.learning.templates.compose_learning_process`
(TFF's builders and this library's use it), each flow is named by the part of the round it sits in
(`Flow.component`): the distributor, the client work, the metrics aggregator, the model aggregator or the
finalizer. The composer calls each of its four processes once, in a local of its top-level block, and builds
its state and metrics from their outputs under the fields `distributor`, `client_work`, `aggregator`,
`finalizer`; the audit reads which local each field comes from, and a flow takes the component of the local it
sits in. TFF's metrics aggregator runs inside the client work: a client-work flow is the metrics aggregator's
when its result reaches the client work's measurements `train` (TFF's training client works) or `eval`
(`build_fed_eval`) directly, through no later flow (the evaluation tracks, per value, the flows it comes from).
Any other computation, or a `next` built differently, has no components (`None`); its flows keep their `where`.

What it does not see: what the TensorFlow inside `federated_map` computes (an aggregate of an encoding of the raw
data is still an aggregate, and is reported as such), and the runtime's deployment (whether `federated_mean` is
computed by a trusted aggregator is outside the building block; the default policy trusts it, as the issue asks).
So a PASS says which intrinsics carry client data, not how much an aggregate reveals: a `federated_mean` of vectors
in which each client writes its value into its own coordinate passes, and hands the server every client's value.
Every report states this scope in a fixed paragraph, `AUDIT_SCOPE`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np
import tensorflow_federated as tff
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.impl.compiler import building_blocks
from tensorflow_federated.python.core.impl.compiler import intrinsic_defs
from tensorflow_federated.python.core.impl.types import type_analysis
from tensorflow_federated.python.tensorflow_libs import serialization_utils

# Intrinsics through which client data may reach the server under the default policy.
SECURE_SUM_INTRINSICS = frozenset({
    'federated_secure_sum',
    'federated_secure_sum_bitwidth',
    'federated_secure_modular_sum',
})
MEAN_INTRINSICS = frozenset({'federated_mean', 'federated_weighted_mean'})
PLAIN_SUM_INTRINSICS = frozenset({'federated_sum'})
DEFAULT_ALLOWED_INTRINSICS = MEAN_INTRINSICS | SECURE_SUM_INTRINSICS
# `federated_select` / `federated_secure_select` send values to the clients, but picked by client-held keys: the
# keys are client data the server (or, for the secure variant, the selection protocol) gets to act on.
KEYED_SELECT_INTRINSICS = frozenset({'federated_select', 'federated_secure_select'})
# Name of the static parameter (second argument) of each secure-sum intrinsic.
_SECURE_PARAMETER_NAMES = {
    'federated_secure_sum': 'max_input',
    'federated_secure_sum_bitwidth': 'bitwidth',
    'federated_secure_modular_sum': 'modulus',
}
DYNAMIC = 'dynamic'
# The components of a learning process composed by `tff.learning.templates.compose_learning_process` (which TFF's
# builders and this library's use), as the report names them. The metrics aggregator (TFF's `metrics_aggregator`
# argument) runs inside the client work; the audit tells its flows apart by where their results go (`_components`).
DISTRIBUTOR = 'distributor'
CLIENT_WORK = 'client work'
METRICS_AGGREGATOR = 'metrics aggregator'
MODEL_AGGREGATOR = 'model aggregator'
FINALIZER = 'finalizer'
COMPONENTS = (DISTRIBUTOR, CLIENT_WORK, METRICS_AGGREGATOR, MODEL_AGGREGATOR, FINALIZER)
# The fields of the composer's state and metrics naming the four processes, and the component each names.
COMPOSER_FIELDS = ('distributor', 'client_work', 'aggregator', 'finalizer')
_COMPONENT_OF_FIELD = {
    'distributor': DISTRIBUTOR, 'client_work': CLIENT_WORK, 'aggregator': MODEL_AGGREGATOR, 'finalizer': FINALIZER}
STATE_MODEL_FIELD = 'global_model_weights'  # Only the state (`LearningAlgorithmState`) has it.
# The client work's measurements holding the metrics aggregator's output: `train` in TFF's training client works
# (and this library's), `eval` in `tff.learning.algorithms.build_fed_eval`.
METRICS_MEASUREMENTS = ('train', 'eval')
# Traced federated computations name their locals `fc_<python function>_symbol_<i>`.
_TRACED_LOCAL_NAME = re.compile(r'^fc_(?P<function>.+)_symbol_(?P<index>\d+)$')
_MIN_RECURSION_LIMIT = 20000

# What a verdict establishes and what it does not; every report carries it (markdown: the Scope paragraph; JSON:
# `scope`).
AUDIT_SCOPE = (
    'A PASS establishes two things, read from the computation\'s building blocks: every flow of client-placed data '
    'to the server goes through an intrinsic the policy allows, and one call needs the reported number of '
    'sequential client-to-server aggregation passes. It does not establish that an allowed aggregate reveals '
    'little about any one client: a computation in which each client writes its value into its own coordinate of '
    'a `federated_mean` (zeros elsewhere) passes, and the server reads every client\'s value off the mean. Nor '
    'does it establish differential privacy (no noise, clipping or privacy budget is checked), anything about the '
    'client-side code (the TensorFlow inside `federated_map` is not inspected, nor what clients do outside the '
    'computation), or anything about the runtime and transport (that the deployed aggregator or secure-sum '
    'protocol keeps individual values hidden, who sees the messages in transit).')


@dataclasses.dataclass(frozen=True)
class AuditPolicy:
  """Which intrinsics may carry client data to the server.

  Attributes:
    allowed_intrinsics: intrinsic URIs allowed to move client data to the server. Defaults to the means and the
      secure-sum family.
    allow_plain_sum: also allow `federated_sum` (a plain, non-secure sum of client values).
  """

  allowed_intrinsics: frozenset[str] = DEFAULT_ALLOWED_INTRINSICS
  allow_plain_sum: bool = False

  def __post_init__(self):
    if isinstance(self.allowed_intrinsics, str):
      raise ValueError('allowed_intrinsics must be a collection of intrinsic URIs, not a single string; got '
                       f'{self.allowed_intrinsics!r}')
    object.__setattr__(self, 'allowed_intrinsics', frozenset(self.allowed_intrinsics))

  @property
  def allowed(self) -> frozenset[str]:
    """Every intrinsic URI this policy allows to carry client data to the server."""
    return self.allowed_intrinsics | (PLAIN_SUM_INTRINSICS if self.allow_plain_sum else frozenset())

  def allows(self, intrinsic: str) -> bool:
    return intrinsic in self.allowed

  def describe(self) -> str:
    return 'client data may reach the server only through: ' + ', '.join(f'`{u}`' for u in sorted(self.allowed))


DEFAULT_POLICY = AuditPolicy()


@dataclasses.dataclass(frozen=True)
class Flow:
  """One place where client-placed data moves to the server.

  Attributes:
    computation: the audited computation it belongs to (`'next'`, `'initialize'`, or the computation's name).
    intrinsic: the intrinsic's URI, e.g. `'federated_secure_sum_bitwidth'`.
    value_type: TFF type of the client value it moves (for the selects: of the client keys).
    secure: whether TFF marks the intrinsic as a secure aggregation (or secure select).
    parameters: the secure intrinsic's static parameter (`bitwidth`, `max_input` or `modulus`) as a number or a
      nested list, or `'dynamic'` when it is not a constant of the building block; empty for other intrinsics.
    count: how many times the call site runs per call of the computation (static; 0 if never reached).
    aggregation_pass: the sequential client-to-server round (1-based) it belongs to; `None` if never reached.
    where: path of block locals (`function[i]`, from the traced function names) leading to the call site.
    allowed: whether the policy allows it.
    component: for the `next` of a learning process composed by `tff.learning.templates.compose_learning_process`
      (TFF's builders, this library's), the part of the round the flow sits in, in words: `'distributor'`,
      `'client work'`, `'metrics aggregator'` (TFF's `metrics_aggregator`, which runs inside the client work),
      `'model aggregator'` or `'finalizer'` (`COMPONENTS`); `None` for other computations.
  """

  computation: str
  intrinsic: str
  value_type: str
  secure: bool
  parameters: Mapping[str, Any]
  count: int
  aggregation_pass: Optional[int]
  where: str
  allowed: bool
  component: Optional[str] = None

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self) | {'parameters': dict(self.parameters)}


@dataclasses.dataclass(frozen=True)
class Violation:
  """A flow the policy does not allow (`component`: as `Flow.component`)."""

  computation: str
  intrinsic: str
  where: str
  count: int
  reason: str
  component: Optional[str] = None

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ComputationAudit:
  """Audit of one computation (e.g. a process's `next`)."""

  name: str
  type_signature: str
  flows: tuple[Flow, ...]
  aggregation_passes: int
  notes: tuple[str, ...]

  def to_dict(self) -> dict[str, Any]:
    return {
        'name': self.name,
        'type_signature': self.type_signature,
        'aggregation_passes': self.aggregation_passes,
        'flows': [f.to_dict() for f in self.flows],
        'notes': list(self.notes),
    }


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """Result of `audit_computation`.

  Attributes:
    subject: what was audited, in words.
    policy: the policy applied.
    computations: one audit per computation (for processes: `initialize` and `next`).
    main: name of the computation whose pass count is `aggregation_passes` (`'next'` for processes).
  """

  subject: str
  policy: AuditPolicy
  computations: tuple[ComputationAudit, ...]
  main: str

  @property
  def flows(self) -> list[Flow]:
    """Every client-to-server flow of every audited computation."""
    return [f for c in self.computations for f in c.flows]

  @property
  def violations(self) -> list[Violation]:
    return [
        Violation(
            computation=f.computation,
            intrinsic=f.intrinsic,
            where=f.where,
            count=f.count,
            reason=_violation_reason(f, self.policy),
            component=f.component,
        ) for f in self.flows if not f.allowed
    ]

  @property
  def ok(self) -> bool:
    return not self.violations

  @property
  def aggregation_passes(self) -> int:
    """Sequential client-to-server rounds per call of the main computation."""
    return self.computation(self.main).aggregation_passes

  @property
  def notes(self) -> list[str]:
    return [f'`{c.name}`: {n}' for c in self.computations for n in c.notes]

  def computation(self, name: str) -> ComputationAudit:
    for c in self.computations:
      if c.name == name:
        return c
    raise KeyError(f'no audited computation named {name!r}; have {[c.name for c in self.computations]}')

  def _summary_table(self) -> list[str]:
    """One row per (computation, [component,] intrinsic, secure, allowed): call sites, runs per call, passes."""
    with_components = any(f.component for f in self.flows)
    rows = collections.OrderedDict()
    for f in self.flows:
      key = (f.computation, f.component, f.intrinsic, f.secure, f.allowed)
      sites, runs, passes = rows.get(key, (0, 0, set()))
      rows[key] = (sites + 1, runs + f.count, passes | ({f.aggregation_pass} if f.aggregation_pass else set()))
    component_header, component_rule = ('component | ', '---|') if with_components else ('', '')
    lines = [
        f'| computation | {component_header}intrinsic | secure | call sites | runs/call | passes | allowed |',
        f'|---|{component_rule}---|---|---:|---:|---|---|',
    ]
    for (computation, component, intrinsic, secure, allowed), (sites, runs, passes) in rows.items():
      component_cell = f'{component or "-"} | ' if with_components else ''
      lines.append(f'| `{computation}` | {component_cell}`{intrinsic}` | {"yes" if secure else "no"} | {sites} '
                   f'| {runs} | {", ".join(map(str, sorted(passes))) or "-"} | {"yes" if allowed else "**NO**"} |')
    lines.append('')
    return lines

  def to_dict(self) -> dict[str, Any]:
    return {
        'subject': self.subject,
        'ok': self.ok,
        'policy': {
            'allowed_intrinsics': sorted(self.policy.allowed),
            'allow_plain_sum': self.policy.allow_plain_sum,
        },
        'main': self.main,
        'aggregation_passes': self.aggregation_passes,
        'scope': AUDIT_SCOPE,
        'computations': [c.to_dict() for c in self.computations],
        'violations': [v.to_dict() for v in self.violations],
        'notes': self.notes,
    }

  def to_json(self, indent: Optional[int] = 2) -> str:
    return json.dumps(self.to_dict(), indent=indent, default=_json_default)

  def to_markdown(self) -> str:
    """The report as markdown: verdict, passes, scope, one table of flows per computation, violations, notes."""
    violations = self.violations
    verdict = 'PASS'
    if violations:
      where = ''
      if any(v.component for v in violations):  # E.g. `FAIL (3 violations: 2 in the model aggregator, 1 in ...)`.
        per_component = collections.Counter(v.component for v in violations)
        where = ': ' + ', '.join(f'{n} in the {c}' if c else f'{n} outside the components'
                                 for c, n in per_component.items())
      verdict = f'FAIL ({len(violations)} violation{"s" * (len(violations) != 1)}{where})'
    lines = [
        f'## Aggregation audit: {self.subject}',
        '',
        f'**Verdict: {verdict}.** Policy: {self.policy.describe()}.',
        '',
        f'Client-to-server aggregation passes per call of `{self.main}`: **{self.aggregation_passes}**.',
        '',
        f'**Scope.** {AUDIT_SCOPE}',
        '',
    ]
    if self.flows:
      lines.extend(self._summary_table())
    for comp in self.computations:
      lines.append(f'### `{comp.name}`: {comp.aggregation_passes} pass{"es" * (comp.aggregation_passes != 1)}')
      lines.append('')
      lines.append(f'Type: `{comp.type_signature}`')
      lines.append('')
      if not comp.flows:
        lines.append('No client data reaches the server.')
        lines.append('')
        continue
      with_components = any(f.component for f in comp.flows)
      component_header, component_rule = (' component |', '---|') if with_components else ('', '')
      lines.append(f'| pass | intrinsic | value type | secure | parameters | runs/call | allowed |{component_header}'
                   ' where |')
      lines.append(f'|---:|---|---|---|---|---:|---|{component_rule}---|')
      for f in comp.flows:
        params = ', '.join(f'{k}={_format_parameter(v)}' for k, v in f.parameters.items()) or '-'
        component_cell = f' {f.component or "-"} |' if with_components else ''
        lines.append(
            f'| {f.aggregation_pass if f.aggregation_pass is not None else "-"} | `{f.intrinsic}` '
            f'| `{_escape_cell(f.value_type)}` | {"yes" if f.secure else "no"} | {_escape_cell(params)} '
            f'| {f.count} | {"yes" if f.allowed else "**NO**"} |{component_cell} `{_escape_cell(f.where)}` |')
      lines.append('')
    if violations:
      lines.append('### Violations')
      lines.append('')
      for v in violations:
        component = f'the **{v.component}** of ' if v.component else ''
        lines.append(f'- `{v.intrinsic}` in {component}`{v.computation}` at `{v.where}` (runs {v.count}x per call): '
                     f'{v.reason}')
      lines.append('')
    if self.notes:
      lines.append('### Notes')
      lines.append('')
      lines.extend(f'- {n}' for n in self.notes)
      lines.append('')
    return '\n'.join(lines)


def _violation_reason(flow: Flow, policy: AuditPolicy) -> str:
  if flow.intrinsic in KEYED_SELECT_INTRINSICS:
    return ('the clients\' selection keys (client data) are acted on outside the clients; the policy allows no '
            'select')
  if flow.intrinsic in PLAIN_SUM_INTRINSICS:
    return 'a plain (non-secure) sum: the aggregator sees the clients\' values in the clear'
  if flow.intrinsic.startswith('<opaque'):
    return 'an opaque call takes client data and returns server data'
  secure = 'secure ' if flow.secure else ''
  return f'{secure}intrinsic not in the policy\'s allowed set ({", ".join(sorted(policy.allowed))})'


def _format_parameter(value: Any) -> str:
  return value if isinstance(value, str) else json.dumps(value, default=_json_default)


def _escape_cell(text: str) -> str:
  return text.replace('|', '\\|').replace('\n', ' ')


def _json_default(value: Any) -> Any:
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, (frozenset, set)):
    return sorted(value)
  raise TypeError(f'not JSON serializable: {type(value).__name__}')


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
class _StructValue:
  elements: tuple[tuple[Optional[str], '_Value'], ...]


@dataclasses.dataclass(frozen=True, eq=False)
class _Closure:
  function: building_blocks.Lambda
  env: '_Env'


@dataclasses.dataclass(frozen=True, eq=False)
class _IntrinsicFunction:
  intrinsic: building_blocks.Intrinsic


@dataclasses.dataclass(frozen=True, eq=False)
class _OpaqueFunction:
  """A function the audit cannot see into: a TensorFlow computation, a `Data` block, an unbound reference."""

  block: building_blocks.ComputationBuildingBlock


_Value = Union[_Data, _StructValue, _Closure, _IntrinsicFunction, _OpaqueFunction]
_LEVEL_0 = _Data(0)


class _Env:
  """Lexical scope: reference name -> abstract value."""

  def __init__(self, parent: Optional['_Env'] = None):
    self._parent = parent
    self._values: dict[str, _Value] = {}

  def bind(self, name: str, value: _Value) -> None:
    self._values[name] = value

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
  if isinstance(value, _StructValue):
    return max((_level(v) for _, v in value.elements), default=0)
  return 0


def _sources(value: _Value) -> frozenset[int]:
  """The flow sites that reach a value directly (see `_Data.sources`)."""
  if isinstance(value, _Data):
    return value.sources
  if isinstance(value, _StructValue):
    return frozenset().union(*(_sources(v) for _, v in value.elements))
  return frozenset()


def _join(values: Iterable[_Value], extra: int = 0, site: Optional[int] = None) -> _Data:
  """One value depending on all of `values`; `site`: the result of that flow site (its level one higher)."""
  values = list(values)
  sources = frozenset([site]) if site is not None else frozenset().union(*(_sources(v) for v in values))
  return _Data(max((_level(v) for v in values), default=0) + extra, sources=sources)


# ---------------------------------------------------------------------------------------------------------------
# Types.


def _contains_placement(type_spec: tff.Type, placement) -> bool:
  """Whether a value of `type_spec` holds data at `placement` (functions are not data and are not looked into)."""
  if isinstance(type_spec, tff.FederatedType):
    return type_spec.placement is placement
  if isinstance(type_spec, tff.StructType):
    return any(_contains_placement(t, placement) for _, t in structure.iter_elements(type_spec))
  return False


def _is_client_to_server(function_type: tff.Type) -> bool:
  return (isinstance(function_type, tff.FunctionType) and function_type.parameter is not None
          and _contains_placement(function_type.parameter, tff.CLIENTS)
          and _contains_placement(function_type.result, tff.SERVER))


def _carries_data(function_type: tff.FunctionType) -> bool:
  """Whether the client-placed argument holds any tensor: aggregating `<>` (TFF's null aggregations) moves nothing."""
  return type_analysis.contains_tensor_types(_client_part_type(function_type.parameter))


def _client_part_type(parameter_type: tff.Type) -> tff.Type:
  """The client-placed part of an intrinsic's parameter: the element itself, or the struct's first such element."""
  if isinstance(parameter_type, tff.StructType):
    for _, element in structure.iter_elements(parameter_type):
      if _contains_placement(element, tff.CLIENTS):
        return element
  return parameter_type


# ---------------------------------------------------------------------------------------------------------------
# Constants.


def _literal_const(block: building_blocks.Literal) -> _Const:
  return _Const(np.asarray(block.value).tolist())


def _compiled_const(block: building_blocks.CompiledComputation) -> Optional[_Const]:
  """Value of a parameterless TensorFlow computation whose outputs are `Const` ops, else `None`."""
  proto = block.proto
  if proto.WhichOneof('computation') != 'tensorflow' or block.type_signature.parameter is not None:
    return None
  try:
    graph_def = serialization_utils.unpack_graph_def(proto.tensorflow.graph_def)
  except Exception:  # pylint: disable=broad-except
    return None  # Not a graph we can read: the value is reported as dynamic.
  nodes = {node.name: node for node in graph_def.node}

  def const_of(tensor_name: str) -> Optional[Any]:
    name = tensor_name.split(':')[0]
    for _ in range(len(nodes)):
      node = nodes.get(name)
      if node is None:
        return None
      if node.op == 'Const':
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
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
  if isinstance(value, _StructValue):
    parts = [_const_of(v) for _, v in value.elements]
    return DYNAMIC if any(p == DYNAMIC for p in parts) else parts
  return DYNAMIC


# ---------------------------------------------------------------------------------------------------------------
# The evaluation.


@dataclasses.dataclass
class _Site:
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


class _Evaluator:
  """Evaluates a building block over `_Value`s, recording each client-to-server call."""

  def __init__(self, root_name: str, top_block: Optional[building_blocks.Block] = None):
    self._path: list[str] = [root_name]
    self._sites: dict[tuple[Any, ...], _Site] = {}
    self.reached_calls: set[int] = set()
    # The computation's top-level block (the body of the lambda it is): which of its locals a site sits in, and
    # the scope its locals end up in (see `_components`).
    self._top_block = top_block
    self._top_local: Optional[str] = None
    self.top_scope: Optional[_Env] = None

  @property
  def sites(self) -> list[_Site]:
    return list(self._sites.values())

  def evaluate(self, block: building_blocks.ComputationBuildingBlock, env: _Env) -> _Value:
    if isinstance(block, building_blocks.Reference):
      value = env.lookup(block.name)
      if value is not None:
        return value
      return _OpaqueFunction(block) if isinstance(block.type_signature, tff.FunctionType) else _LEVEL_0
    if isinstance(block, building_blocks.Selection):
      source = self.evaluate(block.source, env)
      if isinstance(source, _StructValue):
        return source.elements[block.as_index()][1]
      return source
    if isinstance(block, building_blocks.Struct):
      return _StructValue(
          tuple((name, self.evaluate(element, env)) for name, element in structure.iter_elements(block)))
    if isinstance(block, building_blocks.Lambda):
      return _Closure(block, env)
    if isinstance(block, building_blocks.Block):
      scope = _Env(env)
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
    if isinstance(block, building_blocks.Call):
      function = self.evaluate(block.function, env)
      argument = None if block.argument is None else self.evaluate(block.argument, env)
      return self.call(function, argument, block)
    if isinstance(block, building_blocks.Intrinsic):
      return _IntrinsicFunction(block)
    if isinstance(block, building_blocks.CompiledComputation):
      return _OpaqueFunction(block)
    if isinstance(block, building_blocks.Literal):
      return _Data(0, _literal_const(block))
    if isinstance(block, building_blocks.Data):
      return _OpaqueFunction(block) if isinstance(block.type_signature, tff.FunctionType) else _LEVEL_0
    if isinstance(block, building_blocks.Placement):
      return _LEVEL_0
    raise TypeError(f'unsupported building block {type(block).__name__}: {block.compact_representation()}')

  def call(self, function: _Value, argument: Optional[_Value], call: Optional[building_blocks.Call]) -> _Value:
    """Applies an abstract function; `call` is the `Call` node when there is one (it identifies the site)."""
    if isinstance(function, _Closure):
      scope = _Env(function.env)
      if function.function.parameter_name is not None:
        scope.bind(function.function.parameter_name, argument if argument is not None else _LEVEL_0)
      return self.evaluate(function.function.result, scope)
    if isinstance(function, _IntrinsicFunction):
      return self._call_intrinsic(function.intrinsic, argument, call)
    if isinstance(function, _OpaqueFunction):
      if argument is None and isinstance(function.block, building_blocks.CompiledComputation):
        return _Data(0, _compiled_const(function.block))
      if call is not None and _is_client_to_server(function.block.type_signature):
        site = self._record(call, f'<opaque {type(function.block).__name__}>',
                            _client_part_type(function.block.type_signature.parameter), secure=False,
                            parameters={}, inputs=[argument])
        return _join([argument], extra=1, site=site)
      return _join([argument] if argument is not None else [])
    # Calling a data value cannot type-check; keep going conservatively.
    return _join([function] + ([argument] if argument is not None else []))

  def _call_intrinsic(self, intrinsic: building_blocks.Intrinsic, argument: Optional[_Value],
                      call: Optional[building_blocks.Call]) -> _Value:
    uri = intrinsic.uri
    arguments = list(argument.elements) if isinstance(argument, _StructValue) else [(None, argument)]
    values = [v for _, v in arguments if v is not None]
    data = [v for v in values if not isinstance(v, (_Closure, _IntrinsicFunction, _OpaqueFunction))]
    functions = [v for v in values if isinstance(v, (_Closure, _IntrinsicFunction, _OpaqueFunction))]

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
    return _join(inputs)

  def _record(self, call: building_blocks.Call, uri: str, value_type: tff.Type, secure: bool,
              parameters: dict[str, Any], inputs: Sequence[Optional[_Value]]) -> int:
    """Counts one run of a flow site; returns the site's index."""
    self.reached_calls.add(id(call))
    aggregation_pass = _join([v for v in inputs if v is not None]).level + 1
    where = ' > '.join(self._path)
    key = (id(call), where, aggregation_pass, json.dumps(parameters, default=_json_default, sort_keys=True))
    site = self._sites.get(key)
    if site is None:
      site = _Site(uri, str(value_type), secure, parameters, aggregation_pass, where, index=len(self._sites),
                   top_local=self._top_local)
      self._sites[key] = site
    site.count += 1
    return site.index


def _is_secure(intrinsic: building_blocks.Intrinsic) -> bool:
  definition = intrinsic_defs.uri_to_intrinsic_def(intrinsic.uri)
  if definition is None:
    return False
  return (definition.aggregation_kind is intrinsic_defs.AggregationKind.SECURE
          or definition.broadcast_kind is intrinsic_defs.BroadcastKind.SECURE)


def _unreached_sites(root: building_blocks.ComputationBuildingBlock, reached: set[int], root_name: str,
                     top_block: Optional[building_blocks.Block] = None) -> list[_Site]:
  """Client-to-server intrinsic calls in the tree that the evaluation never reached (count 0)."""
  sites = []

  def visit(block, path, top_local):
    if (isinstance(block, building_blocks.Call) and isinstance(block.function, building_blocks.Intrinsic)
        and id(block) not in reached):
      intrinsic = block.function
      if ((intrinsic.uri in KEYED_SELECT_INTRINSICS or _is_client_to_server(intrinsic.type_signature))
          and _carries_data(intrinsic.type_signature)):
        sites.append(_Site(intrinsic.uri, str(_client_part_type(intrinsic.type_signature.parameter)),
                           _is_secure(intrinsic), {}, 0, ' > '.join(path), count=0, top_local=top_local))
    if isinstance(block, building_blocks.Block):
      for name, local in block.locals:
        visit(local, path + [_format_local(name)], name if block is top_block else top_local)
      visit(block.result, path, top_local)
    else:
      for child in block.children():
        visit(child, path, top_local)

  visit(root, [root_name], None)
  return sites


# ---------------------------------------------------------------------------------------------------------------
# Components of a composed learning process.


def _referenced_local(block: building_blocks.ComputationBuildingBlock) -> Optional[str]:
  """The name `x` of a block that is `x` or a selection from it (`x[2]`, `x.state`), else `None`."""
  while isinstance(block, building_blocks.Selection):
    block = block.source
  return block.name if isinstance(block, building_blocks.Reference) else None


def _composer_structs(top_block: building_blocks.Block) -> list[tuple[dict[str, str], building_blocks.Struct]]:
  """The composer's state and metrics structs in a top-level block: ({local: component field}, struct) each.

  `compose_learning_process`'s `next` builds `LearningAlgorithmState(global_model_weights, distributor,
  client_work, aggregator, finalizer)` and `OrderedDict(distributor=..., client_work=..., aggregator=...,
  finalizer=...)` from the outputs of the four components' `next`, each called once in a local of its top-level
  block. A struct counts when each of the four fields is (a selection from) a different top-level local. Only
  the top-level block's own expressions are searched (struct elements and call arguments, e.g. of
  `federated_zip`), not the components' bodies.
  """
  local_names = {name for name, _ in top_block.locals}
  found = []

  def visit(block):
    if isinstance(block, building_blocks.Struct):
      elements = dict((n, e) for n, e in structure.iter_elements(block) if n is not None)
      if all(field in elements for field in COMPOSER_FIELDS):
        mapping = {}
        for field in COMPOSER_FIELDS:
          local = _referenced_local(elements[field])
          if local not in local_names or local in mapping:
            return
          mapping[local] = field
        found.append((mapping, block))
        return
      for _, element in structure.iter_elements(block):
        visit(element)
    elif isinstance(block, building_blocks.Call) and block.argument is not None:
      visit(block.argument)

  for _, local in top_block.locals:
    visit(local)
  visit(top_block.result)
  return found


def _components(top_block: Optional[building_blocks.Block],
                evaluator: '_Evaluator') -> tuple[dict[str, str], frozenset[int]]:
  """({top-level local: component field}, indices of the metrics aggregator's sites) of a composed process.

  Empty when the computation is not the `next` of a process composed by `compose_learning_process` (or built as
  it is), or when its structs disagree on which local is which component. The metrics aggregator's sites are the
  flows whose results reach the client work's measurements `train` (TFF's training client works) or `eval`
  (`build_fed_eval`) directly, i.e. through no later flow: what TFF's `metrics_aggregator` computes.
  """
  if top_block is None:
    return {}, frozenset()
  structs = _composer_structs(top_block)
  mapping: dict[str, str] = {}
  for struct_mapping, _ in structs:
    for local, field in struct_mapping.items():
      if mapping.setdefault(local, field) != field:
        return {}, frozenset()
  metric_sites = frozenset()
  if evaluator.top_scope is not None:
    for struct_mapping, struct in structs:
      elements = dict((n, e) for n, e in structure.iter_elements(struct) if n is not None)
      if STATE_MODEL_FIELD in elements:
        continue  # The state; the metrics struct is the other one.
      measurements = evaluator.evaluate(elements['client_work'], evaluator.top_scope)
      if isinstance(measurements, _StructValue):
        for element_name, value in measurements.elements:
          if element_name in METRICS_MEASUREMENTS:
            metric_sites |= _sources(value)
  return mapping, metric_sites


def _site_component(site: _Site, mapping: dict[str, str], metric_sites: frozenset[int]) -> Optional[str]:
  field = mapping.get(site.top_local)
  if field is None:
    return None
  if field == 'client_work' and site.index in metric_sites:
    return METRICS_AGGREGATOR
  return _COMPONENT_OF_FIELD[field]


def _audit_building_block(name: str, block: building_blocks.ComputationBuildingBlock,
                          policy: AuditPolicy) -> ComputationAudit:
  top_block = (block.result if isinstance(block, building_blocks.Lambda)
               and isinstance(block.result, building_blocks.Block) else None)
  evaluator = _Evaluator(name, top_block)
  value = evaluator.evaluate(block, _Env())
  if isinstance(value, _Closure):
    # A computation is a lambda: call it on its (level-0) parameter.
    parameter = None if value.function.parameter_type is None else _LEVEL_0
    evaluator.call(value, parameter, None)
  sites = evaluator.sites
  unreached = _unreached_sites(block, evaluator.reached_calls, name, top_block)
  mapping, metric_sites = _components(top_block, evaluator)
  flows = tuple(
      Flow(
          computation=name,
          intrinsic=s.intrinsic,
          value_type=s.value_type,
          secure=s.secure,
          parameters=s.parameters,
          count=s.count,
          aggregation_pass=s.aggregation_pass or None,
          where=s.where,
          allowed=policy.allows(s.intrinsic),
          component=_site_component(s, mapping, metric_sites),
      ) for s in sorted(sites, key=lambda s: s.aggregation_pass) + unreached)
  notes = []
  type_signature = block.type_signature
  result_type = type_signature.result if isinstance(type_signature, tff.FunctionType) else type_signature
  if _contains_placement(result_type, tff.CLIENTS):
    notes.append('the result holds CLIENTS-placed values; they stay at the clients (not a flow to the server) '
                 'unless the caller aggregates them.')
  for site in unreached:
    notes.append(f'`{site.intrinsic}` at `{site.where}` is never reached by the evaluation (a function that is '
                 'not called, or passed to an opaque call); listed with count 0 so that it is not hidden.')
  return ComputationAudit(
      name=name,
      type_signature=str(type_signature),
      flows=flows,
      aggregation_passes=max((s.aggregation_pass for s in sites), default=0),
      notes=tuple(notes),
  )


# ---------------------------------------------------------------------------------------------------------------
# Entry point.


def _to_building_block(comp: Any, name: str) -> building_blocks.ComputationBuildingBlock:
  if isinstance(comp, building_blocks.ComputationBuildingBlock):
    return comp
  to_building_block = getattr(comp, 'to_building_block', None)
  if to_building_block is None:
    raise TypeError(f'`{name}` is a {type(comp).__name__}, not a concrete TFF computation; computations whose '
                    'parameter type is not yet known (polymorphic) must be given a type first')
  return to_building_block()


def _default_weight_type(weight_type: Any) -> tff.Type:
  return tff.to_type(np.float32 if weight_type is None else weight_type)


def _subject_computations(subject: Any, value_type: Any,
                          weight_type: Any) -> tuple[str, list[tuple[str, Any]], str]:
  """(description, [(name, computation)], main name) for any supported subject."""
  if isinstance(subject, (tff.aggregators.UnweightedAggregationFactory, tff.aggregators.WeightedAggregationFactory)):
    if value_type is None:
      raise ValueError(f'value_type is required to audit the factory {type(subject).__name__}')
    value_type = tff.to_type(value_type)
    if isinstance(subject, tff.aggregators.WeightedAggregationFactory):
      weight_type = _default_weight_type(weight_type)
      process = subject.create(value_type, weight_type)
      description = f'{type(subject).__name__}.create({value_type}, {weight_type})'
    else:
      if weight_type is not None:
        raise ValueError(f'weight_type is only for weighted factories; {type(subject).__name__} is unweighted')
      process = subject.create(value_type)
      description = f'{type(subject).__name__}.create({value_type})'
    _, computations, main = _subject_computations(process, None, None)
    return description, computations, main
  if value_type is not None or weight_type is not None:
    raise ValueError('value_type/weight_type are only used with aggregation factories; got a '
                     f'{type(subject).__name__}')
  if isinstance(subject, tff.templates.IterativeProcess):
    return (type(subject).__name__, [('initialize', subject.initialize), ('next', subject.next)], 'next')
  if isinstance(subject, (tff.Computation, building_blocks.ComputationBuildingBlock)):
    return ('computation', [('computation', subject)], 'computation')
  raise TypeError('audit_computation takes a tff.Computation, a tff.templates.AggregationProcess or other '
                  'IterativeProcess (e.g. a tff.learning.templates.LearningProcess), or an aggregation factory with '
                  f'a value_type; got {type(subject).__name__}')


def audit_computation(comp: Any,
                      policy: AuditPolicy = DEFAULT_POLICY,
                      value_type: Any = None,
                      weight_type: Any = None,
                      name: Optional[str] = None) -> AuditReport:
  """Audits where client data reaches the server in a TFF computation, statically.

  Args:
    comp: a concrete `tff.Computation`; a `tff.templates.AggregationProcess`, `tff.learning.templates.
      LearningProcess` or other `IterativeProcess` (its `initialize` and `next` are audited, `next` is the main
      one); or a `tff.aggregators.UnweightedAggregationFactory` / `WeightedAggregationFactory` together with
      `value_type` (the factory is `create`d; for weighted factories `weight_type` defaults to `float32`).
    policy: which intrinsics may carry client data to the server.
    value_type: value type for a factory (anything `tff.to_type` accepts).
    weight_type: weight type for a weighted factory.
    name: how to call the subject in the report (default: its kind).

  Returns:
    An `AuditReport`.

  Raises:
    ValueError: if `value_type` is missing for a factory or given for something else, or `policy` is not an
      `AuditPolicy`.
    TypeError: if `comp` is none of the above.
  """
  if not isinstance(policy, AuditPolicy):
    raise ValueError(f'policy must be an AuditPolicy, got {type(policy).__name__}')
  description, computations, main = _subject_computations(comp, value_type, weight_type)
  # Traced computations nest one Python frame per level of the building block; deep learning processes need room.
  if sys.getrecursionlimit() < _MIN_RECURSION_LIMIT:
    sys.setrecursionlimit(_MIN_RECURSION_LIMIT)
  audits = tuple(
      _audit_building_block(comp_name, _to_building_block(c, comp_name), policy) for comp_name, c in computations)
  subject = f'{name} ({description})' if name else description
  return AuditReport(subject=subject, policy=policy, computations=audits, main=main)
