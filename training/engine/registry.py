"""The one registry of methods: a record per aggregator and per algorithm, saying what it is and what it supports.

A method is an algorithm (`ALGORITHMS`) with an aggregator (`AGGREGATORS`). What it is, the settings it reads (read
off its builder's keyword-only parameters) and what it supports come from its records (`check`, `check_settings`,
`used_settings`, `is_private`), so a driver names a method only for what no record says. The records' fields, the
settings and their checks, the robust baselines' refusals: docs/experiments.md#the-method-registry"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, Optional

import tensorflow_federated as tff

from tff_gma import aggregators
from tff_gma import learning
from tff_gma.aggregators import bucketing as bucketing_lib
from tff_gma.aggregators import robust_baselines
from training import config as config_lib
from training.engine import attacks
from training.engine import client_execution as client_execution_lib
from training.engine import fedavg_family

_SETTING_CLASSES = (config_lib.AlgorithmConfig, config_lib.AggregatorParams, config_lib.MethodParams)
# The method settings (docs/experiments.md#the-method-registry): every field of the three dataclasses but these
# two: the algorithm's name and `client_loop` (how a FedAvg-family client walks its batches, not what it computes).
_NOT_SETTINGS = ('name', 'client_loop')
SETTINGS = tuple(f.name for c in _SETTING_CLASSES for f in dataclasses.fields(c) if f.name not in _NOT_SETTINGS)
DEFAULTS = {name: value for c in _SETTING_CLASSES for name, value in dataclasses.asdict(c()).items()
            if name in SETTINGS}
# What a builder may take besides settings, by name (`_call`).
_STRUCTURAL = ('model_fn', 'model_aggregator', 'metrics_aggregator', 'num_clients', 'client_optimizer',
               'server_optimizer', 'staged')


def settings_of(*parts: Any) -> dict[str, Any]:
  """The settings (`SETTINGS`) held by `parts`: an `ExperimentConfig`, or some of `AlgorithmConfig`,
  `AggregatorParams`, `MethodParams` (a setting missing from them takes its default)."""
  return {**DEFAULTS, **{name: getattr(p, name) for p in parts for name in SETTINGS if hasattr(p, name)}}


def _reads(builder: Callable[..., Any]) -> tuple[str, ...]:
  """The settings `builder` reads: its keyword-only parameters, each a setting (checked at import)."""
  parameters = inspect.signature(builder).parameters.values()
  reads = tuple(p.name for p in parameters if p.kind == inspect.Parameter.KEYWORD_ONLY)
  others = [p.name for p in parameters if p.kind != inspect.Parameter.KEYWORD_ONLY and p.name not in _STRUCTURAL]
  unknown = [name for name in reads if name not in SETTINGS]
  if unknown or others:
    raise TypeError(f'registry builder {builder.__name__}: keyword-only parameters must be settings and the others '
                    f'among {_STRUCTURAL}; got {unknown + others}')
  return reads


def _call(builder: Callable[..., Any], settings: Mapping[str, Any], **structural: Any) -> Any:
  """`builder` with exactly its parameters: the structural ones it names from `structural`, its settings from
  `settings`."""
  kwargs = {}
  for parameter in inspect.signature(builder).parameters.values():
    source = settings if parameter.kind == inspect.Parameter.KEYWORD_ONLY else structural
    kwargs[parameter.name] = source[parameter.name]
  return builder(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Builders: their keyword-only parameters are the settings each reads (docs/experiments.md#the-method-registry).


def _mean(*, secure: bool, secure_bound: Optional[float]) -> tff.aggregators.WeightedAggregationFactory:
  if secure:
    return aggregators.SecureWeightedMeanFactory(value_bound=secure_bound)
  return tff.aggregators.MeanFactory()


def _gma(mask: str):
  def build(*, tau: float, secure: bool, secure_bound: Optional[float]) -> tff.aggregators.WeightedAggregationFactory:
    return aggregators.GradientMaskedFactory(tau=tau, mask=mask, secure=secure, value_bound=secure_bound)
  build.__name__ = f'_gma_{mask}'
  return build


def _rfa(*, num_passes: int, smoothing: float, rfa_init: str, secure: bool,
         secure_bound: Optional[float]) -> tff.aggregators.WeightedAggregationFactory:
  return aggregators.GeometricMedianFactory(num_passes=num_passes, smoothing=smoothing, secure=secure,
                                            value_bound=secure_bound, init=rfa_init)


def _rfa_one_step(*, smoothing: float, secure: bool,
                  secure_bound: Optional[float]) -> tff.aggregators.WeightedAggregationFactory:
  return aggregators.GeometricMedianFactory(num_passes=None, smoothing=smoothing, one_step=True, secure=secure,
                                            value_bound=secure_bound)


# Bucketing's permutations are seeded with a constant: a run is reproducible, and its --seed does not reach them.
BUCKETING_SEED = 0


def _bucketed(factory, bucketing: int) -> tff.aggregators.WeightedAggregationFactory:
  """`factory` on the means of `bucketing`-client buckets (0: `factory` itself); collects every update."""
  return bucketing_lib.BucketingFactory(factory, bucketing, BUCKETING_SEED) if bucketing else factory


def _median(*, bucketing: int) -> tff.aggregators.WeightedAggregationFactory:
  return _bucketed(robust_baselines.CoordinateMedianFactory(), bucketing)


def _trimmed_mean(*, corrupt_fraction: float, bucketing: int) -> tff.aggregators.WeightedAggregationFactory:
  return _bucketed(robust_baselines.TrimmedMeanFactory(corrupt_fraction), bucketing)


def _krum(*, corrupt_fraction: float, krum_selected: Optional[int],
          bucketing: int) -> tff.aggregators.WeightedAggregationFactory:
  return _bucketed(robust_baselines.MultiKrumFactory(corrupt_fraction, num_selected=krum_selected), bucketing)


def _centered_clip(*, cc_clip_radius: float, cc_iterations: int, secure: bool, secure_bound: Optional[float],
                   bucketing: int) -> tff.aggregators.WeightedAggregationFactory:
  # secure_bound bounds the secure means' coordinates; unset, the clipped differences' own bound, tau.
  return _bucketed(aggregators.CenteredClippingFactory(
      clip_radius=cc_clip_radius, num_iterations=cc_iterations, secure=secure, value_bound=secure_bound), bucketing)


def _inner_mean(secure: bool, secure_bound: Optional[float]):
  """(weighted mean, count sum) behind TFF's clipping/zeroing: secure sums only with `secure`."""
  if secure:
    return aggregators.SecureWeightedMeanFactory(value_bound=secure_bound), tff.aggregators.SecureSumFactory(1)
  return tff.aggregators.MeanFactory(), None


