"""The one registry of methods: a record per aggregator and per algorithm, saying what it is and what it supports.

A method is an algorithm (`ALGORITHMS`) with an aggregator (`AGGREGATORS`); `resolve` turns the demo's and the
benchmark's short names into the pair, `check` refuses the pairs (and the modes) the records rule out. Nothing
outside this module tests a method's name: the drivers read the records.

* `Aggregator.kind`: `MODEL_AGGREGATOR`, a `tff.aggregators.WeightedAggregationFactory` built from
  `config.AggregatorParams` and given to the algorithm as its `model_aggregator`; or `PROCESS`, an aggregation
  that is a learning process of its own (Elastic aggregation: its clients also send their parameter sensitivity),
  run with the FedAvg-family algorithms whose server optimizer it takes.
* `Algorithm.kind`: `FEDAVG_FAMILY` (one client work, `training.engine.fedavg_family`; any model aggregator,
  both client-execution modes, update corruption) or `COMPOSED` (a process of `tff_gma.learning` with its own
  client work: TFF worker only, no update corruption).
* `private`: the method's round passes the privacy audit (`tff_gma.audit`: client data reaches the server only
  through means and secure sums) with secure client metrics; a method's verdict is its aggregator's and its
  algorithm's together. `multi_worker`: one aggregation stage, so the round runs over several TFF workers.
  `roles`: the drivers that list it (`DEMO`, `RFA_STUDY`). The registry contract test
  (tests/training/registry_contract_test.py) builds every record and checks each declaration, so a new record is
  tested with no test edit.

Every builder takes the same `config.AggregatorParams` (the runner's aggregator flags) and ignores what it has no
use for, so a flagfile can carry all of them. The baselines of the RFA robustness study (`median`,
`trimmed_mean`, `krum`) collect every client's update at the server (`tff_gma.aggregators.robust_baselines`;
they refuse `secure=True`); `clip_mean`, `zeroing_mean` are TFF's own norm clipping/zeroing in front of TFF's
weighted mean. `trimmed_mean` and `krum` are told the corruption level (`corrupt_fraction`), as in the RFA paper.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Optional

import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import learning
from tff_gma.aggregators import robust_baselines
from training import config as config_lib
from training.engine import client_execution as client_execution_lib
from training.engine import fedavg_family


def _mean(p: config_lib.AggregatorParams):
  if p.secure:
    return aggregators.SecureWeightedMeanFactory(**({} if p.secure_bound is None else {'value_bound': p.secure_bound}))
  return tff.aggregators.MeanFactory()


def _gma(mask: str):
  return lambda p: aggregators.GradientMaskedFactory(
      tau=p.tau, mask=mask, secure=p.secure, value_bound=p.secure_bound)


def _rfa(one_step: bool):
  return lambda p: aggregators.GeometricMedianFactory(
      num_passes=None if one_step else p.num_passes, smoothing=p.smoothing, one_step=one_step, secure=p.secure,
      value_bound=p.secure_bound, init=None if one_step else p.rfa_init)


def _non_private(build: Callable[[config_lib.AggregatorParams], tff.aggregators.WeightedAggregationFactory], name: str):
  def builder(p: config_lib.AggregatorParams):
    if p.secure:
      raise ValueError(f'secure: aggregator {name!r} needs every client update at the server and cannot run with '
                       f'secure=True')
    return build(p)
  return builder


# TFF's adaptive norm bounds (`tff.aggregators.PrivateQuantileEstimationProcess.no_noise`, no noise added):
# clipping at an estimate of the median update norm; zeroing above an estimate of the 0.98 quantile (TFF's
# `tff.learning.robust_aggregator` defaults), so that neither needs the corruption level.
def _clip_mean(p: config_lib.AggregatorParams):
  del p
  norm = tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
      initial_estimate=1.0, target_quantile=0.5, learning_rate=0.2)
  return tff.aggregators.clipping_factory(norm, tff.aggregators.MeanFactory())


def _zeroing_mean(p: config_lib.AggregatorParams):
  del p
  norm = tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
      initial_estimate=10.0, target_quantile=0.98, learning_rate=math.log(10.0), multiplier=2.0, increment=1.0)
  return tff.aggregators.zeroing_factory(norm, tff.aggregators.MeanFactory())


# The learning processes of the composed methods (`tff_gma.learning`), one signature for all: (model_fn,
# AlgorithmConfig, model aggregator (None for a PROCESS aggregator), MethodParams, num_clients, metrics_aggregator,
# AggregatorParams). The composed algorithms take FedAvg's client and server optimizers.
def _elastic(model_fn, config, model_aggregator, extra, num_clients, metrics_aggregator, params):
  del model_aggregator, num_clients
  return learning.build_elastic_fed_avg(
      model_fn, fedavg_family.client_optimizer(config), fedavg_family.server_optimizer(config),
      tau=extra.elastic_tau, mu=extra.elastic_mu, sensitivity_fraction=extra.sensitivity_fraction,
      secure=params.secure, value_bound=params.secure_bound, metrics_aggregator=metrics_aggregator)


def _elastic_probe(params, extra):
  return 'update_and_sensitivity', aggregators.ElasticFactory(
      tau=extra.elastic_tau, secure=params.secure, value_bound=params.secure_bound)


def _fedgma(model_fn, config, model_aggregator, extra, num_clients, metrics_aggregator, params):
  del num_clients, params
  return learning.build_fedgma(
      model_fn, fedavg_family.client_optimizer(config), fedavg_family.server_optimizer(config),
      server_step_size=extra.fedgma_step_size, mask_threshold=extra.fedgma_threshold,
      model_aggregator=model_aggregator, metrics_aggregator=metrics_aggregator)


def _scaffold(model_fn, config, model_aggregator, extra, num_clients, metrics_aggregator, params):
  del extra, params
  return learning.build_scaffold(model_fn, config.client_lr, config.server_lr, model_aggregator,
                                 num_clients=num_clients, metrics_aggregator=metrics_aggregator)


def _personalized(model_fn, config, model_aggregator, extra, num_clients, metrics_aggregator, params):
  del extra, num_clients, params
  return learning.build_personalized_rfa(
      model_fn, fedavg_family.client_optimizer(config), fedavg_family.server_optimizer(config), model_aggregator,
      metrics_aggregator)


ProcessBuilder = Callable[..., tff.learning.templates.LearningProcess]


MODEL_AGGREGATOR = 'model_aggregator'
PROCESS = 'process'
FEDAVG_FAMILY = 'fedavg_family'
COMPOSED = 'composed'
DEMO = 'demo'  # Listed by the demo (training.demo).
RFA_STUDY = 'rfa_study'  # Compared by the RFA robustness study (training.studies.rfa).
UPDATE_CORRUPTIONS = ('gaussian', 'omniscient')  # Corruptions inside the client work (training.engine.corruption).
_BOTH_MODES = client_execution_lib.MODES


@dataclasses.dataclass(frozen=True)
class Aggregator:
  """An aggregator the drivers can name (see the module docstring for the fields)."""
  name: str
  description: str
  kind: str
  private: bool
  build: Optional[Callable[[config_lib.AggregatorParams], tff.aggregators.WeightedAggregationFactory]] = None
  build_process: Optional[ProcessBuilder] = None  # A PROCESS aggregator's learning process.
  # A PROCESS aggregator's aggregation alone, for the benchmark: (kind of client value, factory) from
  # (AggregatorParams, MethodParams).
  probe: Optional[Callable[..., tuple[str, tff.aggregators.WeightedAggregationFactory]]] = None
  algorithms: tuple[str, ...] = config_lib.FEDAVG_FAMILY + ('fedgma', 'scaffold', 'personalized')
  multi_worker: bool = True
  roles: frozenset[str] = frozenset()
  # A GMA factory with an adaptive server (FedAdam, FedYogi): True, the GMA paper's Algorithm 2 (the moments see
  # the unmasked mean, the mask scales the step); False, the drop-in placement (the factory inside TFF's builder:
  # the mask before the optimizer). The SGD servers' two placements are one computation.
  mask_on_step: bool = True


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """An algorithm the drivers can name (see the module docstring for the fields)."""
  name: str
  description: str
  kind: str
  private: bool
  build_process: Optional[ProcessBuilder] = None  # A COMPOSED algorithm's learning process.
  default_aggregator: str = 'mean'  # The aggregator of the algorithm's short name (`resolve`).
  client_execution: tuple[str, ...] = _BOTH_MODES
  update_corruption: bool = True
  multi_worker: bool = True
  # Keeps personal parameters on the clients: each client holds out examples to evaluate its personal model.
  personal_evaluation: bool = False
  roles: frozenset[str] = frozenset()


def _model_aggregator(name, description, build, *, private=True, multi_worker=True, roles=(), mask_on_step=True):
  return Aggregator(name, description, MODEL_AGGREGATOR, private, build, multi_worker=multi_worker,
                    roles=frozenset(roles), mask_on_step=mask_on_step)


_AGGREGATORS = (
    # TFF's MeanFactory sums the weighted values with a plain federated_sum (private only with secure=True).
    _model_aggregator('mean', 'weighted mean (plain FedAvg aggregation)', _mean, private=False,
                      roles=(DEMO, RFA_STUDY)),
    _model_aggregator('gma', 'gradient masked averaging, soft mask (tau)', _gma('soft'), roles=(DEMO, RFA_STUDY)),
    _model_aggregator('gma_binary', 'gradient masked averaging, binary AND-mask (tau)', _gma('binary'),
                      roles=(DEMO,)),
    _model_aggregator('gma_dropin', 'gma with FedAdam/FedYogi in the drop-in placement: the mask before the '
                      'server optimizer (gma itself: the mask on the step, Algorithm 2)', _gma('soft'),
                      mask_on_step=False),
    # Weiszfeld's passes are sequential aggregations: one stage per pass, more than TFF's multi-worker context runs.
    _model_aggregator('rfa', 'geometric median, smoothed Weiszfeld (num_passes secure averages)', _rfa(False),
                      multi_worker=False, roles=(DEMO, RFA_STUDY)),
    _model_aggregator('rfa_one_step', 'one-step RFA (a single reweighted secure average)', _rfa(True),
                      roles=(DEMO, RFA_STUDY)),
    _model_aggregator('median', 'coordinate-wise median (NOT private: every update at the server)',
                      _non_private(lambda p: robust_baselines.CoordinateMedianFactory(), 'median'), private=False,
                      roles=(RFA_STUDY,)),
    _model_aggregator('trimmed_mean', 'coordinate-wise trimmed mean, trimming corrupt_fraction per side (NOT private)',
                      _non_private(lambda p: robust_baselines.TrimmedMeanFactory(p.corrupt_fraction), 'trimmed_mean'),
                      private=False, roles=(RFA_STUDY,)),
    _model_aggregator('krum', 'multi-Krum with f = corrupt_fraction * n, averaging n - f (NOT private)',
                      _non_private(lambda p: robust_baselines.MultiKrumFactory(p.corrupt_fraction), 'krum'),
                      private=False, roles=(RFA_STUDY,)),
    # TFF's adaptive norm estimate sums an indicator per client in plain: not what the audit calls private.
    _model_aggregator('clip_mean', "TFF's norm clipping at an adaptive median norm, then the weighted mean",
                      _clip_mean, private=False, roles=(RFA_STUDY,)),
    _model_aggregator('zeroing_mean', "TFF's zeroing of updates above an adaptive 0.98-quantile norm, then the "
                      'weighted mean', _zeroing_mean, private=False, roles=(RFA_STUDY,)),
    Aggregator('elastic', 'elastic aggregation: update scaled by parameter sensitivity (elastic_tau)', PROCESS, True,
               build_process=_elastic, probe=_elastic_probe, algorithms=('fedavg', 'fedadam', 'fedyogi'), roles=frozenset({DEMO})),
)
_ALGORITHMS = (
    Algorithm('fedavg', 'FedAvg: client SGD with momentum, server SGD', FEDAVG_FAMILY, True),
    Algorithm('fedprox', 'FedProx: FedAvg with a proximal term on the client (proximal_strength)', FEDAVG_FAMILY,
              True),
    Algorithm('fedadam', 'FedAdam: FedAvg with an Adam server optimizer', FEDAVG_FAMILY, True),
    Algorithm('fedyogi', 'FedYogi: FedAvg with a Yogi server optimizer', FEDAVG_FAMILY, True),
    Algorithm('fedgma', 'FedGMA: averaged models + AND-masked server step (fedgma_threshold)', COMPOSED, True,
              _fedgma, client_execution=(client_execution_lib.WORKER,), update_corruption=False,
              roles=frozenset({DEMO})),
    Algorithm('scaffold', 'SCAFFOLD with client control variates, weighted mean of the updates', COMPOSED, True,
              _scaffold, client_execution=(client_execution_lib.WORKER,), update_corruption=False),
    Algorithm('personalized', 'personalized RFA: shared parameters by RFA, personal ones kept by the clients',
              COMPOSED, True, _personalized, default_aggregator='rfa', client_execution=(client_execution_lib.WORKER,),
              update_corruption=False, personal_evaluation=True),
)
AGGREGATOR_RECORDS = {a.name: a for a in _AGGREGATORS}
ALGORITHM_RECORDS = {a.name: a for a in _ALGORITHMS}
AGGREGATORS = tuple(AGGREGATOR_RECORDS)
ALGORITHMS = tuple(ALGORITHM_RECORDS)
MODEL_AGGREGATORS = tuple(a.name for a in _AGGREGATORS if a.kind == MODEL_AGGREGATOR)
METHOD_DESCRIPTIONS = {**{a.name: a.description for a in _AGGREGATORS},
                       **{a.name: a.description for a in _ALGORITHMS if a.kind == COMPOSED}}


def aggregator(name: str) -> Aggregator:
  if name not in AGGREGATOR_RECORDS:
    raise ValueError(f'aggregator: unknown aggregator {name!r}; expected one of {AGGREGATORS}')
  return AGGREGATOR_RECORDS[name]


def algorithm(name: str) -> Algorithm:
  if name not in ALGORITHM_RECORDS:
    raise ValueError(f'algorithm: unknown algorithm {name!r}; expected one of {ALGORITHMS}')
  return ALGORITHM_RECORDS[name]


def build(name: str, params: Optional[config_lib.AggregatorParams] = None
          ) -> tff.aggregators.WeightedAggregationFactory:
  """The model aggregator `name` (a `MODEL_AGGREGATOR` record) with `params`."""
  record = aggregator(name)
  if record.kind != MODEL_AGGREGATOR:
    raise ValueError(f'aggregator: {name!r} is a learning process of its own, not a model aggregator')
  return record.build(params or config_lib.AggregatorParams())


def resolve(name: str) -> tuple[str, str]:
  """A method's short name (the demo's and the benchmark's) -> (algorithm, aggregator).

  An aggregator name is FedAvg with it; a composed algorithm's name is that algorithm with its default aggregator
  (the mean; RFA for personalized RFA); 'ALGORITHM/AGGREGATOR' names both.
  """
  if '/' in name:
    algorithm_name, _, aggregator_name = name.partition('/')
  elif name in AGGREGATOR_RECORDS:
    algorithm_name, aggregator_name = 'fedavg', name
  elif name in ALGORITHM_RECORDS and ALGORITHM_RECORDS[name].kind == COMPOSED:
    algorithm_name, aggregator_name = name, ALGORITHM_RECORDS[name].default_aggregator
  else:
    raise ValueError(f'unknown method {name!r}; known: {", ".join(METHOD_DESCRIPTIONS)} or ALGORITHM/AGGREGATOR')
  check(algorithm_name, aggregator_name)
  return algorithm_name, aggregator_name


def method_names(role: str) -> tuple[str, ...]:
  """The short names (`resolve`) of the methods with `role`: its aggregators under FedAvg, then its composed
  algorithms with their default aggregators."""
  return (tuple(a.name for a in _AGGREGATORS if role in a.roles)
          + tuple(a.name for a in _ALGORITHMS if role in a.roles and a.kind == COMPOSED))


def is_private(algorithm_name: str, aggregator_name: str) -> bool:
  """Whether the method's round passes the privacy audit (with secure client metrics), as the records declare."""
  return algorithm(algorithm_name).private and aggregator(aggregator_name).private


