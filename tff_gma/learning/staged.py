"""`StagedLearningProcess`: a learning round as computations of one aggregation stage each, for TFF's workers.

`compose_learning_process`'s round (broadcast, client work, aggregator, finalizer) with an aggregator in stages
(`tff_gma.aggregators.StagedAggregationProcess`): the clients' work returns their updates at CLIENTS, the
aggregator's stages run on them in turn, and the server's update ends the round with the state and metrics that
`compose_learning_process`'s `next` returns. Driven from Python: call `next` as on a `LearningProcess`.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, Optional

import tensorflow_federated as tff

from tff_gma.aggregators import staged
from tff_gma.learning import client_lib


class StagedLearningProcess:
  """A learning round run as its computations in turn, each of one aggregation stage.

  `initialize`, `get_model_weights` and `set_model_weights` are computations, with the types of
  `compose_learning_process`'s; `next(state, client_data)` returns the `LearningProcessOutput` its `next` returns,
  and `next_with_client_state` (a process whose clients keep values) a `ClientStateOutput`. Per round it runs
  `client_stage` (the broadcast and the clients' work, with the clients' metrics), the aggregation's `stages`
  on the clients' updates and weights, then `server_stage` (the finalizer). Between them the driver holds the
  clients' updates, which a deployment would keep on the devices.
  """

  def __init__(self, initialize: tff.Computation, client_stage: tff.Computation,
               aggregation: staged.StagedAggregationProcess, server_stage: tff.Computation,
               get_model_weights: tff.Computation, set_model_weights: tff.Computation,
               client_state_type=None, client_state_key: Optional[str] = None):
    self.initialize = initialize
    self.client_stage = client_stage
    self.aggregation = aggregation
    self.server_stage = server_stage
    self.get_model_weights = get_model_weights
    self.set_model_weights = set_model_weights
    self.client_state_type = client_state_type
    self.client_state_key = client_state_key

  def computations(self) -> list[tuple[str, tff.Computation]]:
    """Every computation a round runs, by name, in the order it runs them (then the state's accessors)."""
    stages = [(f'aggregation_stage_{i + 1}', s) for i, s in enumerate(self.aggregation.stages)]
    return [('initialize', self.initialize), ('client_stage', self.client_stage), *stages,
            ('server_stage', self.server_stage), ('get_model_weights', self.get_model_weights),
            ('set_model_weights', self.set_model_weights)]

  def next(self, state, client_data) -> tff.learning.templates.LearningProcessOutput:
    return self._round(state, client_data)[0]

  def next_with_client_state(self, state, client_data) -> client_lib.ClientStateOutput:
    """The round of `next`, and each client's new kept values (as `LearningProcessWithClientState`'s)."""
    if self.client_state_key is None:
      raise TypeError('this process\'s clients keep no values between rounds: call next')
    output, clients = self._round(state, client_data)
    return client_lib.ClientStateOutput(output.state, output.metrics, clients['client_state'])

  def _round(self, state, client_data):
    parts = self.client_stage(state, client_data)
    clients = parts['clients']
    aggregator_output = self.aggregation.next(_field(state, 'aggregator'), clients['update'],
                                              clients['update_weight'])
    return self.server_stage(state, aggregator_output, parts['server']), clients


def _field(state, name: str) -> Any:
  return state[name] if isinstance(state, Mapping) else getattr(state, name)


def compose_staged_learning_process(
    initial_model_weights_fn: tff.Computation,
    model_weights_distributor: tff.learning.templates.DistributionProcess,
    client_work: tff.learning.templates.ClientWorkProcess,
    model_update_aggregator: staged.StagedAggregationProcess,
    model_finalizer: tff.learning.templates.FinalizerProcess,
) -> StagedLearningProcess:
  """`tff.learning.templates.compose_learning_process` with an aggregator in stages (same arguments otherwise)."""

  @tff.federated_computation(*client_work.next.type_signature.parameter)
  def client_round(state, weights, client_data):
    output = client_work.next(state, weights, client_data)
    return output.state, output.result, output.measurements

  return compose_staged(initial_model_weights_fn, model_weights_distributor, client_work.initialize, client_round,
                        model_update_aggregator, model_finalizer)


def compose_staged(initial_model_weights_fn: tff.Computation,
                   distributor: tff.learning.templates.DistributionProcess, client_init_fn: tff.Computation,
                   client_round: tff.Computation, aggregation: staged.StagedAggregationProcess,
                   finalizer: tff.learning.templates.FinalizerProcess, client_state_type=None,
                   client_state_key: Optional[str] = None) -> StagedLearningProcess:
  """The staged round from a client round `(state, weights, client_data) -> (state, ClientResult, measurements)`,
  or, with `client_state_key`, `(..., kept values)` (`client_lib.compose_with_client_state`'s)."""

  @tff.federated_computation()
  def init_fn():
    return tff.federated_zip(tff.learning.templates.LearningAlgorithmState(
        tff.federated_eval(initial_model_weights_fn, tff.SERVER), distributor.initialize(), client_init_fn(),
        aggregation.initialize(), finalizer.initialize()))

  state_type = init_fn.type_signature.result

  @tff.federated_computation(state_type, client_round.type_signature.parameter[2])
  def client_stage(state, client_data):
    distributor_output = distributor.next(state.distributor, state.global_model_weights)
    outputs = client_round(state.client_work, distributor_output.result, client_data)
    client_work_state, client_result, measurements = outputs[0], outputs[1], outputs[2]
    clients = collections.OrderedDict(update=client_result.update, update_weight=client_result.update_weight)
    if client_state_key is not None:
      clients['client_state'] = outputs[3]
    server = collections.OrderedDict(distributor_state=distributor_output.state,
                                     distributor=distributor_output.measurements,
                                     client_work_state=client_work_state, client_work=measurements)
    return collections.OrderedDict(server=server, clients=clients)

  @tff.federated_computation(state_type, aggregation.stages[-1].type_signature.result,
                             client_stage.type_signature.result['server'])
  def server_stage(state, aggregator_output, server):
    finalizer_output = finalizer.next(state.finalizer, state.global_model_weights, aggregator_output.result)
    new_state = tff.federated_zip(tff.learning.templates.LearningAlgorithmState(
        finalizer_output.result, server['distributor_state'], server['client_work_state'], aggregator_output.state,
        finalizer_output.state))
    metrics = tff.federated_zip(collections.OrderedDict(
        distributor=server['distributor'], client_work=server['client_work'],
        aggregator=aggregator_output.measurements, finalizer=finalizer_output.measurements))
    return tff.learning.templates.LearningProcessOutput(new_state, metrics)

  member = state_type.member

  @tff.tensorflow.computation(member)
  def get_model_weights(state):
    return state.global_model_weights

  @tff.tensorflow.computation(member, member.global_model_weights)
  def set_model_weights(state, model_weights):
    return tff.learning.templates.LearningAlgorithmState(model_weights, state.distributor, state.client_work,
                                                         state.aggregator, state.finalizer)

  return StagedLearningProcess(init_fn, client_stage, aggregation, server_stage, get_model_weights,
                               set_model_weights, client_state_type, client_state_key)
