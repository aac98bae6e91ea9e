"""The FedAvg family (FedAvg, FedProx, FedAdam, FedYogi): optimizers, the one client work, the round's parts.

From `training.config.AlgorithmConfig`: the optimizers, and the family's one client work (`build_client_work`),
from which the learning process (`build_learning_process`), the corrupted process (`training.engine.corruption`)
and the RFA weight replay (`training.engine.rfa_weights`) are all built. The round's parts (`build_components`:
`Components`) serve both client execution modes (`training.engine.client_execution`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, Optional

from absl import logging
import numpy as np
import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import learning
from tff_gma import optimizers as reddi_optimizers
from tff_gma import tff_internals
from tff_gma.learning import client_lib
from tff_gma.learning import fed_prox
from tff_gma.learning import gma_fed_avg
from tff_gma.learning import in_graph
from training import config as config_lib

def server_optimizer(algorithm_config: config_lib.AlgorithmConfig) -> tff.learning.optimizers.Optimizer:
  """The server's optimizer: SGD at `server_lr`, or for FedAdam/FedYogi (FedAvg with an adaptive server optimizer
  applied to the aggregated update, Reddi et al.) the one `algorithm_config.adaptive_optimizer` names: `reddi`,
  Reddi et al.'s Algorithm 2 (`tff_gma.optimizers`), or `tff`, TFF's bias-corrected `build_adam`/`build_yogi`."""
  adaptive = {
      ('fedadam', 'reddi'): reddi_optimizers.build_reddi_adam,
      ('fedyogi', 'reddi'): reddi_optimizers.build_reddi_yogi,
      ('fedadam', 'tff'): tff.learning.optimizers.build_adam,
      ('fedyogi', 'tff'): tff.learning.optimizers.build_yogi,
  }
  build = adaptive.get((algorithm_config.name, algorithm_config.adaptive_optimizer))
  if build is not None:
    return build(algorithm_config.server_lr, beta_1=config_lib.ADAPTIVE_BETA_1, beta_2=config_lib.ADAPTIVE_BETA_2,
                 epsilon=algorithm_config.adaptive_epsilon)
  return tff.learning.optimizers.build_sgdm(algorithm_config.server_lr)


def client_optimizer(algorithm_config: config_lib.AlgorithmConfig) -> tff.learning.optimizers.Optimizer:
  return tff.learning.optimizers.build_sgdm(algorithm_config.client_lr, momentum=algorithm_config.client_momentum)


def build_server_processes(
    algorithm_config: config_lib.AlgorithmConfig,
    weights_type,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    *,
    mask_on_step: bool = False,
) -> tuple[tff.templates.AggregationProcess, tff.learning.templates.FinalizerProcess]:
  """(aggregator, finalizer): how a round turns the client updates into the new model (`weights_type`'s).

  Default: `model_aggregator` (TFF's weighted mean if None) aggregates the updates, weighted as float32, and TFF's
  apply-optimizer finalizer applies `server_optimizer(algorithm_config)` to its result, as `build_weighted_fed_avg`
  does.
  `mask_on_step=True` takes a `GradientMaskedFactory` and composes the GMA paper's Algorithm 2 instead
  (`tff_gma.learning.gma_fed_avg`): the server optimizer gets the unmasked mean, the mask scales its step.
  """
  if mask_on_step:
    return gma_fed_avg.build_gma_server_processes(model_aggregator, server_optimizer(algorithm_config), weights_type)
  aggregator = (model_aggregator or tff.aggregators.MeanFactory()).create(
      weights_type.trainable, tff.TensorType(np.float32))
  finalizer = tff.learning.templates.build_apply_optimizer_finalizer(server_optimizer(algorithm_config), weights_type)
  return aggregator, finalizer


# TFF's loop where the iterator loop trains (`--client_loop=iterator`, or a model the in-graph loop cannot take),
# in the worker and in the driver (`training.engine.client_execution`): the library's default (DATASET_ITERATOR;
# TFF's DATASET_REDUCE costs more worker CPU per round for identical weights: the benchmark compares the two).
LOOP_IMPLEMENTATION = learning.DEFAULT_LOOP_IMPLEMENTATION
CLIENT_WEIGHTING = tff.learning.ClientWeighting.NUM_EXAMPLES


@dataclasses.dataclass(frozen=True)
class ClientLoop:
  """How a client walks its local epochs (`config_lib.CLIENT_LOOPS`): `in_graph` with the model's functional twin,
  or `iterator` (TFF's update)."""
  name: str
  functional_model: Optional[tff.learning.models.FunctionalModel] = None


_fallbacks_logged: set[str] = set()


def proximal_strength(algorithm_config: config_lib.AlgorithmConfig) -> float:
  """The proximal term's mu (FedProx's, else 0: no term), added as the paper has it (`fed_prox.add_proximal_term`)."""
  return float(algorithm_config.proximal_strength) if algorithm_config.name == 'fedprox' else 0.0


def client_loop(model_fn: Callable[[], tff.learning.models.VariableModel], algorithm_config: config_lib.AlgorithmConfig
                ) -> ClientLoop:
  """The loop `algorithm_config.client_loop` asks for where it applies. `in_graph` needs the model's functional twin
  (`model_fn.functional_model`, as `tff_gma.models.model_fn` gives it) and a model `in_graph.in_graph_support`
  accepts; otherwise the iterator loop trains, with one log line saying why. Serves both client execution modes
  (`training.engine.client_execution` runs the in-graph update in a TF1 session of its own in `local` mode)."""
  if algorithm_config.client_loop == 'iterator':
    return ClientLoop('iterator')
  try:  # The answer for this model, if asked before (building its functional twin costs a model build).
    return _in_graph_loops[model_fn]
  except KeyError:
    _in_graph_loops[model_fn] = loop = _in_graph_loop(model_fn)
    return loop
  except TypeError:  # A model function that cannot be referred to weakly: asked anew.
    return _in_graph_loop(model_fn)


# `client_loop`'s in-graph answers by model function: a run asks when it builds its process and again for its summary.
_in_graph_loops: 'weakref.WeakKeyDictionary[Callable, ClientLoop]' = weakref.WeakKeyDictionary()


def _in_graph_loop(model_fn: Callable[[], tff.learning.models.VariableModel]) -> ClientLoop:
  build_functional = getattr(model_fn, 'functional_model', None)
  functional = build_functional() if callable(build_functional) else None
  reason = in_graph.in_graph_support(model_fn, functional)
  if reason is not None:
    if reason not in _fallbacks_logged:
      _fallbacks_logged.add(reason)
      logging.info('client_loop=in_graph does not apply (%s): TFF\'s iterator loop trains', reason)
    return ClientLoop('iterator')
  return ClientLoop('in_graph', functional)


def build_client_update(model_fn: Callable[[], tff.learning.models.VariableModel],
                        algorithm_config: config_lib.AlgorithmConfig,
                        loop: Optional[ClientLoop] = None) -> Callable[..., Any]:
  """The family's one client update, `(optimizer, hparams, initial_weights, dataset) -> (ClientResult, unfinalized
  metrics)`: TFF's model-delta update (FedProx's: the library's, `fed_prox.build_fed_prox_update`, with the paper's
  proximal term) with `loop` (default `client_loop(model_fn, algorithm_config)`). FedProx's optimizer keeps its own
  hyperparameters (`hparams` is ignored), as in TFF's FedProx client work. Builds its model, so call it where the
  update will run (inside a computation, or under a device)."""
  loop = loop or client_loop(model_fn, algorithm_config)
  proximal = algorithm_config.name == 'fedprox'
  mu = proximal_strength(algorithm_config)
  if loop.name == 'in_graph':
    update = in_graph.build_in_graph_update(
        model_fn, loop.functional_model, weighting=CLIENT_WEIGHTING, proximal_strength=mu)
    return lambda opt, hparams, weights, data: update(opt, weights, data, None if proximal else hparams)
  if proximal:
    update = fed_prox.build_fed_prox_update(
        model_fn, proximal_strength=mu, weighting=CLIENT_WEIGHTING,
        loop_implementation=LOOP_IMPLEMENTATION)
    return lambda opt, hparams, weights, data: update(opt, weights, data)
  update = tff_internals.build_model_delta_update_with_tff_optimizer(
      model_fn=model_fn, weighting=CLIENT_WEIGHTING, loop_implementation=LOOP_IMPLEMENTATION)
  return lambda opt, hparams, weights, data: update(opt, weights, data, hparams)


def build_client_work(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    algorithm_config: config_lib.AlgorithmConfig,
    metrics_aggregator=None,
    client_sources=None,
) -> tff.learning.templates.ClientWorkProcess:
  """The FedAvg family's client work: the one that training, corruption and the RFA weight replay run.

  TFF's model-delta client work (FedProx's: the library's, `tff_gma.learning.fed_prox`, with the paper's proximal
  term where TFF's `build_weighted_fed_prox` has the opposite sign), as `build_weighted_fed_avg` builds it: SGD with
  momentum at `client_lr`, example-count weights. FedAdam and FedYogi differ only at the server. Its loop is
  `client_loop(model_fn, algorithm_config)`'s; with `client_sources`, each client's computation builds its dataset
  from its source (`client_sources.source_type`, e.g. a file prefix and a seed pair; `client_sources.dataset`) and
  trains on it in the same TF graph, so no dataset crosses between computations in the worker
  (`training.engine.worker_datasets`). The state, update, weights and metrics have TFF's types in every case (the
  iterator loop on datasets is TFF's own client work, FedProx's the library's; the others repeat its plumbing).
  """
  if not isinstance(algorithm_config, config_lib.AlgorithmConfig):
    raise ValueError(f'algorithm_config must be a config_lib.AlgorithmConfig, got {algorithm_config!r}')
  loop = client_loop(model_fn, algorithm_config)
  if loop.name == 'iterator' and client_sources is None:
    kwargs = dict(loop_implementation=LOOP_IMPLEMENTATION, metrics_aggregator=metrics_aggregator)
    if algorithm_config.name == 'fedprox':
      return fed_prox.build_fed_prox_client_work(
          model_fn, client_optimizer(algorithm_config), CLIENT_WEIGHTING,
          proximal_strength=proximal_strength(algorithm_config), **kwargs)
    return tff.learning.templates.build_model_delta_client_work(
        model_fn, client_optimizer(algorithm_config), CLIENT_WEIGHTING, **kwargs)
  types = client_lib.model_types(model_fn, metrics_aggregator)
  optimizer = client_optimizer(algorithm_config)
  data_type = tff.SequenceType(types.batch_type) if client_sources is None else client_sources.source_type
  dataset = (lambda data: data) if client_sources is None else client_sources.dataset

  def build_update():
    if loop.name == 'in_graph' and client_sources is not None:
      # The batches straight from the sources (`ClientSources.batches`: the same ones, without walking the
      # examples through tf.data), into the in-graph loop's update on examples.
      update = in_graph.build_examples_update(model_fn, loop.functional_model, weighting=CLIENT_WEIGHTING,
                                              proximal_strength=proximal_strength(algorithm_config))
      # FedProx's optimizer keeps its own hyperparameters (as in `build_client_update`).
      keeps_hparams = algorithm_config.name != 'fedprox'
      return lambda opt, hparams, weights, data: update(opt, weights, *client_sources.batches(data),
                                                        hparams if keeps_hparams else None)
    update = build_client_update(model_fn, algorithm_config, loop)
    return lambda opt, hparams, weights, data: update(opt, hparams, weights, dataset(data))

  # FedProx's client work has no state (its optimizer keeps its own hyperparameters), as TFF's.
  work = client_lib.stateless_client_work if algorithm_config.name == 'fedprox' else client_lib.optimizer_client_work
  return work(types, optimizer, build_update, data_type=data_type)


@dataclasses.dataclass(frozen=True)
class Components:
  """The five parts `tff.learning.templates.compose_learning_process` composes a round from.

  The seam between where the round's parts run: `compose()` is the learning process that runs them all in the TFF
  worker (`--client_execution=worker`); `training.engine.client_execution` runs `client_work`'s math in the driver's
  TensorFlow (GPU where there is one) and the rest (`distributor`'s state and measurements, `aggregator`,
  `finalizer`, the client metrics' aggregation) as one federated computation in the worker, on the state of
  `compose()`'s process (`--client_execution=local`). A builder that swaps the aggregator and finalizer
  (`dataclasses.replace`) gets both modes.
  """
  initial_weights_fn: tff.Computation
  distributor: tff.learning.templates.DistributionProcess
  client_work: tff.learning.templates.ClientWorkProcess
  aggregator: tff.templates.AggregationProcess
  finalizer: tff.learning.templates.FinalizerProcess

  @property
  def weights_type(self):
    return self.initial_weights_fn.type_signature.result

  def compose(self) -> tff.learning.templates.LearningProcess | learning.StagedLearningProcess:
    """The learning process; with an aggregator in stages, its round in stages (`learning.StagedLearningProcess`)."""
    if isinstance(self.aggregator, aggregators.StagedAggregationProcess):
      return learning.compose_staged_learning_process(
          self.initial_weights_fn, self.distributor, self.client_work, self.aggregator, self.finalizer)
    return tff.learning.templates.compose_learning_process(
        self.initial_weights_fn, self.distributor, self.client_work, self.aggregator, self.finalizer)


def build_components(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    algorithm_config: config_lib.AlgorithmConfig,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    metrics_aggregator=None,
    client_work: Optional[tff.learning.templates.ClientWorkProcess] = None,
    *,
    mask_on_step: bool = False,
    client_sources=None,
    staged: bool = False,
) -> Components:
  """The parts of `build_learning_process`'s round (see `Components`; `mask_on_step`: `build_server_processes`;
  `client_sources`: `build_client_work`'s, clients given sources to build their datasets from; `staged`: the
  aggregator as a `StagedAggregationProcess`, one stage per sequential aggregation, for TFF's several workers)."""
  if client_work is None:
    client_work = build_client_work(model_fn, algorithm_config, metrics_aggregator, client_sources)

  @tff.tensorflow.computation()
  def initial_weights_fn():
    return tff.learning.models.ModelWeights.from_model(model_fn())

  weights_type = initial_weights_fn.type_signature.result
  aggregator, finalizer = build_server_processes(algorithm_config, weights_type, model_aggregator,
                                                 mask_on_step=mask_on_step)
  if staged:
    aggregator = (aggregators.from_process(aggregator) if mask_on_step or model_aggregator is None else
                  aggregators.create_staged(model_aggregator, weights_type.trainable, tff.TensorType(np.float32)))
  return Components(initial_weights_fn, tff.learning.templates.build_broadcast_process(weights_type), client_work,
                    aggregator, finalizer)


def build_learning_process(*args, **kwargs) -> tff.learning.templates.LearningProcess:
  """FedAvg/FedProx/FedAdam/FedYogi with `model_aggregator` in place of the weighted mean.

  Composed from TFF's templates as `build_weighted_fed_avg` composes it (broadcast, `build_client_work`, the
  aggregator with example-count weights, the server optimizer's finalizer): `build_components(...).compose()`,
  with `build_components`' arguments; `client_work` replaces the client work (e.g. the corrupted one, which wraps
  `build_client_work`'s); `mask_on_step=True` with a `GradientMaskedFactory`: GMA's Algorithm 2
  (`build_server_processes`).
  """
  return build_components(*args, **kwargs).compose()


def build_client_results(client_work: tff.learning.templates.ClientWorkProcess) -> tff.Computation:
  """`(model_weights@SERVER, client_data@CLIENTS) -> ClientResult@CLIENTS`: the client work alone, no aggregation.

  SIMULATION ONLY: every client's update at once is what the omniscient attacker and the RFA weight replay need;
  no deployed computation does this. Starts from the client work's initial state, as every round of the FedAvg
  family does (its state is the client optimizer's hyperparameters).
  """
  _, weights_type, data_type = client_work.next.type_signature.parameter

  @tff.federated_computation(tff.FederatedType(weights_type.member, tff.SERVER), data_type)
  def client_results(model_weights, client_data):
    return client_work.next(client_work.initialize(), tff.federated_broadcast(model_weights), client_data).result

  return client_results