def check(algorithm_name: str, aggregator_name: str, corruption: str = 'none',
          client_execution: str = client_execution_lib.WORKER, workers: Optional[str] = None) -> None:
  """Raises ValueError naming the flag when the combination does not exist (or cannot run in that mode)."""
  algorithm_record, aggregator_record = algorithm(algorithm_name), aggregator(aggregator_name)
  if algorithm_name not in aggregator_record.algorithms:
    raise ValueError(f'aggregator: {aggregator_name} runs with algorithm {", ".join(aggregator_record.algorithms)}, '
                     f'not {algorithm_name!r}')
  process_aggregator = aggregator_record.kind == PROCESS  # Its own client work, like a composed algorithm's.
  if corruption in UPDATE_CORRUPTIONS and (process_aggregator or not algorithm_record.update_corruption):
    raise ValueError(f'corruption: {corruption} corrupts the client work of fedavg, fedprox, fedadam and fedyogi '
                     f'with a model aggregator, not algorithm={algorithm_name!r}, aggregator={aggregator_name!r}')
  client_execution_lib.check(client_execution, algorithm=algorithm_name, aggregator=aggregator_name,
                             corruption=corruption, workers=workers,
                             composed=process_aggregator or client_execution not in algorithm_record.client_execution)
  if workers is not None and not (algorithm_record.multi_worker and aggregator_record.multi_worker):
    raise ValueError(f'workers: {algorithm_name}/{aggregator_name} aggregates in more than one sequential stage; '
                     f'TFF\'s multi-worker (mergeable-computation) runtime runs one stage per computation: use one '
                     f'worker, or a one-stage aggregator (mean, gma, rfa_one_step)')