# TFF's adaptive norm bounds (`tff.aggregators.PrivateQuantileEstimationProcess.no_noise`, no noise added):
# clipping at an estimate of the median update norm; zeroing above an estimate of the 0.98 quantile (TFF's
# `tff.learning.robust_aggregator` defaults), so that neither needs the corruption level. `secure_estimation` sums
# the estimate's per-client indicators with TFF's SecureSumFactory.
def _clip_mean(*, secure: bool, secure_bound: Optional[float]) -> tff.aggregators.WeightedAggregationFactory:
  norm = tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
      initial_estimate=1.0, target_quantile=0.5, learning_rate=0.2, secure_estimation=secure)
  mean, count = _inner_mean(secure, secure_bound)
  return tff.aggregators.clipping_factory(norm, mean, clipped_count_sum_factory=count)


def _zeroing_mean(*, secure: bool, secure_bound: Optional[float]) -> tff.aggregators.WeightedAggregationFactory:
  norm = tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
      initial_estimate=10.0, target_quantile=0.98, learning_rate=math.log(10.0), multiplier=2.0, increment=1.0,
      secure_estimation=secure)
  mean, count = _inner_mean(secure, secure_bound)
  return tff.aggregators.zeroing_factory(norm, mean, zeroed_count_sum_factory=count)


