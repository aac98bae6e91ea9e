"""No method setting is silently dropped: for every (algorithm, aggregator, setting) the runner offers, the setting
at a valid non-default value either changes what the method computes or is refused by `experiment.validate`.

"Changes the computation" is checked where the setting is read, against the default build (memoized), cheaply:
* a model aggregator: its `tff` factory's `initialize` and `next` computations (`_canonical`: intrinsics, literals
  and TF ops with their constants, free of TF's per-process names, which make raw serializations differ);
* a composed algorithm or Elastic: the arguments the registry passes to the `tff_gma.learning` builder (optimizers
  by their kind and initial state, hyperparameters included), caught by a spy, since a process build costs seconds;
  the library's own tests check that the builders honour them, and `test_secure_fedgma_...` builds one;
* a FedAvg-family algorithm: the client and server optimizers and FedProx's mu that `fedavg_family` builds it from.
An algorithm's settings are checked with the `median` model aggregator, which reads none, so that what changes is
the algorithm's own use (FedGMA's `secure` makes its gradient mean secure: the model aggregator's secure mean does
not count). Refusals are checked by `experiment.validate`, without building a process.

The enumeration walks `registry.SETTINGS` (every field of the three method dataclasses but the algorithm's name and
`client_loop`) and `registry.check`'s valid pairs, so a new setting or record is covered with no edit here (a new
setting needs its non-default value in `NON_DEFAULT`, which the first test asks for).
"""

import collections
import dataclasses
import functools
import glob
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow.core.framework import graph_pb2

from tff_gma import models
from tff_gma.data import loaders
from training import config as config_lib
from training import demo
from training.bench import candidates as bench_candidates
from training.bench import presets as bench_presets
from training.engine import corruption as corruption_lib
from training.engine import fedavg_family
from training.engine import methods
from training.engine import registry
from training.runner import experiment
from training.studies import gma as gma_study
from training.studies import gma_fmnist
from training.studies import rfa as rfa_study

# A valid value other than the default, per setting. secure=True needs a bound: _changes adds secure_bound.
NON_DEFAULT = {
    'client_lr': 0.07, 'server_lr': 0.5, 'client_momentum': 0.0, 'proximal_strength': 0.1, 'adaptive_epsilon': 0.01,
    'adaptive_optimizer': 'tff', 'tau': 0.2, 'num_passes': 2, 'smoothing': 1e-3, 'rfa_init': 'mean', 'secure': True,
    'secure_bound': 2.0, 'corrupt_fraction': 0.2, 'elastic_tau': 0.3, 'elastic_mu': 0.8, 'sensitivity_fraction': 0.2,
    'fedgma_step_size': 0.3, 'fedgma_threshold': 0.6, 'krum_selected': 1, 'cc_clip_radius': 2.0, 'cc_iterations': 2,
    'bucketing': 2,
}
SECURE = {'secure': True, 'secure_bound': 1.0}
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAIRS = []
for _algorithm in registry.ALGORITHMS:
  for _aggregator in registry.AGGREGATORS:
    try:
      registry.check(_algorithm, _aggregator)
    except ValueError:
      continue
    PAIRS.append((_algorithm, _aggregator))


def _changes(name: str) -> dict:
  """The settings that set `name` to its non-default value (secure with a bound; secure_bound with secure)."""
  if name == 'secure':
    return dict(SECURE)
  if name == 'secure_bound':
    return {**SECURE, 'secure_bound': NON_DEFAULT['secure_bound']}
  return {name: NON_DEFAULT[name]}


def _base(name: str) -> dict:
  """What the change of `name` is compared with: the defaults, or secure with its first bound for secure_bound."""
  return dict(SECURE) if name == 'secure_bound' else {}


def _parts(settings: dict):
  """(AlgorithmConfig, AggregatorParams, MethodParams) with `settings` over the defaults."""
  return tuple(cls(**{k: v for k, v in settings.items() if k in {f.name for f in dataclasses.fields(cls)}})
               for cls in (config_lib.AlgorithmConfig, config_lib.AggregatorParams, config_lib.MethodParams))


