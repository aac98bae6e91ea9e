"""What an audit finds and how it is shown: the flow, violation and report types, and their markdown and JSON.

`tff_gma.audit.static` builds these from the walk of a computation's building blocks; this module only holds and
renders them (no TensorFlow Federated internals), so a report reads the same whoever produced it. A report's verdict
is PASS, FAIL or UNDECIDED (`VERDICTS`); each carries `AUDIT_SCOPE`, on what a PASS establishes and what it does not.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from tff_gma.audit.policy import AuditPolicy
from tff_gma.audit.policy import KEYED_SELECT_INTRINSICS
from tff_gma.audit.policy import PLAIN_SUM_INTRINSICS

# A secure-sum parameter that is not a constant of the building block (e.g. a bound taken from the state).
DYNAMIC = 'dynamic'
# The components of a learning process composed by `tff.learning.templates.compose_learning_process` (which TFF's
# builders and this library's use), as the report names them. The metrics aggregator (TFF's `metrics_aggregator`
# argument) runs inside the client work; the audit tells its flows apart by where their results go
# (`tff_gma.audit.components`).
DISTRIBUTOR = 'distributor'
CLIENT_WORK = 'client work'
METRICS_AGGREGATOR = 'metrics aggregator'
MODEL_AGGREGATOR = 'model aggregator'
FINALIZER = 'finalizer'
COMPONENTS = (DISTRIBUTOR, CLIENT_WORK, METRICS_AGGREGATOR, MODEL_AGGREGATOR, FINALIZER)

# The verdicts. UNDECIDED: no violation was found, but the walk met places it cannot see through, so it cannot claim
# that client data reaches the server only through allowed intrinsics; it is not `ok` (the audit fails closed). A
# report with both violations and such places is FAIL: a violation is a finding whatever the undecided places do.
PASS = 'PASS'
FAIL = 'FAIL'
UNDECIDED = 'UNDECIDED'
VERDICTS = (PASS, FAIL, UNDECIDED)

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
class Undecided:
  """A place the audit cannot see through, so whether client data reaches the server there cannot be decided.

  Attributes:
    computation: the audited computation it belongs to (as `Flow.computation`).
    where: path of block locals leading to it (as `Flow.where`).
    reason: what the walk met there, in words (e.g. a call of a functional parameter from CLIENTS to SERVER).
  """

  computation: str
  where: str
  reason: str

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ComputationAudit:
  """Audit of one computation (e.g. a process's `next`); `undecided`: the places it cannot see through."""

  name: str
  type_signature: str
  flows: tuple[Flow, ...]
  aggregation_passes: int
  notes: tuple[str, ...]
  undecided: tuple[Undecided, ...] = ()

  def to_dict(self) -> dict[str, Any]:
    return {
        'name': self.name,
        'type_signature': self.type_signature,
        'aggregation_passes': self.aggregation_passes,
        'flows': [f.to_dict() for f in self.flows],
        'undecided': [u.to_dict() for u in self.undecided],
        'notes': list(self.notes),
    }


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """Result of `audit_computation`.

  Attributes:
    subject: what was audited, in words.
    policy: the policy applied.
    computations: one audit per computation (for processes: every public computation, `initialize` and `next`
      first).
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
  def undecided(self) -> list[Undecided]:
    """Every place of every audited computation that the audit cannot see through."""
    return [u for c in self.computations for u in c.undecided]

  @property
  def verdict(self) -> str:
    """`'FAIL'` with any violation, else `'UNDECIDED'` with any undecided place, else `'PASS'`."""
    if self.violations:
      return FAIL
    return UNDECIDED if self.undecided else PASS

  @property
  def ok(self) -> bool:
    """Only a PASS is ok: a report that cannot be decided fails closed."""
    return self.verdict == PASS

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
        'verdict': self.verdict,
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
        'undecided': [u.to_dict() for u in self.undecided],
        'notes': self.notes,
    }

  def to_json(self, indent: Optional[int] = 2) -> str:
    return json.dumps(self.to_dict(), indent=indent, default=json_default)

  def _verdict_text(self) -> str:
    """E.g. `PASS`, `FAIL (3 violations: 2 in the model aggregator, 1 in ...)`, `UNDECIDED (cannot be decided: ...)`."""
    violations, undecided = self.violations, self.undecided
    places = f'{len(undecided)} place{"s" * (len(undecided) != 1)} the audit cannot see through'
    if self.verdict == UNDECIDED:
      return f'UNDECIDED (cannot be decided: {places})'
    if self.verdict == PASS:
      return PASS
    where = ''
    if any(v.component for v in violations):
      per_component = collections.Counter(v.component for v in violations)
      where = ': ' + ', '.join(f'{n} in the {c}' if c else f'{n} outside the components'
                               for c, n in per_component.items())
    also = f'; besides, {places}' if undecided else ''
    return f'FAIL ({len(violations)} violation{"s" * (len(violations) != 1)}{where}{also})'

  def to_markdown(self) -> str:
    """The report as markdown: verdict, passes, scope, one table of flows per computation, violations, the places
    that cannot be decided, notes."""
    violations = self.violations
    seen_only = ' (counting only the flows the audit could see)' if self.undecided else ''
    lines = [
        f'## Aggregation audit: {self.subject}',
        '',
        f'**Verdict: {self._verdict_text()}.** Policy: {self.policy.describe()}.',
        '',
        f'Client-to-server aggregation passes per call of `{self.main}`: **{self.aggregation_passes}**{seen_only}.',
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
        lines.append('No flow of client data to the server was found, but it cannot be decided at '
                     f'{len(comp.undecided)} place{"s" * (len(comp.undecided) != 1)} (below).' if comp.undecided
                     else 'No client data reaches the server.')
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
    if self.undecided:
      lines.append('### Cannot be decided')
      lines.append('')
      lines.extend(f'- in `{u.computation}` at `{u.where}`: {u.reason}.' for u in self.undecided)
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
  secure = 'secure ' if flow.secure else ''
  return f'{secure}intrinsic not in the policy\'s allowed set ({", ".join(sorted(policy.allowed))})'


def _format_parameter(value: Any) -> str:
  return value if isinstance(value, str) else json.dumps(value, default=json_default)


def _escape_cell(text: str) -> str:
  return text.replace('|', '\\|').replace('\n', ' ')


def json_default(value: Any) -> Any:
  """`json.dumps`'s `default`: NumPy scalars and arrays as Python values, sets as sorted lists."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, (frozenset, set)):
    return sorted(value)
  raise TypeError(f'not JSON serializable: {type(value).__name__}')