# The learning processes of the composed methods (`tff_gma.learning`). A builder that names `client_optimizer`
# and `server_optimizer` gets them built by `build_process` from the run's `AlgorithmConfig`
# (`fedavg_family.client_optimizer`, `server_optimizer`): Elastic (a PROCESS aggregator) its algorithm's, FedGMA,
# SCAFFOLD and personalized RFA FedAvg's (SGD with momentum; SGD).
def _elastic(model_fn, client_optimizer, server_optimizer, metrics_aggregator, *, elastic_tau: float,
             elastic_mu: float, sensitivity_fraction: float, secure: bool, secure_bound: Optional[float]):
  return learning.build_elastic_fed_avg(
      model_fn, client_optimizer, server_optimizer, tau=elastic_tau, mu=elastic_mu,
      sensitivity_fraction=sensitivity_fraction, secure=secure, value_bound=secure_bound,
      metrics_aggregator=metrics_aggregator)


def _elastic_probe(*, elastic_tau: float, secure: bool, secure_bound: Optional[float]):
  return 'update_and_sensitivity', aggregators.ElasticFactory(tau=elastic_tau, secure=secure, value_bound=secure_bound)


def _fedgma(model_fn, client_optimizer, server_optimizer, model_aggregator, metrics_aggregator, *,
            fedgma_step_size: float, fedgma_threshold: float, secure: bool, secure_bound: Optional[float]):
  # `secure` makes the AND-masked gradient mean secure (its coordinates bounded by secure_bound, like the model
  # updates'); the model updates go through `model_aggregator`, the aggregator record's (secure with it too).
  return learning.build_fedgma(
      model_fn, client_optimizer, server_optimizer, server_step_size=fedgma_step_size,
      mask_threshold=fedgma_threshold, secure=secure, value_bound=secure_bound, mean_factory=model_aggregator,
      metrics_aggregator=metrics_aggregator)


def _scaffold(model_fn, client_optimizer, server_optimizer, model_aggregator, num_clients, metrics_aggregator, *,
              secure: bool, secure_bound: Optional[float]):
  # Client weighting: the runner's (example counts, as the FedAvg family); `build_scaffold` also takes UNIFORM.
  # `secure` makes the control variates' mean secure too (bounded by secure_bound, like the model updates).
  return learning.build_scaffold(model_fn, client_optimizer, model_aggregator=model_aggregator,
                                 server_optimizer_fn=server_optimizer, num_clients=num_clients,
                                 metrics_aggregator=metrics_aggregator, secure=secure, value_bound=secure_bound)


def _personalized(model_fn, client_optimizer, server_optimizer, model_aggregator, metrics_aggregator, staged):
  return learning.build_personalized_rfa(model_fn, client_optimizer, server_optimizer, model_aggregator,
                                         metrics_aggregator, staged=staged)


ProcessBuilder = Callable[..., tff.learning.templates.LearningProcess]


MODEL_AGGREGATOR = 'model_aggregator'
PROCESS = 'process'
FEDAVG_FAMILY = 'fedavg_family'
# `Aggregator.weight_replay`: how the RFA weight audit replays the aggregator.
WEISZFELD = 'weiszfeld'
ONE_STEP = 'one_step'
COMPOSED = 'composed'
DEMO = 'demo'  # Listed by the demo (training.demo).
RFA_STUDY = 'rfa_study'  # Compared by the RFA robustness study (training.studies.rfa).
# Corruptions inside the client work (training.engine.corruption.UPDATE_CORRUPTIONS: Gaussian noise, the omniscient
# attack and the literature's attacks of training.engine.attacks).
UPDATE_CORRUPTIONS = ('gaussian', 'omniscient') + attacks.ATTACKS
_BOTH_MODES = client_execution_lib.MODES