def _canonical(*computations) -> tuple:
  """What the computations compute, free of the names TF numbers per process (`cond_true_79`): for each, the
  multiset of its intrinsics, literals and the ops of its TensorFlow graphs (functions included), each constant with
  its value. Two builds of one factory give the same; a changed constant, op or intrinsic shows."""
  fingerprints = []
  for computation in computations:
    counts = collections.Counter()

    def add_graph(graph):
      for node in list(graph.node) + [n for f in graph.library.function for n in f.node_def]:
        value = node.attr['value'].tensor.SerializeToString(deterministic=True) if node.op == 'Const' else b''
        counts[(node.op, value)] += 1

    def walk(message):
      for field, value in message.ListFields():
        if field.message_type is None:
          continue
        for item in (value if field.label == field.LABEL_REPEATED else [value]):
          if field.message_type.full_name == 'google.protobuf.Any':
            graph = graph_pb2.GraphDef()
            if item.Unpack(graph):
              add_graph(graph)
          elif field.name == 'intrinsic':
            counts[('intrinsic', item.uri)] += 1
          elif field.name == 'literal':  # A constant outside TensorFlow (e.g. a federated_value's).
            counts[('literal', item.SerializeToString(deterministic=True))] += 1
          else:
            walk(item)

    walk(tff.framework.serialize_computation(computation))
    fingerprints.append(tuple(sorted(counts.items())))
  return tuple(fingerprints)


@functools.lru_cache(maxsize=None)
def _factory_fingerprint(aggregator: str, settings: tuple) -> tuple:
  factory = registry.build(aggregator, _parts(dict(settings))[1])
  process = factory.create(tff.types.TensorType(np.float32, [5]), tff.types.TensorType(np.float32))
  return _canonical(process.initialize, process.next)


def _normalized(value):
  """A comparable form of a library builder's argument: an optimizer by its kind and initial state (hyperparameters
  included), a factory by its kind, a callable by nothing (the model function is the same), the rest as is."""
  if isinstance(value, tff.learning.optimizers.Optimizer):
    state = value.initialize((tf.TensorSpec([2], tf.float32),))
    return type(value).__name__, repr(tf.nest.map_structure(lambda v: np.asarray(v).tolist(), state))
  if isinstance(value, tff.aggregators.WeightedAggregationFactory):
    return type(value).__name__
  if callable(value):
    return 'callable'
  return value


class _Built(Exception):
  pass


@functools.lru_cache(maxsize=None)
def _process_fingerprint(algorithm: str, aggregator: str, settings: tuple) -> tuple:
  """What the composed learning process is built from: the normalized arguments of the `tff_gma.learning` builder
  the registry calls (a process build costs seconds; the library's own tests check that it honours them)."""
  algorithm_config, aggregator_params, method_params = _parts(dict(settings))
  seen = []

  def spy(*args, **kwargs):
    seen.append((tuple(_normalized(a) for a in args), tuple(sorted((k, _normalized(v)) for k, v in kwargs.items()))))
    raise _Built()

  with pytest.MonkeyPatch.context() as patch:
    for name in ('build_fedgma', 'build_scaffold', 'build_personalized_rfa', 'build_elastic_fed_avg'):
      patch.setattr(f'tff_gma.learning.{name}', spy)
    with pytest.raises(_Built):
      methods.build(lambda: None, algorithm, aggregator, algorithm_config=algorithm_config,
                    aggregator_params=aggregator_params, method_params=method_params, num_clients=4)
  return tuple(seen)


def _family_fingerprint(algorithm: str, settings: tuple) -> tuple:
  """What `fedavg_family` builds a FedAvg-family process from: its client and server optimizers, FedProx's mu."""
  algorithm_config = dataclasses.replace(_parts(dict(settings))[0], name=algorithm)
  return (_normalized(fedavg_family.client_optimizer(algorithm_config)),
          _normalized(fedavg_family.server_optimizer(algorithm_config)),
          fedavg_family.proximal_strength(algorithm_config))


