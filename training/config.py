"""Every default of the harness, once: the settings of a method and of a run.

`AlgorithmConfig`, `AggregatorParams` and `MethodParams` hold a method's settings, `ExperimentConfig` a whole run (its
fields are the runner's flags). Each method setting is checked once, here, where its dataclass is built; defaults the
library has are taken from it. Detail: docs/experiments.md#settings-and-their-one-check"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tff_gma import checks
from tff_gma.runtime import worker_process as runtime_defaults
from tff_gma.aggregators import centered_clipping
from tff_gma.aggregators import geometric_median
from tff_gma.aggregators import gradient_masked
from tff_gma.data import federated
from tff_gma.data import partition as partition_lib
from tff_gma.learning import elastic as elastic_learning
from tff_gma.learning import fedgma as fedgma_learning
from training.engine import attacks

# The FedAvg family: FedAvg with an SGD (FedAvg, FedProx) or adaptive (FedAdam, FedYogi; Reddi et al.) server.
FEDAVG_FAMILY = ('fedavg', 'fedprox', 'fedadam', 'fedyogi')
ADAPTIVE_ALGORITHMS = ('fedadam', 'fedyogi')

# Paper defaults (GMA paper, Sec. 5 and App. C): client SGD with momentum 0.9; FedAdam/FedYogi with
# beta1 = 0.9, beta2 = 0.99 (Reddi et al.).
ADAPTIVE_BETA_1 = 0.9
ADAPTIVE_BETA_2 = 0.99

# FedAdam/FedYogi's server optimizer (docs/methods.md, "Adaptive server optimizers"): `reddi`, Reddi et al.'s
# Algorithm 2 as the GMA paper uses it (`tff_gma.optimizers`: no bias correction, v from tau^2); `tff`, TFF's
# bias-corrected `build_adam`/`build_yogi` (what every run made before the setting existed used).
ADAPTIVE_OPTIMIZERS = ('reddi', 'tff')

# How a FedAvg-family client walks its local epochs: `in_graph` (tff_gma.learning.in_graph: the client's examples
# read once into tensors, the steps one tf.while_loop over batch slices, the model as TFF's functional model) where
# the model allows it, else `iterator` (TFF's model-delta client work with DATASET_ITERATOR), with a log line.
CLIENT_LOOPS = ('in_graph', 'iterator')

# `python -m training.run --seeds=0,1,2 --output_dir=D` runs seed s into D/seed_<s>; `training.compare D` reads them.
SEED_DIR = 'seed_{}'


def _help(text: str, default: Any) -> Any:
  return dataclasses.field(default=default, metadata={'help': text})


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
  """Hyperparameters of the server/client optimisation, independent of the aggregation rule."""
  name: str = 'fedavg'
  client_lr: float = 0.05
  server_lr: float = 1.0
  client_momentum: float = 0.9  # GMA paper: client SGD with momentum 0.9.
  proximal_strength: float = 0.01  # FedProx mu.
  adaptive_epsilon: float = 1e-3  # FedAdam/FedYogi tau (Reddi et al.'s adaptivity epsilon).
  adaptive_optimizer: str = 'reddi'  # FedAdam/FedYogi's server optimizer: one of ADAPTIVE_OPTIMIZERS.
  client_loop: str = 'in_graph'  # One of CLIENT_LOOPS.

  def __post_init__(self):
    """The harness's one check of these values (docs/experiments.md#settings-and-their-one-check)."""
    if self.name not in FEDAVG_FAMILY:
      raise ValueError(f'algorithm must be one of {FEDAVG_FAMILY}, got {self.name!r}')
    for field in ('client_lr', 'server_lr'):
      checks.check_positive_finite(getattr(self, field), field)
    if not 0 <= self.client_momentum < 1:
      raise ValueError(f'client_momentum must lie in [0, 1), got {self.client_momentum!r}')
    if self.proximal_strength < 0:
      raise ValueError(f'proximal_strength must be non-negative, got {self.proximal_strength!r}')
    if not self.adaptive_epsilon > 0:
      raise ValueError(f'adaptive_epsilon must be positive, got {self.adaptive_epsilon!r}')
    if self.client_loop not in CLIENT_LOOPS:
      raise ValueError(f'client_loop must be one of {CLIENT_LOOPS}, got {self.client_loop!r}')
    if self.adaptive_optimizer not in ADAPTIVE_OPTIMIZERS:
      raise ValueError(f'adaptive_optimizer must be one of {ADAPTIVE_OPTIMIZERS}, got {self.adaptive_optimizer!r}')