@dataclasses.dataclass(frozen=True)
class Aggregator:
  """An aggregator the drivers can name (docs/experiments.md#the-method-registry)."""
  name: str
  description: str
  # MODEL_AGGREGATOR: a WeightedAggregationFactory from `config.AggregatorParams`, the algorithm's
  # `model_aggregator`; PROCESS: a learning process of its own (Elastic: its clients also send their parameter
  # sensitivity), run with the FedAvg-family algorithms whose client and server optimizers it takes.
  kind: str
  # Passes the privacy audit (client data reach the server only through means and secure sums) with secure client
  # metrics; a method's verdict is its aggregator's and its algorithm's together.
  private: bool
  # A MODEL_AGGREGATOR's factory, from its settings (keyword-only, `reads`).
  build: Optional[Callable[..., tff.aggregators.WeightedAggregationFactory]] = None
  build_process: Optional[ProcessBuilder] = None  # A PROCESS aggregator's learning process.
  # A PROCESS aggregator's aggregation alone, for the benchmark: (kind of client value, factory) from settings
  # among `reads`.
  probe: Optional[Callable[..., tuple[str, tff.aggregators.WeightedAggregationFactory]]] = None
  algorithms: tuple[str, ...] = config_lib.FEDAVG_FAMILY + ('fedgma', 'scaffold', 'personalized')
  # Aggregates in several sequential stages (RFA's passes): on several TFF workers, a round of an algorithm that
  # can run in stages (`Algorithm.staged`) runs as one computation a stage (`tff_gma.learning.StagedLearningProcess`).
  multi_stage: bool = False
  roles: frozenset[str] = frozenset()  # The drivers that list it (DEMO, RFA_STUDY).
  # A GMA factory with an adaptive server (FedAdam, FedYogi): True, the GMA paper's Algorithm 2 (the moments see
  # the unmasked mean, the mask scales the step); False, the drop-in placement (the factory inside TFF's builder:
  # the mask before the optimizer). The SGD servers' two placements are one computation.
  mask_on_step: bool = True
  reads: tuple[str, ...] = ()  # The settings it reads: its builder's keyword-only parameters.
  # (setting, why): a setting it cannot honour although the algorithm may read it (FedGMA's `secure`), refused
  # with the method whatever the algorithm.
  refusals: tuple[tuple[str, str], ...] = ()
  # (setting, bound, why): a setting it reads that must lie below `bound` with it, narrower than the setting's own
  # range (the robust baselines' corruption level), refused by `check_settings` in the flag's name.
  upper_bounds: tuple[tuple[str, float, str], ...] = ()
  # RFA's simulation-only weight audit (`--rfa_weight_bound`, `training.engine.rfa_weights`) replays it:
  # WEISZFELD (num_passes passes from rfa_init) or ONE_STEP (one reweighted average from the zero update); None, not.
  weight_replay: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """An algorithm the drivers can name (docs/experiments.md#the-method-registry)."""
  name: str
  description: str
  # FEDAVG_FAMILY: one client work (`fedavg_family`), any model aggregator, both client-execution modes, update
  # corruption; COMPOSED: a process of `tff_gma.learning` with its own client work (TFF worker only, no update
  # corruption).
  kind: str
  private: bool  # As `Aggregator.private`.
  build_process: Optional[ProcessBuilder] = None  # A COMPOSED algorithm's learning process.
  default_aggregator: str = 'mean'  # The aggregator of the algorithm's short name (`resolve`).
  client_execution: tuple[str, ...] = _BOTH_MODES  # The modes its clients can train in (`client_execution`).
  update_corruption: bool = True  # Runs with the corruptions inside the client work (UPDATE_CORRUPTIONS).
  # Runs its round in stages (`Aggregator.multi_stage`): its builder takes `staged` (the FedAvg family's does).
  staged: bool = False
  # Keeps personal parameters on the clients: each client holds out examples to evaluate its personal model.
  personal_evaluation: bool = False
  roles: frozenset[str] = frozenset()
  # The settings it reads: a COMPOSED algorithm's builder's keyword-only parameters; the FedAvg family's, those
  # `fedavg_family` reads for it (its optimizers, FedProx's mu).
  reads: tuple[str, ...] = ()


def _model_aggregator(name, description, build, *, private=True, multi_stage=False, roles=(), mask_on_step=True,
                      refusals=(), upper_bounds=(), weight_replay=None):
  return Aggregator(name, description, MODEL_AGGREGATOR, private, build, multi_stage=multi_stage,
                    roles=frozenset(roles), mask_on_step=mask_on_step, reads=_reads(build), refusals=refusals,
                    upper_bounds=upper_bounds, weight_replay=weight_replay)