def _fingerprint(record_kind: str, record: str, settings: dict) -> tuple:
  """The built object that reads the settings of `record` (module docstring)."""
  key = tuple(sorted(settings.items()))
  if record_kind == 'aggregator':
    if registry.aggregator(record).kind == registry.MODEL_AGGREGATOR:
      return _factory_fingerprint(record, key)
    return _process_fingerprint(registry.aggregator(record).algorithms[0], record, key)
  if registry.algorithm(record).kind == registry.FEDAVG_FAMILY:
    return _family_fingerprint(record, key)
  return _process_fingerprint(record, 'median', key)


def test_every_setting_has_a_non_default_value_and_median_reads_none():
  assert set(NON_DEFAULT) == set(registry.SETTINGS)
  assert all(NON_DEFAULT[name] != registry.DEFAULTS[name] for name in registry.SETTINGS)
  # The algorithms' settings are checked with it; bucketing, its one setting, is no algorithm's.
  assert registry.aggregator('median').reads == ('bucketing',)


@pytest.mark.parametrize('aggregator', registry.MODEL_AGGREGATORS)
def test_factory_fingerprints_are_deterministic(aggregator):
  """Two builds of a factory give one fingerprint (else every comparison below would see a change)."""
  factory = registry.build(aggregator).create(tff.types.TensorType(np.float32, [5]), tff.types.TensorType(np.float32))
  assert _canonical(factory.initialize, factory.next) == _factory_fingerprint(aggregator, ())


@pytest.mark.parametrize('name', registry.SETTINGS)
def test_each_setting_changes_the_computation_or_is_refused(name, tmp_path):
  changed, base = _changes(name), _base(name)
  checked = set()
  for algorithm, aggregator in PAIRS:
    config = config_lib.ExperimentConfig(algorithm=algorithm, aggregator=aggregator,
                                         output_dir=str(tmp_path / 'never'), **changed)
    try:
      experiment.validate(config)
    except experiment.ConfigError as e:
      message = str(e)
      assert message.startswith(f'{name}:') or (name == 'secure_bound' and message.startswith('secure:')), message
      assert algorithm in message and aggregator in message, message
      assert '\n' not in message
      continue
    assert not (tmp_path / 'never').exists()
    readers = [('algorithm', algorithm)] * (name in registry.algorithm(algorithm).reads)
    readers += [('aggregator', aggregator)] * (name in registry.aggregator(aggregator).reads)
    assert readers, f'{algorithm}/{aggregator} accepts {name}={changed[name]!r} and no record reads it'
    for reader in readers:
      if reader not in checked:  # Memoized by the record that reads it.
        checked.add(reader)
        assert _fingerprint(*reader, changed) != _fingerprint(*reader, base), (
            f'{name}={changed[name]!r} is accepted by {reader} and changes nothing')


def test_corrupt_fraction_is_the_corruption_level_under_any_corruption(tmp_path):
  for algorithm, aggregator in PAIRS:
    experiment.validate(config_lib.ExperimentConfig(
        algorithm=algorithm, aggregator=aggregator, corruption='data_negate', corrupt_fraction=0.2,
        output_dir=str(tmp_path / 'never')))
  assert corruption_lib.num_corrupted(10, 0.2) == 2 and corruption_lib.num_corrupted(10, 0.0) == 0


def test_scaffold_momentum_fedgma_secure_and_clipping_secure_reach_the_computation():
  """The three settings issue 36 found dropped, named outright (the enumeration above covers them too)."""
  momentum = {'client_momentum': 0.0}
  assert _fingerprint('algorithm', 'scaffold', momentum) != _fingerprint('algorithm', 'scaffold', {})
  assert _fingerprint('algorithm', 'fedgma', SECURE) != _fingerprint('algorithm', 'fedgma', {})
  for aggregator in ('clip_mean', 'zeroing_mean'):
    assert _fingerprint('aggregator', aggregator, SECURE) != _fingerprint('aggregator', aggregator, {})


