"""Static privacy audit of TFF computations: where client data reaches the server, and how.

`audit_computation` walks a computation's building blocks (a process's: every public computation) and lists every
flow of client data to the server, checked against an `AuditPolicy`, and every place it cannot see through. It
reads the compiled form TFF executes, not the Python that built it; what a PASS does not establish is in
`report.AUDIT_SCOPE`.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

import numpy as np
import tensorflow_federated as tff

from tff_gma import tff_internals
from tff_gma.audit.components import composer_components
from tff_gma.audit.components import site_component
from tff_gma.audit.policy import AuditPolicy
from tff_gma.audit.policy import DEFAULT_POLICY
from tff_gma.audit.report import AuditReport
from tff_gma.audit.report import ComputationAudit
from tff_gma.audit.report import Flow
from tff_gma.audit.report import Undecided
from tff_gma.audit.walker import FUNCTIONS
from tff_gma.audit.walker import LEVEL_0
from tff_gma.audit.walker import Closure
from tff_gma.audit.walker import Env
from tff_gma.audit.walker import Evaluator
from tff_gma.audit.walker import contains_placement
from tff_gma.audit.walker import placed_function_types
from tff_gma.audit.walker import typed_value
from tff_gma.audit.walker import unreached_sites

# The Python recursion limit the walk needs (`audit_computation` raises the interpreter's to it, as does the CLI).
_MIN_RECURSION_LIMIT = 20000
# A process's computations that come first in a report, in this order; its other public ones follow by name.
PROCESS_COMPUTATIONS = ('initialize', 'next')


def _call_computation(evaluator: Evaluator, block: tff.framework.ComputationBuildingBlock, value: Any) -> None:
  """Calls the computation on its (level-0) parameter, as its caller does: a computation is a function."""
  type_signature = block.type_signature
  if isinstance(value, Closure):
    evaluator.call(value, None if value.function.parameter_type is None else LEVEL_0, None)
  elif isinstance(value, FUNCTIONS) and isinstance(type_signature, tff.FunctionType):
    # A bare intrinsic or opaque function: a call of its own, so that a flow through it has a call site.
    parameter_type = type_signature.parameter
    if parameter_type is None:
      evaluator.call(value, None, tff.framework.Call(block))
    else:
      call = tff.framework.Call(block, tff.framework.Reference('arg', parameter_type))
      evaluator.call(value, typed_value(parameter_type, LEVEL_0, 'arg'), call)


def _undecided_result(evaluator: Evaluator, result_type: tff.Type) -> None:
  """A function in the result runs wherever the caller calls it, out of the audit's sight."""
  for function_type in placed_function_types(result_type):
    evaluator.undecide(f'the result holds a function of type `{function_type}`; what the caller does with it, the '
                       'audit cannot know')


def _audit_building_block(name: str, block: tff.framework.ComputationBuildingBlock, policy: AuditPolicy,
                          deadline: Optional[float] = None) -> ComputationAudit:
  """Audits one computation's building block: its flows (reached ones in pass order, then unreached), passes, notes.

  `deadline` (`time.monotonic()`): past it, `AnalysisTimeout`."""
  top_block = (block.result if isinstance(block, tff.framework.Lambda)
               and isinstance(block.result, tff.framework.Block) else None)
  evaluator = Evaluator(name, top_block, deadline)
  value = evaluator.evaluate(block, Env())
  _call_computation(evaluator, block, value)
  type_signature = block.type_signature
  result_type = type_signature.result if isinstance(type_signature, tff.FunctionType) else type_signature
  _undecided_result(evaluator, result_type)
  sites = evaluator.sites
  unreached = unreached_sites(block, evaluator.reached_calls, name, top_block)
  mapping, metric_sites = composer_components(top_block, evaluator)
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
          component=site_component(s, mapping, metric_sites),
      ) for s in sorted(sites, key=lambda s: s.aggregation_pass) + unreached)
  notes = []
  if contains_placement(result_type, tff.CLIENTS):
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
      undecided=tuple(Undecided(name, u.where, u.reason) for u in evaluator.undecided),
  )


def _to_building_block(comp: Any, name: str) -> tff.framework.ComputationBuildingBlock:
  if isinstance(comp, tff.framework.ComputationBuildingBlock):
    return comp
  to_building_block = getattr(comp, 'to_building_block', None)
  if to_building_block is None:
    raise TypeError(f'`{name}` is a {type(comp).__name__}, not a concrete TFF computation; computations whose '
                    'parameter type is not yet known (polymorphic) must be given a type first')
  return to_building_block()


