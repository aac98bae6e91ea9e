"""`StagedAggregationProcess`: an aggregation's `next` as computations of one aggregation stage each, run in turn.

TFF's multi-worker runtime (its mergeable form) runs one aggregation stage per computation; a multi-stage aggregate,
such as RFA's Weiszfeld passes, runs on it as its stages one after another, each one exchange with the clients, as a
deployment with one secure aggregation per exchange runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow_federated as tff


@dataclasses.dataclass(frozen=True)
class StagedAggregationProcess:
  """An aggregation process whose `next` runs as `stages`, each a computation of one aggregation stage.

  Every stage is `(carry@SERVER, value@CLIENTS, weight@CLIENTS) -> carry'@SERVER`: the first takes the process's
  state, each later one what the stage before it returned, and the last returns the `MeasuredProcessOutput` the
  one-computation process's `next` returns (the same state, result and measurements). Only SERVER-placed values
  cross from a stage to the next; the clients' values and weights are the same inputs to every stage, so a
  deployment keeps them on the devices, and a simulation sends them again with each stage.

  Attributes:
    initialize: the process's `initialize`.
    stages: the stage computations, in order.
  """
  initialize: tff.Computation
  stages: tuple[tff.Computation, ...]

  def computations(self) -> list[tuple[str, tff.Computation]]:
    """`initialize` and the stages, by name, in the order they run."""
    return [('initialize', self.initialize), *((f'stage_{i + 1}', s) for i, s in enumerate(self.stages))]

  def next(self, state, value, weight) -> tff.templates.MeasuredProcessOutput:
    """Runs the stages in order in the current context; the clients' `value` and `weight` go to each stage."""
    carry = state
    for stage in self.stages:
      carry = stage(carry, value, weight)
    return carry


def from_process(process: tff.templates.AggregationProcess) -> StagedAggregationProcess:
  """A weighted aggregation process as one stage: its `next` (it must aggregate in one stage to run on several
  workers)."""
  if not isinstance(process, tff.templates.AggregationProcess) or not process.is_weighted:
    raise TypeError(f'process must be a weighted tff.templates.AggregationProcess, got {process!r}')
  return StagedAggregationProcess(process.initialize, (process.next,))


def create_staged(factory: tff.aggregators.WeightedAggregationFactory, value_type,
                  weight_type: Any) -> StagedAggregationProcess:
  """`factory`'s aggregation in stages: its own `create_staged` where it has one, else its process as one stage."""
  create = getattr(factory, 'create_staged', None)
  if create is not None:
    return create(value_type, weight_type)
  return from_process(factory.create(value_type, weight_type))