# The settings behind the structural optimizers (`fedavg_family.client_optimizer`, `server_optimizer`).
_OPTIMIZER_READS = {'client_optimizer': ('client_lr', 'client_momentum'), 'server_optimizer': ('server_lr',)}
_FEDAVG_READS = tuple(setting for settings in _OPTIMIZER_READS.values() for setting in settings)


def _composed(name, description, build_process, **kwargs):
  # The settings it reads: those of the optimizers its builder takes, then its builder's keyword-only parameters.
  parameters = inspect.signature(build_process).parameters
  optimizer_reads = tuple(setting for optimizer, settings in _OPTIMIZER_READS.items() if optimizer in parameters
                          for setting in settings)
  return Algorithm(name, description, COMPOSED, True, build_process, client_execution=(client_execution_lib.WORKER,),
                   update_corruption=False, reads=optimizer_reads + _reads(build_process), **kwargs)


# FedAdam/FedYogi's server optimizer: Reddi et al.'s epsilon, and which implementation (`adaptive_optimizer`).
_ADAPTIVE_READS = _FEDAVG_READS + ('adaptive_epsilon', 'adaptive_optimizer')

_COLLECTS_UPDATES = (('secure', 'needs every client update at the server'),)
# The robust baselines are told the corruption level and need an honest majority: below one half (their library
# factories' own limit, `tff_gma.aggregators.robust_baselines`).
_TRIMS = (('corrupt_fraction', 0.5, 'trims that share of the updates from each side'),)
_DISCARDS = (('corrupt_fraction', 0.5, 'discards that share of the updates (f = corrupt_fraction * n)'),)

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
    # Weiszfeld's passes are sequential aggregations: one stage per pass (`GeometricMedianFactory.create_staged`).
    _model_aggregator('rfa', 'geometric median, smoothed Weiszfeld (num_passes secure averages)', _rfa,
                      multi_stage=True, roles=(DEMO, RFA_STUDY), weight_replay=WEISZFELD),
    _model_aggregator('rfa_one_step', 'one-step RFA (a single reweighted secure average)', _rfa_one_step,
                      roles=(DEMO, RFA_STUDY), weight_replay=ONE_STEP),
    # The baselines collect every update at the server: secure=True is refused with them.
    _model_aggregator('median', 'coordinate-wise median (NOT private: every update at the server)', _median,
                      private=False, roles=(RFA_STUDY,), refusals=_COLLECTS_UPDATES),
    _model_aggregator('trimmed_mean', 'coordinate-wise trimmed mean, trimming corrupt_fraction per side (NOT private)',
                      _trimmed_mean, private=False, roles=(RFA_STUDY,), refusals=_COLLECTS_UPDATES,
                      upper_bounds=_TRIMS),
    # Centered clipping's iterations are sequential means: one stage each (`CenteredClippingFactory.create_staged`).
    _model_aggregator('centered_clip', 'centered clipping: cc_iterations means of the differences to the centre, '
                      'clipped to cc_clip_radius', _centered_clip, multi_stage=True, roles=(RFA_STUDY,)),
    _model_aggregator('krum', 'multi-Krum with f = corrupt_fraction * n, averaging n - f (NOT private)', _krum,
                      private=False, roles=(RFA_STUDY,), refusals=_COLLECTS_UPDATES, upper_bounds=_DISCARDS),
    # TFF's adaptive norm estimate sums an indicator per client in plain unless secure=True: not what the audit
    # calls private by default.
    _model_aggregator('clip_mean', "TFF's norm clipping at an adaptive median norm, then the weighted mean",
                      _clip_mean, private=False, roles=(RFA_STUDY,)),
    _model_aggregator('zeroing_mean', "TFF's zeroing of updates above an adaptive 0.98-quantile norm, then the "
                      'weighted mean', _zeroing_mean, private=False, roles=(RFA_STUDY,)),
    Aggregator('elastic', 'elastic aggregation: update scaled by parameter sensitivity (elastic_tau)', PROCESS, True,
               build_process=_elastic, probe=_elastic_probe, algorithms=('fedavg', 'fedadam', 'fedyogi'),
               roles=frozenset({DEMO}), reads=_reads(_elastic)),
)
_ALGORITHMS = (
    Algorithm('fedavg', 'FedAvg: client SGD with momentum, server SGD', FEDAVG_FAMILY, True, reads=_FEDAVG_READS,
              staged=True),
    Algorithm('fedprox', 'FedProx: FedAvg with a proximal term on the client (proximal_strength)', FEDAVG_FAMILY,
              True, reads=_FEDAVG_READS + ('proximal_strength',), staged=True),
    Algorithm('fedadam', 'FedAdam: FedAvg with an Adam server optimizer', FEDAVG_FAMILY, True, reads=_ADAPTIVE_READS,
              staged=True),
    Algorithm('fedyogi', 'FedYogi: FedAvg with a Yogi server optimizer', FEDAVG_FAMILY, True, reads=_ADAPTIVE_READS,
              staged=True),
    _composed('fedgma', 'FedGMA: averaged models + AND-masked server step (fedgma_threshold)', _fedgma,
              roles=frozenset({DEMO})),
    _composed('scaffold', 'SCAFFOLD with client control variates, weighted mean of the updates', _scaffold),
    _composed('personalized', 'personalized RFA: shared parameters by RFA, personal ones kept by the clients',
              _personalized, default_aggregator='rfa', personal_evaluation=True, staged=True),
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


def build(name: str, aggregator_params: Optional[config_lib.AggregatorParams] = None
          ) -> tff.aggregators.WeightedAggregationFactory:
  """The model aggregator `name` (a `MODEL_AGGREGATOR` record) with the settings it reads from
  `aggregator_params`."""
  record = aggregator(name)
  if record.kind != MODEL_AGGREGATOR:
    raise ValueError(f'aggregator: {name!r} is a learning process of its own, not a model aggregator')
  return _call(record.build, settings_of(aggregator_params or config_lib.AggregatorParams()))


def build_process(model_fn, algorithm_name: str, aggregator_name: str, algorithm_config: config_lib.AlgorithmConfig,
                  aggregator_params: config_lib.AggregatorParams, method_params: config_lib.MethodParams, *,
                  num_clients: Optional[int], metrics_aggregator, staged: bool = False
                  ) -> tff.learning.templates.LearningProcess:
  """The learning process of a method with a `PROCESS` aggregator or a `COMPOSED` algorithm (the FedAvg family
  with a model aggregator is `training.engine.fedavg_family`'s). Each builder gets exactly its parameters.

  `algorithm_config.name` names the FedAvg-family algorithm whose optimizers the method takes (`methods.build` sets
  it: the algorithm itself under a `PROCESS` aggregator, `fedavg` for a composed algorithm).
  """
  algorithm_record, aggregator_record = algorithm(algorithm_name), aggregator(aggregator_name)
  settings = settings_of(algorithm_config, aggregator_params, method_params)
  optimizers = dict(client_optimizer=fedavg_family.client_optimizer(algorithm_config),
                    server_optimizer=fedavg_family.server_optimizer(algorithm_config))
  if aggregator_record.kind == PROCESS:  # With the algorithm's own optimizers (FedAvg, FedAdam, FedYogi).
    return _call(aggregator_record.build_process, settings, model_fn=model_fn, metrics_aggregator=metrics_aggregator,
                 **optimizers)
  if algorithm_record.kind != COMPOSED:
    raise ValueError(f'algorithm: {algorithm_name} with a model aggregator is built by training.engine.fedavg_family')
  return _call(algorithm_record.build_process, settings, model_fn=model_fn,
               model_aggregator=build(aggregator_name, aggregator_params), num_clients=num_clients,
               metrics_aggregator=metrics_aggregator, staged=staged, **optimizers)


def probe(name: str, aggregator_params: config_lib.AggregatorParams, method_params: config_lib.MethodParams
          ) -> Optional[tuple[str, tff.aggregators.WeightedAggregationFactory]]:
  """A `PROCESS` aggregator's aggregation alone (the benchmark's probe): (kind of client value, factory); None
  when it has none."""
  record = aggregator(name)
  if record.probe is None:
    return None
  return _call(record.probe, settings_of(aggregator_params, method_params))


def used_settings(algorithm_name: str, aggregator_name: str, settings: Mapping[str, Any],
                  corruption: str = 'none') -> frozenset[str]:
  """The settings the method reads with these `settings`: its algorithm's and its aggregator's; `secure_bound` only
  with `secure=True`; `corrupt_fraction` also under any `corruption` (the corruption level)."""
  used = set(algorithm(algorithm_name).reads) | set(aggregator(aggregator_name).reads)
  if corruption != 'none':
    used.add('corrupt_fraction')  # The corruption level.
  if 'secure' in used and not settings.get('secure', False):
    used.discard('secure_bound')
  return frozenset(used)


def _readers(name: str) -> str:
  """Who reads setting `name`, for a refusal."""
  if name == 'secure_bound':
    return 'it bounds the secure sums of --secure=true'
  parts = ['any --corruption'] if name == 'corrupt_fraction' else []
  for kind, records in (('aggregator', _AGGREGATORS), ('algorithm', _ALGORITHMS)):
    names = [r.name for r in records if name in r.reads]
    if names:
      parts.append(f'{kind}{"s" if len(names) > 1 else ""} {", ".join(names)}')
  return 'read by ' + ('; '.join(parts) if parts else 'no method')


def check_settings(algorithm_name: str, aggregator_name: str, settings: Mapping[str, Any],
                   corruption: str = 'none') -> None:
  """Raises ValueError, one line naming the setting and the method, for a setting in `settings` (`settings_of`)
  that the method does not read and that differs from its default, or that its aggregator cannot take
  (`Aggregator.refusals`, `Aggregator.upper_bounds`). "Set" means "not the default": a flagfile may carry every
  default. Ranges are the settings' dataclasses' (`training.config`), not checked again here."""
  if settings.get('bucketing', 0) and settings.get('secure', False):
    raise ValueError(f'bucketing: it collects every client update at the server and cannot run with secure=True '
                     f'(aggregator={aggregator_name}, algorithm={algorithm_name})')
  for name, why in aggregator(aggregator_name).refusals:
    if name in settings and settings[name] != DEFAULTS[name]:
      raise ValueError(f'{name}: aggregator {aggregator_name!r} {why} and cannot run with {name}={settings[name]!r} '
                       f'(algorithm={algorithm_name})')
  for name, bound, why in aggregator(aggregator_name).upper_bounds:
    if name in settings and not settings[name] < bound:
      raise ValueError(f'{name}: aggregator {aggregator_name!r} {why}, so {name} must lie below {bound:g}, got '
                       f'{settings[name]!r} (algorithm={algorithm_name})')
  used = used_settings(algorithm_name, aggregator_name, settings, corruption)
  for name in SETTINGS:
    if name in used or name not in settings or settings[name] == DEFAULTS[name]:
      continue
    where = f' with --corruption={corruption}' if name == 'corrupt_fraction' else ''
    if name == 'secure_bound' and 'secure' in used:
      where = ' with --secure=false'
    raise ValueError(f'{name}: {algorithm_name}/{aggregator_name}{where} does not read it ({_readers(name)}), so '
                     f'{name}={settings[name]!r} cannot take effect; leave it at its default {DEFAULTS[name]!r}')


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


def is_private(algorithm_name: str, aggregator_name: str, settings: Optional[Mapping[str, Any]] = None) -> bool:
  """Whether the method's round passes the privacy audit (with secure client metrics), as the records declare;
  never with `bucketing` set in `settings` (it collects every update at the server)."""
  bucketed = bool((settings or {}).get('bucketing', 0))
  return algorithm(algorithm_name).private and aggregator(aggregator_name).private and not bucketed


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
  if workers is not None and aggregator_record.multi_stage and not algorithm_record.staged:
    staged = ', '.join(a.name for a in _ALGORITHMS if a.staged)
    raise ValueError(f'workers: {algorithm_name}/{aggregator_name} aggregates in more than one sequential stage; '
                     f'on several TFF workers such a round runs one stage per computation, which {staged} do and '
                     f'{algorithm_name} does not: use one worker, or a one-stage aggregator (mean, gma, '
                     f'rfa_one_step)')