def test_flagfiles_studies_demo_and_bench_set_only_what_their_methods_read(tmp_path):
  never = str(tmp_path / 'never')
  for path in sorted(glob.glob(os.path.join(_ROOT, 'configs', '*.flags'))):
    config = rfa_study.read_flagfile(path)
    experiment.validate(dataclasses.replace(config, output_dir=never, data_dir=None))
  # The RFA study's cells: each aggregator (with its NAME+setting entries) at each corruption level.
  for cell in rfa_study.cells(list(rfa_study.BASE_CONFIGS), rfa_study.CORRUPTIONS, (0.0, 0.25), rfa_study.AGGREGATORS
                              + ('rfa+rfa_init=mean', 'rfa+num_passes=5'), (0,)):
    experiment.validate(rfa_study.cell_config(cell, 2, 1, never))
  # The studies' AVG and GMA arms from shared settings: every method of every setting, at a GMA tau of the grid.
  for setting_name, setting in gma_study.SETTINGS.items():
    for algorithm, aggregator in setting.methods:
      run = gma_study.Run(setting_name, algorithm, aggregator, 0.05, 1.0, gma_study.STAGE1_TAU, 0, True)
      experiment.validate(dataclasses.replace(gma_study.run_config(run, never), output_dir=never))
  study = gma_fmnist.Study(list(gma_fmnist.SETTINGS), (), (0,), (0,), never)
  for setting_name, setting in gma_fmnist.SETTINGS.items():
    for algorithm, aggregator in setting.methods:
      run = gma_fmnist.Run(setting_name, algorithm, aggregator, 0.05, 1.0, 0.4, 0, True)
      config = study.config(run)
      registry.check_settings(algorithm, aggregator, registry.settings_of(config), config.corruption)
  # The demo's methods with their hyperparameters; the benchmark's default entries.
  study_json = os.path.join(_ROOT, 'docs', 'research', 'gma_study.json')
  chosen = demo.choose_hyperparameters(demo.DEFAULT_METHODS, study_json, True)
  for name, hyperparameters in chosen.items():
    registry.check_settings(*registry.resolve(name),
                            registry.settings_of(hyperparameters.algorithm_config, hyperparameters.params))
  for entry in bench_presets.AGGREGATORS:
    bench_candidates.parse_candidate(entry)  # Refuses an entry whose settings its method does not read.
  with pytest.raises(ValueError, match="'median\\+secure': secure: aggregator 'median'"):
    bench_candidates.parse_candidate('median+secure')


@pytest.mark.parametrize('aggregator', ['clip_mean', 'zeroing_mean'])
def test_secure_clipping_and_zeroing_compute_the_plain_result_through_secure_sums(aggregator):
  """--secure keeps what TFF's clipping/zeroing computes (to the secure mean's quantization) over two rounds, the
  norm estimate included, and leaves no plain float sum of client values: TFF's norm estimate and count go through
  secure sums."""
  value_type, weight_type = tff.types.TensorType(np.float32, [5]), tff.types.TensorType(np.float32)
  rng = np.random.default_rng(0)
  # Inside secure_bound (1), where the secure mean clips nothing; the third client's norm is above clip_mean's
  # starting estimate (1), so clipping acts.
  values = [np.clip(rng.normal(scale=s, size=5), -0.99, 0.99).astype(np.float32) for s in (0.1, 0.3, 0.9)]
  weights = [np.float32(w) for w in (3.0, 1.0, 2.0)]
  results = {}
  for secure in (False, True):
    process = registry.build(aggregator, config_lib.AggregatorParams(secure=secure, secure_bound=1.0 if secure else
                                                                     None)).create(value_type, weight_type)
    state, outputs = process.initialize(), []
    for _ in range(2):
      output = process.next(state, values, weights)
      state = output.state
      outputs.append(np.asarray(output.result))
    results[secure] = outputs
    intrinsics = {uri for (kind, uri), _ in _canonical(process.next)[0] if kind == 'intrinsic'}
    plain_sums = intrinsics & {'federated_sum', 'federated_mean', 'federated_weighted_mean'}
    assert bool(plain_sums) != secure, intrinsics  # The plain build has them (so the names are TFF's).
  for plain, secure in zip(results[False], results[True]):
    np.testing.assert_allclose(secure, plain, atol=1e-5)
  if aggregator == 'clip_mean':  # The norm bound acts.
    assert not np.allclose(results[False][0], np.average(values, axis=0, weights=weights))


