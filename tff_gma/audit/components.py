"""Which part of a composed learning process's round each flow sits in (`Flow.component`).

For the `next` of a process composed by `tff.learning.templates.compose_learning_process`: the distributor, the
client work, the metrics aggregator, the model aggregator or the finalizer, read from the locals of its top-level
block (`None` for any other computation): a flow takes the component of the local it sits in, and a client-work
flow whose result reaches the client work's `train` or `eval` measurements is the metrics aggregator's.
"""

from __future__ import annotations

from typing import Optional

import tensorflow_federated as tff

from tff_gma.audit.report import CLIENT_WORK
from tff_gma.audit.report import DISTRIBUTOR
from tff_gma.audit.report import FINALIZER
from tff_gma.audit.report import METRICS_AGGREGATOR
from tff_gma.audit.report import MODEL_AGGREGATOR
from tff_gma.audit.walker import Evaluator
from tff_gma.audit.walker import Site
from tff_gma.audit.walker import StructValue
from tff_gma.audit.walker import sources_of

# The fields of the composer's state and metrics naming the four processes, and the component each names.
COMPOSER_FIELDS = ('distributor', 'client_work', 'aggregator', 'finalizer')
_COMPONENT_OF_FIELD = {
    'distributor': DISTRIBUTOR, 'client_work': CLIENT_WORK, 'aggregator': MODEL_AGGREGATOR, 'finalizer': FINALIZER}
STATE_MODEL_FIELD = 'global_model_weights'  # Only the state (`LearningAlgorithmState`) has it.
# The client work's measurements holding the metrics aggregator's output: `train` in TFF's training client works
# (and this library's), `eval` in `tff.learning.algorithms.build_fed_eval`.
METRICS_MEASUREMENTS = ('train', 'eval')


def _referenced_local(block: tff.framework.ComputationBuildingBlock) -> Optional[str]:
  """The name `x` of a block that is `x` or a selection from it (`x[2]`, `x.state`), else `None`."""
  while isinstance(block, tff.framework.Selection):
    block = block.source
  return block.name if isinstance(block, tff.framework.Reference) else None


def _composer_structs(top_block: tff.framework.Block) -> list[tuple[dict[str, str], tff.framework.Struct]]:
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
    if isinstance(block, tff.framework.Struct):
      elements = dict((n, e) for n, e in tff.structure.iter_elements(block) if n is not None)
      if all(field in elements for field in COMPOSER_FIELDS):
        mapping = {}
        for field in COMPOSER_FIELDS:
          local = _referenced_local(elements[field])
          if local not in local_names or local in mapping:
            return
          mapping[local] = field
        found.append((mapping, block))
        return
      for _, element in tff.structure.iter_elements(block):
        visit(element)
    elif isinstance(block, tff.framework.Call) and block.argument is not None:
      visit(block.argument)

  for _, local in top_block.locals:
    visit(local)
  visit(top_block.result)
  return found


def composer_components(top_block: Optional[tff.framework.Block],
                        evaluator: Evaluator) -> tuple[dict[str, str], frozenset[int]]:
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
      elements = dict((n, e) for n, e in tff.structure.iter_elements(struct) if n is not None)
      if STATE_MODEL_FIELD in elements:
        continue  # The state; the metrics struct is the other one.
      measurements = evaluator.evaluate(elements['client_work'], evaluator.top_scope)
      if isinstance(measurements, StructValue):
        for element_name, value in measurements.elements:
          if element_name in METRICS_MEASUREMENTS:
            metric_sites |= sources_of(value)
  return mapping, metric_sites


def site_component(site: Site, mapping: dict[str, str], metric_sites: frozenset[int]) -> Optional[str]:
  """The component (`COMPONENTS`) a flow site sits in, given `composer_components`'s result; `None` outside."""
  field = mapping.get(site.top_local)
  if field is None:
    return None
  if field == 'client_work' and site.index in metric_sites:
    return METRICS_AGGREGATOR
  return _COMPONENT_OF_FIELD[field]