@dataclasses.dataclass(frozen=True)
class AggregatorParams:
  """Hyperparameters of the model aggregators (each builder of `training.engine.registry` reads what it uses)."""
  tau: float = gradient_masked.DEFAULT_TAU  # GMA agreement threshold.
  num_passes: int = geometric_median.DEFAULT_NUM_PASSES  # RFA secure averages per round.
  smoothing: float = geometric_median.DEFAULT_SMOOTHING  # RFA nu.
  rfa_init: str = geometric_median.DEFAULT_INIT  # Where RFA's Weiszfeld starts: 'mean' or 'zero'.
  secure: bool = False  # Float sums through secure sums as well (bounded, discretized).
  secure_bound: Optional[float] = None  # Per-coordinate bound for secure float sums (None: the factory's default).
  corrupt_fraction: float = 0.0  # The corruption level rho, known to trimmed_mean and krum.
  krum_selected: Optional[int] = None  # krum: the m updates averaged (None: n - f; 1: Krum).
  cc_clip_radius: float = centered_clipping.DEFAULT_CLIP_RADIUS  # centered_clip: tau.
  cc_iterations: int = centered_clipping.DEFAULT_NUM_ITERATIONS  # centered_clip: L, its sequential means.
  bucketing: int = 0  # Bucket size s around a robust rule (0: no bucketing).

  def __post_init__(self):
    """The harness's one check of these values (docs/experiments.md#settings-and-their-one-check)."""
    checks.check_fraction(self.tau, 'tau')
    checks.check_positive_int(self.num_passes, 'num_passes')
    checks.check_positive_finite(self.smoothing, 'smoothing')
    if self.rfa_init not in geometric_median.INITS:
      raise ValueError(f"rfa_init must be 'mean' or 'zero', got {self.rfa_init!r}")
    checks.check_bool(self.secure, 'secure')
    if self.secure_bound is not None:
      checks.check_positive_finite(self.secure_bound, 'secure_bound')
    checks.check_fraction(self.corrupt_fraction, 'corrupt_fraction', high_open=True)
    checks.check_positive_int(self.krum_selected, 'krum_selected', optional=True)
    checks.check_positive_finite(self.cc_clip_radius, 'cc_clip_radius')
    checks.check_positive_int(self.cc_iterations, 'cc_iterations')
    if self.bucketing != 0:
      checks.check_positive_int(self.bucketing, 'bucketing')


@dataclasses.dataclass(frozen=True)
class MethodParams:
  """Hyperparameters of the composed methods (paper defaults, from the library)."""
  elastic_tau: float = elastic_learning.DEFAULT_TAU  # Elastic aggregation tau.
  elastic_mu: float = elastic_learning.DEFAULT_MU  # Elastic sensitivity momentum.
  sensitivity_fraction: float = elastic_learning.DEFAULT_SENSITIVITY_FRACTION  # Share of batches for it.
  fedgma_step_size: float = fedgma_learning.DEFAULT_SERVER_STEP_SIZE  # FedGMA extra server step eta_s.
  fedgma_threshold: float = fedgma_learning.DEFAULT_MASK_THRESHOLD  # FedGMA AND-mask p.

  def __post_init__(self):
    """The harness's one check of these values (docs/experiments.md#settings-and-their-one-check)."""
    checks.check_fraction(self.elastic_tau, 'elastic_tau')
    checks.check_fraction(self.elastic_mu, 'elastic_mu', high_open=True)
    checks.check_fraction(self.sensitivity_fraction, 'sensitivity_fraction', high_open=True)
    checks.check_positive_finite(self.fedgma_step_size, 'fedgma_step_size')
    checks.check_fraction(self.fedgma_threshold, 'fedgma_threshold')


@dataclasses.dataclass(frozen=True)
class AttackParams:
  """Parameters of the update attacks (`training.engine.attacks`; paper defaults), read by the harness's attacker."""
  alie_z: Optional[float] = None  # ALIE's z; None: the paper's z_max from the round's n and f.
  ipm_epsilon: float = attacks.DEFAULT_IPM_EPSILON  # IPM's epsilon.
  large_norm_scale: float = attacks.DEFAULT_LARGE_NORM_SCALE  # large_norm: multiples of the median honest norm.
  minmax_perturbation: str = attacks.DEFAULT_MINMAX_PERTURBATION  # Min-Max/Min-Sum's direction p.
  minmax_gamma_init: float = attacks.DEFAULT_MINMAX_GAMMA_INIT  # Min-Max/Min-Sum's first gamma.

  def __post_init__(self):
    """The harness's one check of these values (docs/experiments.md#settings-and-their-one-check)."""
    if self.alie_z is not None:
      checks.check_positive_finite(self.alie_z, 'alie_z')
    for field in ('ipm_epsilon', 'large_norm_scale', 'minmax_gamma_init'):
      checks.check_positive_finite(getattr(self, field), field)
    if self.minmax_perturbation not in attacks.PERTURBATIONS:
      raise ValueError(f'minmax_perturbation must be one of {attacks.PERTURBATIONS}, got {self.minmax_perturbation!r}')