@pytest.mark.parametrize('algorithm', ['fedgma', 'scaffold'])
def test_secure_composed_methods_move_no_float_through_a_plain_sum(algorithm):
  """--secure: FedGMA's AND-masked gradient mean and SCAFFOLD's control variates' mean are secure too (before, only
  their model aggregator's mean was)."""
  data = loaders.load_federated_data('digits', 'iid', 3, 0)
  model_fn = models.model_fn(models.keras_builder('logistic', data.input_shape, data.num_classes), data.input_spec)
  process = methods.build(model_fn, algorithm, 'mean', aggregator_params=config_lib.AggregatorParams(**SECURE),
                          metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize, num_clients=3).process
  intrinsics = {uri for (kind, uri), _ in _canonical(process.next)[0] if kind == 'intrinsic'}
  assert 'federated_secure_sum_bitwidth' in intrinsics
  assert not intrinsics & {'federated_sum', 'federated_mean', 'federated_weighted_mean'}, intrinsics


@pytest.mark.parametrize('momentum, refused', [(0.9, True), (0.0, False)])
def test_a_scaffold_run_from_before_momentum_counted_does_not_resume_with_it(tmp_path, momentum, refused):
  """Such a run (config.json without adaptive_optimizer, the setting of the same change) trained plain SGD."""
  config = config_lib.ExperimentConfig(algorithm='scaffold', client_momentum=momentum, output_dir=str(tmp_path))
  old = {k: v for k, v in dataclasses.asdict(config).items() if k != 'adaptive_optimizer'}
  (tmp_path / experiment.CONFIG_FILE).write_text(json.dumps(old))
  if refused:
    with pytest.raises(experiment.ConfigError, match='SCAFFOLD clients ignored --client_momentum'):
      experiment.check_resumable(config)
  else:
    experiment.check_resumable(config)


@pytest.mark.parametrize('aggregator', ['trimmed_mean', 'krum'])
def test_robust_baselines_refuse_half_the_clients_corrupt_naming_the_flag(tmp_path, aggregator):
  """Their library factories take a corruption level below one half: the run's validation refuses 0.5 in one line
  naming --corrupt_fraction (`Aggregator.upper_bounds`), not the library argument's name at build time."""
  config = config_lib.ExperimentConfig(aggregator=aggregator, corrupt_fraction=0.5, output_dir=str(tmp_path / 'never'))
  with pytest.raises(experiment.ConfigError) as refused:
    experiment.validate(config)
  message = str(refused.value)
  assert message.startswith(f"corrupt_fraction: aggregator '{aggregator}' ") and '\n' not in message, message
  assert message.endswith('must lie below 0.5, got 0.5 (algorithm=fedavg)'), message
  experiment.validate(dataclasses.replace(config, corrupt_fraction=0.49))
  with pytest.raises(ValueError, match=r'\[0, 0\.5\)'):  # The bound is the library's own.
    registry.build(aggregator, config_lib.AggregatorParams(corrupt_fraction=0.5))
  registry.build(aggregator, config_lib.AggregatorParams(corrupt_fraction=0.49))