def _default_weight_type(weight_type: Any) -> tff.Type:
  return tff.to_type(np.float32 if weight_type is None else weight_type)


def process_computations(process: tff.templates.IterativeProcess) -> list[tuple[str, tff.Computation]]:
  """Every public `tff.Computation` attribute of a process: `initialize`, `next`, then the others by name (a
  learning process's `get_model_weights`, ..., a process with client state's `next_with_client_state`).

  All of them, because each is a computation the process offers to run: one that only `next` covered would let a
  flow in another pass unseen.
  """
  found = {}
  for name in dir(process):
    if name.startswith('_'):
      continue
    try:
      value = getattr(process, name)
    except Exception:  # pylint: disable=broad-except
      continue  # A property that fails is not a computation the process offers.
    if tff_internals.is_polymorphic_computation(value):
      raise TypeError(f'the process\'s `{name}` is a polymorphic computation (no parameter type yet), which the '
                      'audit cannot read')
    if isinstance(value, tff.Computation):
      found[name] = value
  missing = [n for n in PROCESS_COMPUTATIONS if n not in found]
  if missing:
    raise TypeError(f'the process {type(process).__name__} has no computation {missing[0]!r}')
  others = sorted(n for n in found if n not in PROCESS_COMPUTATIONS)
  return [(n, found[n]) for n in (*PROCESS_COMPUTATIONS, *others)]


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
    return type(subject).__name__, process_computations(subject), 'next'
  if callable(getattr(subject, 'computations', None)):
    # A process in stages (`tff_gma.aggregators.StagedAggregationProcess`, `tff_gma.learning.StagedLearningProcess`):
    # every computation it runs; the first after `initialize` is the main one.
    computations = list(subject.computations())
    return type(subject).__name__, computations, computations[1][0]
  if isinstance(subject, (tff.Computation, tff.framework.ComputationBuildingBlock)):
    return ('computation', [('computation', subject)], 'computation')
  raise TypeError('audit_computation takes a tff.Computation, a tff.templates.AggregationProcess or other '
                  'IterativeProcess (e.g. a tff.learning.templates.LearningProcess), or an aggregation factory with '
                  f'a value_type; got {type(subject).__name__}')


def audit_computation(comp: Any,
                      policy: AuditPolicy = DEFAULT_POLICY,
                      value_type: Any = None,
                      weight_type: Any = None,
                      name: Optional[str] = None,
                      timeout_s: Optional[float] = None) -> AuditReport:
  """Audits where client data reaches the server in a TFF computation, statically.

  Args:
    comp: a concrete `tff.Computation`; a `tff.templates.AggregationProcess`, `tff.learning.templates.
      LearningProcess` or other `IterativeProcess` (every public computation of it is audited: `initialize`,
      `next`, and e.g. `next_with_client_state`, `get_model_weights`; `next` is the main one); or a
      `tff.aggregators.UnweightedAggregationFactory` / `WeightedAggregationFactory` together with `value_type`
      (the factory is `create`d; for weighted factories `weight_type` defaults to `float32`).
    policy: which intrinsics may carry client data to the server.
    value_type: value type for a factory (anything `tff.to_type` accepts).
    weight_type: weight type for a weighted factory.
    name: how to call the subject in the report (default: its kind).
    timeout_s: if given, the walk of all the computations stops past this many seconds (`AnalysisTimeout`).

  Returns:
    An `AuditReport`; its `verdict` is `'UNDECIDED'` (not `ok`) when the walk met places it cannot see through.

  Raises:
    ValueError: if `value_type` is missing for a factory or given for something else, or `policy` is not an
      `AuditPolicy`.
    TypeError: if `comp` is none of the above, or a process with a polymorphic public computation.
    AnalysisTimeout: if the walk runs past `timeout_s`.
  """
  if not isinstance(policy, AuditPolicy):
    raise ValueError(f'policy must be an AuditPolicy, got {type(policy).__name__}')
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  description, computations, main = _subject_computations(comp, value_type, weight_type)
  # Traced computations nest one Python frame per level of the building block; deep learning processes need room.
  if sys.getrecursionlimit() < _MIN_RECURSION_LIMIT:
    sys.setrecursionlimit(_MIN_RECURSION_LIMIT)
  audits = tuple(
      _audit_building_block(comp_name, _to_building_block(c, comp_name), policy, deadline)
      for comp_name, c in computations)
  subject = f'{name} ({description})' if name else description
  return AuditReport(subject=subject, policy=policy, computations=audits, main=main)