_ALGORITHM = AlgorithmConfig()
_AGGREGATOR = AggregatorParams()
_METHOD = MethodParams()
_ATTACK = AttackParams()


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything that defines a run. Field names are the runner's flag names; `metadata['help']` their help."""
  dataset: str = _help('Data set (digits is embedded and offline).', 'digits')
  data_dir: Optional[str] = _help('Where the data set\'s files are (fashion_mnist: its four IDX files; TFDS/TFF: '
                                  'where they are downloaded to).', None)
  fashion_mnist_source: str = _help(
      'fashion_mnist: idx (its original IDX files in --data_dir, or without one where apt-get install '
      'dataset-fashion-mnist puts them; never the network: missing files are an error naming them) or tfds (TFDS\'s '
      'copy in --data_dir, which TFDS downloads there when it is missing: the only fashion_mnist source that may use '
      'the network).', 'idx')
  partition: str = _help('How training examples are dealt to clients.', 'iid')
  classes_per_client: int = _help('label_skew/mixed_skew: classes per client.',
                                  partition_lib.DEFAULT_CLASSES_PER_CLIENT)
  alpha: float = _help('dirichlet: label concentration (smaller = more skew).', partition_lib.DEFAULT_ALPHA)
  beta: float = _help('quantity_skew: size concentration (paper: 0.5).', partition_lib.DEFAULT_BETA)
  train_subset_fraction: float = _help(
      'In (0, 1]. < 1: train on a class-stratified subset of the training split, round(fraction * n) examples of '
      'each class of n, drawn from a fixed seed (tff_gma.data.federated.SUBSET_SEED, independent of --seed: every '
      'arm and every seed of a study cell trains on the same examples) before partitioning and colouring; the test '
      'split (and the OOD test clients) stays whole. 1: every training example.', 1.0)
  num_clients: int = _help('Clients in the federation.', 10)
  clients_per_round: int = _help('Clients sampled per round.', 10)
  rounds: int = _help('Total rounds (a resumed run continues up to this).', 20)
  local_epochs: int = _help('Client epochs per round.', 1)
  batch_size: int = _help('Client batch size.', 16)
  model: str = _help('Keras model.', 'cnn')
  algorithm: str = _help('Federated optimisation algorithm (personalized: personalized RFA, RFA paper Algorithm 4, '
                         'with --aggregator=rfa).', _ALGORITHM.name)
  client_lr: float = _help('Client SGD learning rate (momentum --client_momentum).', _ALGORITHM.client_lr)
  server_lr: float = _help('Server learning rate (SGD, or Adam/Yogi for fedadam/fedyogi).', _ALGORITHM.server_lr)
  client_momentum: float = _help('Client SGD momentum (GMA paper: 0.9).', _ALGORITHM.client_momentum)
  proximal_strength: float = _help('fedprox: proximal term mu.', _ALGORITHM.proximal_strength)
  adaptive_epsilon: float = _help('fedadam/fedyogi: epsilon (adaptivity tau).', _ALGORITHM.adaptive_epsilon)
  adaptive_optimizer: str = _help('fedadam/fedyogi: the server optimizer: reddi (Reddi et al.\'s Algorithm 2, as '
                                  'the GMA paper: no bias correction, v from tau^2) or tff (TFF\'s bias-corrected '
                                  'build_adam/build_yogi).', _ALGORITHM.adaptive_optimizer)
  client_loop: str = _help(
      'How a FedAvg-family client walks its local epochs: in_graph (its examples read once into tensors, the steps '
      'one in-graph loop over batch slices; where the model allows it, else iterator with a log line) or iterator '
      '(TFF\'s client work, DATASET_ITERATOR). Equal within float32 rounding.', _ALGORITHM.client_loop)
  aggregator: str = _help('How client updates are aggregated.', 'mean')
  tau: float = _help('gma/gma_binary: agreement threshold in [0, 1] (paper: 0.4).', _AGGREGATOR.tau)
  num_passes: int = _help('rfa: secure averages per round (paper: 3).', _AGGREGATOR.num_passes)
  smoothing: float = _help('rfa/rfa_one_step: Weiszfeld smoothing nu.', _AGGREGATOR.smoothing)
  krum_selected: Optional[int] = _help('krum: the m lowest-score updates averaged (unset: n - f; 1: classic Krum).',
                                      _AGGREGATOR.krum_selected)
  cc_clip_radius: float = _help('centered_clip: the clipping radius tau of the differences to the centre.',
                                _AGGREGATOR.cc_clip_radius)
  cc_iterations: int = _help('centered_clip: clipping iterations L, one (secure) weighted mean each.',
                             _AGGREGATOR.cc_iterations)
  bucketing: int = _help('Bucket size s (0: off): median, trimmed_mean, krum and centered_clip run on the means of '
                         'buckets of s randomly permuted clients (Karimireddy et al., 2022); collects every update at '
                         'the server (not private).', _AGGREGATOR.bucketing)
  rfa_init: str = _help('rfa: where Weiszfeld starts: the weighted mean (RFA paper) or the zero update (the current '
                        'model; pass 1 is then one-step RFA).', _AGGREGATOR.rfa_init)
  secure: bool = _help('Aggregate the float sums through secure sums too (the model aggregator\'s, FedGMA\'s gradient '
                       'mean, clip_mean/zeroing_mean\'s norm estimate and count; median, trimmed_mean and krum refuse '
                       'it).', _AGGREGATOR.secure)
  secure_bound: Optional[float] = _help('Per-coordinate clipping bound of secure float sums (required with '
                                        '--secure).', _AGGREGATOR.secure_bound)
  secure_metrics: bool = _help('Aggregate training metrics with secure sums.', False)
  eval_every: int = _help('Evaluate every this many rounds (and at the last).', 1)
  eval_last_rounds: int = _help('Also evaluate every one of the last this many rounds (e.g. 10 for a last-10 '
                                 'mean of consecutive rounds with a sparse eval_every).', 0)
  participation_eval: bool = _help('Evaluations also score the global model on this round\'s participating vs the '
                                   'other clients\' training data (GMA paper Table 4; with many clients the costliest '
                                   'part of an evaluation).', True)
  seed: int = _help('Seed of the partition, initial model, client sampling and data order.', 0)
  output_dir: str = _help('Output directory (reused to resume).', 'outputs/run')
  checkpoint_every: int = _help(
      'Save the state, and write the rounds\' metrics.csv/TensorBoard rows, after every this many rounds and after '
      'the last (and when training stops). A run killed in between (even by SIGKILL) loses at most this many '
      'rounds: it resumes from its newest checkpoint, trains them again and ends bit-identical to an uninterrupted '
      'run. Changes what an interruption costs, never what a run computes.', 10)
  max_frozen_rounds: int = _help(
      'Stop the run (one error line, exit 1; its rows written, summary.json saying why) once its model has not '
      'changed, bit for bit, for this many rounds in a row: an aggregator that returns no update trains nothing '
      'while the metrics look calm. 0: never stop. Default 5: one round may leave the model where it was (every '
      'client dropped, a GMA binary mask zeroing every coordinate), five in a row do not happen in a run that '
      'trains (as the stop after 5 non-finite updates). Changes when a stuck run stops, never what a round computes.',
      5)
  audit: bool = _help('Write audit.md: the privacy audit of the round computation.', False)
  corruption: str = _help('Simulated corruption of a fixed seeded set of clients: poisoned data (data_negate: '
                          'x -> 1 - x; data_flip_labels: y -> C - 1 - y) or updates (gaussian noise; omniscient: '
                          'the mean negated; alie, ipm, sign_flip, mimic, large_norm, zero_update, min_max, '
                          'min_sum: the literature\'s attacks, docs/methods.md#attacks).', 'none')
  corrupt_fraction: float = _help('rho: round(rho * num_clients) clients are corrupted (trimmed_mean and krum are '
                                  'told rho).', _AGGREGATOR.corrupt_fraction)
  alie_z: Optional[float] = _help('alie: the attack\'s z (every attacker sends mu - z * sigma); unset: the paper\'s '
                                  'z_max = Phi^-1((n - s) / n), s = floor(n / 2 + 1) - f, from the round\'s n '
                                  'participants and f corrupted ones.', _ATTACK.alie_z)
  ipm_epsilon: float = _help('ipm: every attacker sends -epsilon times the honest mean (paper: 0.1 against '
                             'median-type rules).', _ATTACK.ipm_epsilon)
  large_norm_scale: float = _help('large_norm: the attack\'s norm in multiples of the median honest update norm, '
                                  'along the negated honest mean.', _ATTACK.large_norm_scale)
  minmax_perturbation: str = _help('min_max/min_sum: the perturbation direction p of mu + gamma * p: unit_vec '
                                   '(-mu / ||mu||), std (-sigma, the paper\'s best) or sign (-sign(mu)).',
                                   _ATTACK.minmax_perturbation)
  minmax_gamma_init: float = _help('min_max/min_sum: the halving search\'s first gamma (paper: 10).',
                                   _ATTACK.minmax_gamma_init)
  workers: Optional[str] = _help('host:port,... (or unix:/path,...) of TFF workers to split clients over '
                                 '(python -m tff_gma.worker).', None)
  first_round_deadline_s: float = _help(
      'Seconds the first round a process runs (TFF compiles it) and the initial state may take in the TFF workers '
      'before the run ends in one line naming the round and the worker that does not answer (stopped, hung, or a '
      'listener that never answers); rerunning resumes from the last checkpoint. 0: no deadline on any call.',
      3600.0)
  round_deadline_factor: float = _help(
      'Each later round may take this many times the slowest round so far (at least --min_round_deadline_s) '
      'before the run ends as above.', 10.0)
  min_round_deadline_s: float = _help('The least deadline of a round after the first (seconds).', 300.0)
  rfa_weight_bound: Optional[float] = _help(
      'rfa: warn when one client\'s normalized RFA weight exceeds this (simulation-only audit; logs rfa_audit/* per '
      'round; trains the round\'s clients twice).', None)
  membership_inference: bool = _help('Attack the final model with a membership-inference attacker; writes '
                                     'membership.json.', False)
  validation_fraction: float = _help(
      'In [0, 1). > 0: each client holds out this share of its examples (seeded); evaluations are on the pooled '
      'held-out examples (validation/*) and never on the test split, for tuning.', 0.0)
  client_execution: str = _help('Where clients train: worker (the TFF worker, CPU only) or local (this process\'s '
                                'TensorFlow: its GPUs round-robin, else its CPU; aggregation stays in the worker; '
                                'FedAvg family only).', 'worker')
  dataset_placement: str = _help(
      'Where each round\'s client datasets are built: worker (the TFF worker builds them from files written once, '
      'so a round sends a file name and a seed per client; where it applies, else driver with a log line) or '
      'driver (this process builds and sends them every round, examples included). Same results either way.',
      'worker')
  worker_intra_op_threads: int = _help(
      'TensorFlow intra-op threads of the TFF worker the runner starts (0: TensorFlow\'s default, one per core; '
      'not --workers\' workers). Faster at 1 (the worker runs the round\'s clients side by side); results differ '
      'in the last bits between counts, as between machines with other core counts under the default.',
      runtime_defaults.DEFAULT_INTRA_OP_THREADS)
  elastic_tau: float = _help('elastic: aggregation threshold tau.', _METHOD.elastic_tau)
  elastic_mu: float = _help('elastic: momentum of the parameter sensitivity.', _METHOD.elastic_mu)
  sensitivity_fraction: float = _help('elastic: share of a client\'s batches that estimate the sensitivity.',
                                      _METHOD.sensitivity_fraction)
  fedgma_step_size: float = _help('fedgma: the extra server step eta_s along the AND-masked gradient.',
                                  _METHOD.fedgma_step_size)
  fedgma_threshold: float = _help('fedgma: the AND-mask threshold p.', _METHOD.fedgma_threshold)

  def algorithm_config(self) -> AlgorithmConfig:
    # The composed algorithms (FedGMA, SCAFFOLD, personalized RFA) use FedAvg's client and server optimizers.
    return AlgorithmConfig(
        name=self.algorithm if self.algorithm in FEDAVG_FAMILY else 'fedavg',
        client_lr=self.client_lr, server_lr=self.server_lr,
        client_momentum=self.client_momentum, proximal_strength=self.proximal_strength,
        adaptive_epsilon=self.adaptive_epsilon, adaptive_optimizer=self.adaptive_optimizer,
        client_loop=self.client_loop)

  def aggregator_params(self) -> AggregatorParams:
    return AggregatorParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(AggregatorParams)})

  def attack_params(self) -> AttackParams:
    return AttackParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(AttackParams)})

  def method_params(self) -> MethodParams:
    return MethodParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MethodParams)})

  def partition_kwargs(self) -> dict[str, Any]:
    """The partition keyword arguments that apply to the chosen partition."""
    names = [k for k, parts in federated.PARTITION_KWARGS.items() if self.partition in parts]
    return {k: getattr(self, k) for k in names if hasattr(self, k)}
