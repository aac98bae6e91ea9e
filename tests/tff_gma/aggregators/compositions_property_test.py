"""Property tests (hypothesis): every public factory, with every inner mean, against independent NumPy references.

For each public factory of `tff_gma.aggregators` (GMA weighted and unweighted, RFA weighted and unweighted, Elastic,
FedGMA, the two weighted means, and `as_unweighted` of each weighted one), hypothesis draws a configuration (the
inner mean where the factory takes one, from TFF's and this library's weighted means; the value structure and
dtype; the weight dtype; the factory's own arguments) and the round's data (1-20 clients; weights zero, integer,
from 1e-6 to 1e6; values large, tiny, identical across clients, sign-balanced, with outliers), runs the first
`next` call and checks the result against `tests/methods_reference/factories_reference.py`: inside the reference's
sound enclosure (its float rounding and quantization bounded, RFA's passes propagated as boxes), or the documented
degenerate outcome with its measurement (`nonfinite_result`, `zero_result`, `nonfinite_passes`), and always finite.

Cost: building a process (and its first call, which compiles it) takes 1-20 s, a later call 10-300 ms, so the
processes are cached per configuration (`_PROCESSES`) and the configurations are a fixed list per factory that covers
every pair of argument values (`pairwise`), of which a run uses the first `_num_configs(examples)`. The fast tier
runs `FAST_EXAMPLES` examples per factory on cheap configurations; the slow tier `TFF_GMA_PROPERTY_EXAMPLES`
(default 50) per factory. `TFF_GMA_PROPERTY_COLLECT=1` records failures instead of raising them (a long run that
reports every kind of failure), `TFF_GMA_PROPERTY_STATS=path.json` writes what ran (examples, outcomes, enclosure
widths, times, failures with reproducers and their data), `TFF_GMA_PROPERTY_CONFIGS` overrides how many
configurations a run uses, and `TFF_GMA_PROPERTY_CHUNKS` / `TFF_GMA_PROPERTY_KINDS` split a long run into chunks of
examples with seeds of their own, taken factory by factory, over the factories named. A known library issue goes in
`KNOWN_ISSUES` (its examples rejected from the properties) with a strict-xfail reproducer, so that a fix shows as an
XPASS; none is open. The issues found so far have regression tests at the end of the module.
"""

import collections
import dataclasses
import itertools
import json
import math
import os
import random
import time
from typing import Any, Callable, Optional

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests.methods_reference import factories_reference as fr
from tests.methods_reference import inner_means as im
from tff_gma import aggregators

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
BF16 = np.dtype(tf.bfloat16.as_numpy_dtype)

FAST_EXAMPLES = 10
SLOW_EXAMPLES = int(os.environ.get('TFF_GMA_PROPERTY_EXAMPLES', '50'))
COLLECT = os.environ.get('TFF_GMA_PROPERTY_COLLECT', '') == '1'
STATS_PATH = os.environ.get('TFF_GMA_PROPERTY_STATS', '')
# A long run split into chunks of SLOW_EXAMPLES / CHUNKS examples, each with its own seed, run chunk by chunk over the
# factories (so that every factory gets as many chunks as the time allows); KINDS_ENV restricts the factories.
CHUNKS = int(os.environ.get('TFF_GMA_PROPERTY_CHUNKS', '1'))
KINDS_ENV = os.environ.get('TFF_GMA_PROPERTY_KINDS', '')

# ----------------------------------------------------------------------------------------------------------------
# Value structures: a single tensor (vector or scalar), or a struct of two tensors; one dtype, or two ('mixed').

STRUCTURES = {'vector': ((3,),), 'scalar': ((),), 'pair': ((2,), (2, 2))}
DTYPES = {'float32': (F32,), 'float64': (F64,), 'float16': (F16,), 'bfloat16': (BF16,), 'mixed': (F32, F64)}
BOUNDS = {'tight': (10.0, 100.0), 'wide': (3e4, 2e6)}  # (value_bound, weight_bound) of the secure means.


def part_layout(structure: str, dtype: str) -> im.Layout:
  shapes = STRUCTURES[structure]
  dtypes = DTYPES[dtype] if len(DTYPES[dtype]) == len(shapes) else DTYPES[dtype] * len(shapes)
  return im.Layout(shapes, tuple(dtypes))


def part_type(structure: str, layout: im.Layout):
  leaves = [tff.TensorType(d, s) for s, d in zip(layout.shapes, layout.dtypes)]
  if structure == 'pair':
    return tff.to_type(collections.OrderedDict(a=leaves[0], b=leaves[1]))
  return leaves[0]


def part_value(structure: str, layout: im.Layout, flat: np.ndarray):
  leaves = [np.asarray(flat[sl].reshape(shape), dtype) for sl, shape, dtype in
            zip(layout.slices, layout.shapes, layout.dtypes)]
  if structure == 'pair':
    return collections.OrderedDict(a=leaves[0], b=leaves[1])
  return leaves[0]


def part_flat(structure: str, value) -> np.ndarray:
  leaves = [value['a'], value['b']] if structure == 'pair' else [value]
  return np.concatenate([np.ravel(np.asarray(x).astype(np.float64)) for x in leaves])


PAIRED_FIELDS = {'elastic': ('update', 'sensitivity'), 'fedgma': ('update', 'gradient')}


@dataclasses.dataclass(frozen=True)
class ValueSpec:
  """How a factory's client values are built from a flat [n] row: one part, or two parts side by side."""
  structure: str
  part: im.Layout
  fields: Optional[tuple[str, str]] = None  # Elastic's and FedGMA's two fields.

  @property
  def layout(self) -> im.Layout:
    if self.fields is None:
      return self.part
    return im.Layout(self.part.shapes * 2, self.part.dtypes * 2)

  @property
  def type(self):
    if self.fields is None:
      return part_type(self.structure, self.part)
    t = part_type(self.structure, self.part)
    return tff.to_type(collections.OrderedDict([(self.fields[0], t), (self.fields[1], t)]))

  def value(self, flat: np.ndarray):
    if self.fields is None:
      return part_value(self.structure, self.part, flat)
    n = self.part.n
    return collections.OrderedDict([(self.fields[0], part_value(self.structure, self.part, flat[:n])),
                                    (self.fields[1], part_value(self.structure, self.part, flat[n:]))])


# ----------------------------------------------------------------------------------------------------------------
# Configurations: every pair of argument values, greedily (AETG-style), the inner means first.

INNERS = im.INNER_NAMES
WEIGHT_DTYPES = ('float32', 'float64', 'int32', 'int64')


def _valid(config: dict) -> bool:
  """Whether a (partial) configuration is possible: 'mixed' dtypes need a two-tensor structure, one-step RFA one
  pass."""
  if config.get('dtype') == 'mixed' and 'structure' in config and config['structure'] != 'pair':
    return False
  if config.get('init') == 'one_step' and 'passes' in config and config['passes'] != 1:
    return False
  return True


def pairwise(dims: dict, first: str, seed: int = 0, candidates: int = 30) -> list[dict]:
  """Configurations covering every possible pair of values of two dimensions.

  The first len(dims[first]) configurations take each value of `first` in turn (so a run that uses only a few still
  covers the inner means first); each further one holds the first uncovered pair (in a fixed order) and is the best,
  by the number of uncovered pairs it covers, of `candidates` random completions. Deterministic: a seeded generator
  and sorted pairs (no set iteration order, which string hashing would make vary between processes)."""
  names = list(dims)
  rng = random.Random(seed)

  def pairs(config):
    return {(a, repr(config[a]), b, repr(config[b])) for a, b in itertools.combinations(names, 2)}

  def completion(fixed):
    while True:
      config = {name: fixed[name] if name in fixed else rng.choice(dims[name]) for name in names}
      if _valid(config):
        return config

  uncovered = {(a, repr(va), b, repr(vb)) for a, b in itertools.combinations(names, 2)
               for va in dims[a] for vb in dims[b] if _valid({a: va, b: vb})}
  values = {(name, repr(v)): v for name in names for v in dims[name]}
  chosen = []
  for value in dims[first]:
    best = max((completion({first: value}) for _ in range(candidates)), key=lambda c: len(pairs(c) & uncovered))
    chosen.append(best)
    uncovered -= pairs(best)
  while uncovered:
    a, va, b, vb = min(uncovered)
    fixed = {a: values[(a, va)], b: values[(b, vb)]}
    best = max((completion(fixed) for _ in range(candidates)), key=lambda c: len(pairs(c) & uncovered))
    chosen.append(best)
    uncovered -= pairs(best)
  return chosen


STRUCTURE_DIM = ('vector', 'pair', 'scalar')
DIMS = {
    'gma': dict(inner=('default', 'default_secure') + INNERS, mask=('soft', 'binary'), tau=(0.4, 0.0, 1.0, 0.5),
                bounds=tuple(BOUNDS), structure=STRUCTURE_DIM, dtype=('float32', 'float64', 'mixed'),
                weight_dtype=WEIGHT_DTYPES),
    'rfa': dict(inner=('default',) + INNERS, init=('zero', 'mean', 'one_step'), passes=(1, 2, 3),
                secure=(False, True), bounds=tuple(BOUNDS), smoothing=(1e-6, 1e-2), ratio=(1e3, 10.0),
                structure=STRUCTURE_DIM, dtype=('float32', 'float64', 'float16', 'bfloat16', 'mixed'),
                weight_dtype=WEIGHT_DTYPES),
    'elastic': dict(secure=(False, True), tau=(0.5, 0.0, 2.0), bounds=tuple(BOUNDS), structure=STRUCTURE_DIM,
                    dtype=('float32', 'float64', 'mixed'), weight_dtype=WEIGHT_DTYPES),
    'fedgma': dict(inner=('default',) + INNERS, step=(0.1, 0.0, 1.0), p=(0.8, 0.5, 1.0, 0.6), secure=(False, True),
                   bounds=tuple(BOUNDS), structure=STRUCTURE_DIM, dtype=('float32', 'float64', 'mixed'),
                   weight_dtype=WEIGHT_DTYPES),
    'federated_mean': dict(structure=STRUCTURE_DIM, dtype=('float32', 'float64', 'mixed'), weight_dtype=WEIGHT_DTYPES),
    'secure_weighted_mean': dict(bounds=tuple(BOUNDS), structure=STRUCTURE_DIM, dtype=('float32', 'float64', 'mixed'),
                                 weight_dtype=WEIGHT_DTYPES),
}
# The first key of each factory's dims whose values the first configurations take in turn.
FIRST = {'gma': 'inner', 'rfa': 'inner', 'fedgma': 'inner', 'elastic': 'secure', 'federated_mean': 'weight_dtype',
         'secure_weighted_mean': 'bounds'}

# The public factories: (name, base factory, how it is used).
KINDS = {
    'gma': ('gma', 'weighted'),
    'gma_unweighted': ('gma', 'unweighted_class'),
    'rfa': ('rfa', 'weighted'),
    'rfa_unweighted': ('rfa', 'unweighted_class'),
    'elastic': ('elastic', 'weighted'),
    'fedgma': ('fedgma', 'weighted'),
    'federated_mean': ('federated_mean', 'weighted'),
    'secure_weighted_mean': ('secure_weighted_mean', 'weighted'),
    'as_unweighted_gma': ('gma', 'as_unweighted'),
    'as_unweighted_rfa': ('rfa', 'as_unweighted'),
    'as_unweighted_elastic': ('elastic', 'as_unweighted'),
    'as_unweighted_fedgma': ('fedgma', 'as_unweighted'),
    'as_unweighted_federated_mean': ('federated_mean', 'as_unweighted'),
    'as_unweighted_secure_weighted_mean': ('secure_weighted_mean', 'as_unweighted'),
}


def configurations(kind: str) -> list[dict]:
  base, use = KINDS[kind]
  dims = dict(DIMS[base])
  if use != 'weighted':
    dims['weight_dtype'] = ('float32',)  # Unweighted: weight 1 (float32) for every client.
  return pairwise(dims, FIRST[base] if FIRST[base] in dims and len(dims[FIRST[base]]) > 1 else 'structure')


# Cheap configurations for the fast tier (no TFF secure or robust wrappers: their processes take 5-20 s to build).
_FAST = {
    'gma': [dict(inner='default', mask='soft', tau=0.4, bounds='tight', structure='pair', dtype='float32',
                 weight_dtype='int32'),
            dict(inner='tff_mean_no_nan', mask='binary', tau=0.5, bounds='tight', structure='vector', dtype='float64',
                 weight_dtype='float32')],
    'rfa': [dict(inner='default', init='zero', passes=2, secure=False, bounds='tight', smoothing=1e-6, ratio=1e3,
                 structure='pair', dtype='float32', weight_dtype='float32'),
            dict(inner='tff_mean_no_nan', init='mean', passes=2, secure=True, bounds='tight', smoothing=1e-6,
                 ratio=10.0, structure='vector', dtype='float16', weight_dtype='int32')],
    'elastic': [dict(secure=False, tau=0.5, bounds='tight', structure='pair', dtype='float32', weight_dtype='float32'),
                dict(secure=True, tau=0.0, bounds='tight', structure='vector', dtype='float64',
                     weight_dtype='int64')],
    'fedgma': [dict(inner='default', step=0.1, p=0.8, secure=False, bounds='tight', structure='pair',
                    dtype='float32', weight_dtype='float32'),
               dict(inner='tff_mean_no_nan', step=1.0, p=0.6, secure=True, bounds='tight', structure='vector',
                    dtype='float64', weight_dtype='int32')],
    'federated_mean': [dict(structure='pair', dtype='mixed', weight_dtype='int32'),
                       dict(structure='vector', dtype='float32', weight_dtype='float64')],
    'secure_weighted_mean': [dict(bounds='tight', structure='pair', dtype='float32', weight_dtype='float32'),
                             dict(bounds='wide', structure='scalar', dtype='float64', weight_dtype='int64')],
}


def fast_configurations(kind: str) -> list[dict]:
  base, use = KINDS[kind]
  configs = [dict(c) for c in _FAST[base]]
  if use != 'weighted':
    for c in configs:
      c['weight_dtype'] = 'float32'
  return configs if kind in ('gma', 'rfa', 'elastic', 'fedgma', 'federated_mean', 'secure_weighted_mean') else (
      configs[:1])


def _num_configs(examples: int, available: int) -> int:
  """Configurations a run of `examples` uses: about 12 examples each (a process costs 1-20 s to build, an example
  10-300 ms), all of them from 12 * len on; `TFF_GMA_PROPERTY_CONFIGS` overrides."""
  override = os.environ.get('TFF_GMA_PROPERTY_CONFIGS')
  wanted = int(override) if override else max(2, examples // 12)
  return max(1, min(available, wanted))


# ----------------------------------------------------------------------------------------------------------------
# The factories, their processes (cached) and the references.


def make_inner(name: str, bounds: tuple[float, float]):
  value_bound, weight_bound = bounds
  if name == 'federated_mean':
    return aggregators.FederatedMeanFactory()
  if name == 'secure_weighted_mean':
    return aggregators.SecureWeightedMeanFactory(value_bound=value_bound, weight_bound=weight_bound)
  if name == 'tff_mean':
    return tff.aggregators.MeanFactory()
  if name == 'tff_mean_no_nan':
    return tff.aggregators.MeanFactory(no_nan_division=True)
  if name == 'tff_secure_plain':
    return tff.learning.secure_aggregator(zeroing=False, clipping=False)
  if name == 'tff_secure':
    return tff.learning.secure_aggregator()
  if name == 'tff_robust':
    return tff.learning.robust_aggregator()
  if name == 'tff_compression':
    return tff.learning.compression_aggregator()
  if name == 'tff_clipping':
    return tff.aggregators.clipping_factory(im.CLIPPING_NORM, tff.aggregators.MeanFactory())
  if name == 'tff_zeroing':
    return tff.aggregators.zeroing_factory(im.ZEROING_NORM, tff.aggregators.MeanFactory())
  raise ValueError(name)


def resolved_inner(base: str, config: dict) -> str:
  """The inner mean's name, with the factory's default resolved (`secure` picks the secure mean)."""
  inner = config.get('inner', 'default')
  if inner == 'default':
    return 'secure_weighted_mean' if config.get('secure') else 'federated_mean'
  if inner == 'default_secure':
    return 'secure_weighted_mean'
  return inner


def inner_model(name: str, config: dict):
  return im.model_for(name, *BOUNDS[config.get('bounds', 'tight')])


def build_factory(kind: str, config: dict):
  """The factory of `kind` with `config`, as a user writes it."""
  base, use = KINDS[kind]
  value_bound, weight_bound = BOUNDS[config.get('bounds', 'tight')]
  inner = config.get('inner', 'default')
  mean_factory = None if inner in ('default', 'default_secure') else make_inner(inner, (value_bound, weight_bound))
  secure = config.get('secure', inner == 'default_secure')
  if base == 'gma':
    args = dict(tau=config['tau'], mask=config['mask'], secure=secure, value_bound=value_bound if secure else None,
                weight_bound=weight_bound, mean_factory=mean_factory)
    weighted = aggregators.GradientMaskedFactory
    unweighted = aggregators.UnweightedGradientMaskedFactory
  elif base == 'rfa':
    one_step = config['init'] == 'one_step'
    args = dict(num_passes=config['passes'], smoothing=config['smoothing'], one_step=one_step, secure=secure,
                value_bound=value_bound if secure else None, weight_bound=weight_bound,
                max_weight_ratio=config['ratio'], mean_factory=mean_factory,
                init=None if one_step else config['init'],
                # The paper's smoothing rule, which the enclosures below bound; the near rule that raises it to a
                # share of the median distance has its reference in vardi_zhang_test.py.
                near_fraction=0.0)
    weighted = aggregators.GeometricMedianFactory
    unweighted = aggregators.UnweightedGeometricMedianFactory
  elif base == 'elastic':
    args = dict(tau=config['tau'], secure=secure, value_bound=value_bound if secure else None,
                weight_bound=weight_bound)
    weighted, unweighted = aggregators.ElasticFactory, None
  elif base == 'fedgma':
    args = dict(server_step_size=config['step'], mask_threshold=config['p'], secure=secure,
                value_bound=value_bound if secure else None, weight_bound=weight_bound, mean_factory=mean_factory)
    weighted, unweighted = aggregators.FedGMAFactory, None
  elif base == 'federated_mean':
    args, weighted, unweighted = {}, aggregators.FederatedMeanFactory, None
  else:
    args = dict(value_bound=value_bound, weight_bound=weight_bound)
    weighted, unweighted = aggregators.SecureWeightedMeanFactory, None
  if use == 'weighted':
    return weighted(**args)
  if use == 'unweighted_class':
    return unweighted(**args)
  return aggregators.as_unweighted(weighted(**args))


def value_spec(kind: str, config: dict) -> ValueSpec:
  base = KINDS[kind][0]
  return ValueSpec(config['structure'], part_layout(config['structure'], config['dtype']), PAIRED_FIELDS.get(base))


@dataclasses.dataclass
class Built:
  process: Any  # The AggregationProcess, or None when `create` refused.
  state: Any
  error: Optional[BaseException]
  seconds: float
  measurement_names: frozenset


_PROCESSES: dict = {}


def built(kind: str, config: dict) -> Built:
  """The process of (kind, config), built once (`create`, `initialize`)."""
  key = (kind, tuple(sorted(config.items())))
  if key not in _PROCESSES:
    start = time.perf_counter()
    spec = value_spec(kind, config)
    weighted = KINDS[kind][1] == 'weighted'
    try:
      factory = build_factory(kind, config)
      if weighted:
        process = factory.create(spec.type, tff.TensorType(np.dtype(config['weight_dtype'])))
      else:
        process = factory.create(spec.type)
    except (TypeError, ValueError) as error:  # A refusal at `create` (checked by the caller).
      _PROCESSES[key] = Built(None, None, error, time.perf_counter() - start, frozenset())
    else:
      names = frozenset(_measurement_names(process.next.type_signature.result[2].member))
      _PROCESSES[key] = Built(process, process.initialize(), None, time.perf_counter() - start, names)
  return _PROCESSES[key]


def _measurement_names(measurements_type) -> list[str]:
  return [name for name, _ in tff.structure.iter_elements(measurements_type)] if isinstance(
      measurements_type, tff.StructType) else []


# ----------------------------------------------------------------------------------------------------------------
# Round data.

REGIMES = ('normal', 'offset', 'identical', 'sign_balanced', 'outliers', 'integers', 'sparse', 'tiny', 'large',
           'thresholds')
# The thresholds in play (secure value bounds, TFF's zeroing and clipping norms, the secure aggregator's bound), for
# values at, just below and just above them.
THRESHOLDS = (10.0, 3e4, im.ROBUST_ZEROING_NORM, im.ZEROING_NORM, im.ROBUST_CLIPPING_NORM, im.CLIPPING_NORM, 100.0)
SCALES = (1.0, 1e4, 1e-8, 1e-3, 1e2)
WEIGHT_KINDS = ('floats', 'ones', 'zeros', 'ints', 'big_ints', 'tiny', 'one_dominant', 'some_zero', 'equal',
                'thresholds')
# Weights at the secure weight bounds, at TFF's secure weight bound 2**20 - 1, and about the quantizers' quanta.
WEIGHT_THRESHOLDS = (100.0, 2e6, 2.0**20 - 1, 2.0**20, 1e-6, 1.2e-4, 2.5e-4, 1.0)


def _values(rng: np.random.Generator, regime: str, scale: float, num_clients: int, n: int) -> np.ndarray:
  normal = lambda *shape: rng.standard_normal(shape)
  if regime == 'normal':
    return scale * normal(num_clients, n)
  if regime == 'offset':  # A common part much larger than the spread: D(0) >> D(v_1).
    return scale * (1.0 + 1e-3 * normal(num_clients, n)) * np.sign(normal(1, n))
  if regime == 'identical':
    return np.repeat(scale * normal(1, n), num_clients, axis=0)
  if regime == 'sign_balanced':
    x = scale * normal((num_clients + 1) // 2, n)
    return np.concatenate([x, -x])[:num_clients]
  if regime == 'outliers':
    values = scale * (1.0 + 1e-2 * normal(num_clients, n))
    bad = rng.random(num_clients) < 0.4
    return np.where(bad[:, None], -1e3 * scale * np.abs(normal(num_clients, n)), values)
  if regime == 'integers':
    return rng.integers(-3, 4, size=(num_clients, n)).astype(np.float64)
  if regime == 'sparse':
    return np.where(rng.random((num_clients, n)) < 0.6, 0.0, scale * normal(num_clients, n))
  if regime == 'tiny':
    return 1e-8 * normal(num_clients, n)
  if regime == 'thresholds':
    at = rng.choice(THRESHOLDS, size=(num_clients, n)) * rng.choice([-1.0, 1.0], size=(num_clients, n))
    nudge = rng.choice([1 - 2.0**-20, 1.0, 1 + 2.0**-20, 0.0], size=(num_clients, n))
    return at * nudge
  return 1e4 * normal(num_clients, n)  # 'large'


def _weights(rng: np.random.Generator, kind: str, num_clients: int) -> np.ndarray:
  if kind == 'floats':
    return 10.0 ** rng.uniform(-6, 6, num_clients)
  if kind == 'ones':
    return np.ones(num_clients)
  if kind == 'zeros':
    return np.zeros(num_clients)
  if kind == 'ints':
    return rng.integers(0, 1000, num_clients).astype(np.float64)
  if kind == 'big_ints':
    return rng.integers(1, 1_000_001, num_clients).astype(np.float64)
  if kind == 'tiny':
    return 1e-6 * (1.0 + rng.random(num_clients))
  if kind == 'one_dominant':
    w = 10.0 ** rng.uniform(-6, 0, num_clients)
    w[rng.integers(num_clients)] = 1e6
    return w
  if kind == 'some_zero':
    return np.where(rng.random(num_clients) < 0.5, 0.0, 10.0 ** rng.uniform(-3, 3, num_clients))
  if kind == 'thresholds':
    return rng.choice(WEIGHT_THRESHOLDS, num_clients) * rng.choice([1 - 2.0**-20, 1.0, 1 + 2.0**-20], num_clients)
  return np.full(num_clients, 10.0 ** rng.uniform(-6, 6))  # 'equal'


def _representable(weights: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """Weights as a `dtype` holds them (integers: floored), back as float64."""
  if dtype.kind in 'iu':
    return np.floor(weights).astype(dtype).astype(np.float64)
  return weights.astype(dtype).astype(np.float64)


@st.composite
def round_data(draw, spec: ValueSpec, weight_dtype: np.dtype, invalid: bool = False):
  """(Clients, description): the values of `spec` and weights of `weight_dtype`; with `invalid`, 1-3 clients made
  invalid (a NaN or Inf coordinate; a negative, NaN or Inf weight)."""
  num_clients = draw(st.integers(1, 20))
  regime = draw(st.sampled_from(REGIMES))
  scale = draw(st.sampled_from(SCALES))
  weight_kind = draw(st.sampled_from(WEIGHT_KINDS))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  part = spec.part
  rows = [_values(rng, regime, scale, num_clients, part.n)]
  if spec.fields is not None:  # Elastic's sensitivity (non-negative, as documented) or FedGMA's gradient.
    second = draw(st.sampled_from(REGIMES))
    x = _values(rng, second, scale, num_clients, part.n)
    rows.append(np.abs(x) if spec.fields[1] == 'sensitivity' else x)
  values = np.concatenate(rows, axis=1)
  if any(np.dtype(d) == F16 for d in part.dtypes):
    values = np.clip(values, -3e4, 3e4)
  layout = spec.layout
  values = layout.round(values)
  weights = _representable(_weights(rng, weight_kind, num_clients), weight_dtype)
  if invalid:
    count = draw(st.integers(1, min(3, num_clients)))
    for i in rng.choice(num_clients, count, replace=False):
      how = draw(st.sampled_from(('nan_value', 'inf_value', 'negative_weight', 'nan_weight', 'inf_weight')))
      if how.endswith('value'):
        values[i, rng.integers(layout.n)] = np.nan if how == 'nan_value' else -np.inf
      elif how == 'negative_weight':
        weights[i] = -1.0 - np.floor(abs(weights[i]))
      elif weight_dtype.kind == 'f':
        weights[i] = np.nan if how == 'nan_weight' else np.inf
      else:
        weights[i] = -7.0
  clients = fr.Clients(values, weights, weight_dtype, layout)
  return clients, dict(num_clients=num_clients, regime=regime, scale=scale, weight_kind=weight_kind, seed=seed)


# ----------------------------------------------------------------------------------------------------------------
# Outcomes and statistics.

_STATS: dict = collections.defaultdict(lambda: collections.defaultdict(int))
_WIDTHS: dict = collections.defaultdict(list)
_FAILURES: dict = collections.defaultdict(list)
_TIMES: dict = collections.defaultdict(float)


class Rejected(Exception):
  """The example is rejected (an ambiguous rounding, or a known issue): hypothesis draws another."""


def _tally(kind: str, outcome: str) -> None:
  _STATS[kind][outcome] += 1


@pytest.fixture(autouse=True)
def _write_stats():
  """After each test, `TFF_GMA_PROPERTY_STATS` (when set) gets what ran so far (a long run shows its progress)."""
  yield
  if not STATS_PATH:
    return
  old = {}
  if os.path.exists(STATS_PATH):
    with open(STATS_PATH, encoding='utf-8') as f:
      old = json.load(f)
  def summary(widths):
    widths = np.asarray(widths) if widths else np.zeros(1)
    return dict(n=int(widths.size), median=float(np.median(widths)), p90=float(np.quantile(widths, 0.9)),
                max=float(np.max(widths)))

  for kind in set(_STATS) | set(_FAILURES):
    entry = old.setdefault(kind, {})
    by_inner = {key.split(':', 1)[1]: summary(w) for key, w in _WIDTHS.items() if key.startswith(kind + ':')}
    entry.update(outcomes=dict(_STATS[kind]), seconds=round(_TIMES[kind], 1), relative_width=summary(_WIDTHS[kind]),
                 relative_width_by_inner=by_inner, failures=_FAILURES[kind][:50],
                 distinct_failures=len(_FAILURES[kind]))
  with open(STATS_PATH, 'w', encoding='utf-8') as f:
    json.dump(old, f, indent=1, default=str)


def reproducer(kind: str, config: dict, clients: fr.Clients) -> str:
  """A Python snippet that rebuilds the factory and runs the failing call (the minimal reproducer reported)."""
  spec = value_spec(kind, config)
  values = [spec.value(row) for row in clients.values]
  weights = [np.asarray(w, clients.weight_dtype) for w in clients.weights]
  weighted = KINDS[kind][1] == 'weighted'
  call = 'process.next(process.initialize(), values, weights)' if weighted else (
      'process.next(process.initialize(), values)')
  return (f'# {kind} {config}\nvalues = {values!r}\nweights = {weights!r}\n'
          f'process = <{kind} factory>.create({spec.type}{", " + config["weight_dtype"] if weighted else ""})\n'
          f'{call}')


def _flat_result(spec: ValueSpec, result) -> np.ndarray:
  if spec.fields is None:
    return part_flat(spec.structure, result)
  return part_flat(spec.structure, result)  # Elastic and FedGMA return the update's structure.


@dataclasses.dataclass
class Check:
  """Collects what is wrong with one example."""
  problems: list = dataclasses.field(default_factory=list)

  def expect(self, ok, what: str) -> None:
    if not bool(ok):
      self.problems.append(what)

  def measurement(self, measurements, name: str, want, tolerance: float = 0.0) -> None:
    if name not in measurements:
      self.problems.append(f'measurement {name} missing')
      return
    got = float(np.asarray(measurements[name]))
    if not abs(got - float(want)) <= tolerance:
      self.problems.append(f'measurement {name} = {got}, expected {want}' + (f' +- {tolerance}' if tolerance else ''))


def check_enclosure(check: Check, enclosure: im.Enclosure, result: np.ndarray, measurements, names,
                    nonzero_clients: Optional[int]) -> None:
  """The result against the reference's enclosure and the documented degenerate outcomes."""
  check.expect(np.all(np.isfinite(result)), f'the result is not finite: {result}')
  if enclosure.status == im.FINITE:
    inside = enclosure.contains(result)
    out = ~inside
    check.expect(np.all(inside), 'the result is outside the reference enclosure at coordinates '
                 f'{np.flatnonzero(out).tolist()}: result {result[out]}, enclosure [{enclosure.lower[out]}, '
                 f'{enclosure.upper[out]}], reference {enclosure.center[out]}')
  elif enclosure.status == im.ZERO:
    check.expect(np.all(result == 0), f'the documented zero update expected, got {result}')
  elif enclosure.status == im.NONFINITE:  # Documented: replaced by zeros, flagged `nonfinite_result`.
    check.expect(np.all(result == 0), f'a non-finite inner mean must give the zero update, got {result}')
  if 'nonfinite_result' in names:
    check.measurement(measurements, 'nonfinite_result', int(enclosure.status == im.NONFINITE))
  if 'zero_result' in names and nonzero_clients is not None:
    zero = bool(np.all(result == 0)) and nonzero_clients > 0
    check.measurement(measurements, 'zero_result', int(zero))


def _relative_width(enclosure: im.Enclosure, clients: fr.Clients) -> Optional[float]:
  if enclosure.status != im.FINITE:
    return None
  values = clients.values[np.all(np.isfinite(clients.values), axis=1)]
  spread = float(np.max(np.abs(values))) if values.size else 0.0
  with np.errstate(over='ignore', invalid='ignore'):
    width = float(np.max(enclosure.width))
  if not math.isfinite(width):
    return None
  return width / spread if spread > 0 else (0.0 if width == 0 else math.inf)


# ----------------------------------------------------------------------------------------------------------------
# Known issues of the library (each pinned by an xfail test below): examples they cover are rejected, not failed.


@dataclasses.dataclass(frozen=True)
class KnownIssue:
  id: str
  reason: str
  applies: Callable  # (kind, config, expected, names, invalid) -> bool


KNOWN_ISSUES: list = []  # None open (the two this suite found are fixed; their reproducers are tests below).


def known_issue(kind, config, expected, names, invalid) -> Optional[KnownIssue]:
  for issue in KNOWN_ISSUES:
    if issue.applies(kind, config, expected, names, invalid):
      return issue
  return None


# ----------------------------------------------------------------------------------------------------------------
# One example.


EXACT_INNERS = ('federated_mean', 'tff_mean', 'tff_mean_no_nan')  # Known exact: FederatedMeanFactory, MeanFactory.


def rfa_config(config: dict) -> fr.RFAConfig:
  value_bound, weight_bound = BOUNDS[config['bounds']]
  return fr.RFAConfig(
      num_passes=config['passes'], init='zero' if config['init'] == 'one_step' else config['init'],
      smoothing=config['smoothing'], max_weight_ratio=config['ratio'], secure=config['secure'],
      value_bound=value_bound, weight_bound=weight_bound, exact_inner=resolved_inner('rfa', config) in EXACT_INNERS)


def reference(kind: str, config: dict, clients: fr.Clients):
  """The reference's expectation for (kind, config) on `clients` (weights already 1 for unweighted kinds)."""
  base = KINDS[kind][0]
  inner = resolved_inner(base, config)
  if base == 'gma':
    return fr.gma(clients, config['tau'], config['mask'], inner_model(inner, config))
  if base == 'rfa':
    return fr.rfa(clients, rfa_config(config), inner_model(inner, config))
  spec_part = part_layout(config['structure'], config['dtype'])
  if base == 'elastic':
    model = inner_model('secure_weighted_mean' if config['secure'] else 'federated_mean', config)
    return fr.elastic(clients, spec_part, config['tau'], model, model)
  if base == 'fedgma':
    gradient_model = inner_model('secure_weighted_mean' if config['secure'] else 'federated_mean', config)
    return fr.fedgma(clients, spec_part, config['step'], config['p'], inner_model(inner, config), gradient_model)
  return fr.weighted_mean(clients, inner_model(base, config))


def predicted_refusal(kind: str, config: dict) -> Optional[str]:
  """Why `create` must refuse (config, value and weight types), or None."""
  base, use = KINDS[kind]
  spec = value_spec(kind, config)
  weight_dtype = np.dtype(config['weight_dtype'])
  inner = resolved_inner(base, config)
  if base == 'gma':
    return inner_model(inner, config).refusal(spec.part, im.float_weight_dtype(weight_dtype))
  if base == 'rfa':
    return inner_model(inner, config).refusal(spec.part.compute_layout(), F32)
  if base == 'elastic':
    return inner_model('secure_weighted_mean' if config['secure'] else 'federated_mean', config).refusal(
        spec.part, weight_dtype)
  if base == 'fedgma':
    gradient = inner_model('secure_weighted_mean' if config['secure'] else 'federated_mean', config)
    float_weight = im.float_weight_dtype(weight_dtype)  # Both means get the weights cast to float.
    return inner_model(inner, config).refusal(spec.part, float_weight) or gradient.refusal(spec.part, float_weight)
  return inner_model(base, config).refusal(spec.part, weight_dtype)


def run_example(kind: str, config: dict, clients: fr.Clients, description: dict, invalid: bool = False,
                known_issues: bool = True) -> None:
  """Runs one example of `kind` and checks it; raises AssertionError (or records it, with COLLECT). With
  `known_issues`, an example a known issue covers is rejected (`Rejected`) rather than checked."""
  start = time.perf_counter()
  try:
    _run_example(kind, config, clients, description, invalid, known_issues)
  finally:
    _TIMES[kind] += time.perf_counter() - start


def _run_example(kind, config, clients, description, invalid, known_issues):
  entry = built(kind, config)
  _tally(kind, 'examples')
  refusal = predicted_refusal(kind, config)
  issue = known_issue(kind, config, None, entry.measurement_names, invalid) if known_issues else None
  if issue is not None and not COLLECT:
    _tally(kind, f'known_issue:{issue.id}')
    raise Rejected()
  half = any(im.unit_roundoff(d) > 2.0**-24 for d in value_spec(kind, config).part.dtypes)
  if entry.error is not None or (refusal is not None and not half):
    problems = []
    if entry.error is None:
      problems.append(f'create accepted a configuration the reference expects refused ({refusal})')
    else:
      message = str(entry.error)
      if '\n' in message.strip():
        problems.append(f'create refused in more than one line ({type(entry.error).__name__}): {message!r}')
      if refusal is None and not half:  # A half-precision dtype may be refused (in one line).
        problems.append(f'create refused an accepted configuration: {type(entry.error).__name__}: {message}')
    outcome = f'known_issue:{issue.id}' if issue is not None else 'refused_half' if half else 'refused'
    _outcome(kind, config, clients, description, problems, outcome, names=entry.measurement_names, expected=None,
             invalid=invalid)
    return
  unweighted = KINDS[kind][1] != 'weighted'
  ref_clients = fr.unit_weight_clients(clients) if unweighted else clients
  try:
    expected = reference(kind, config, ref_clients)
  except fr.Ambiguous:
    _tally(kind, 'rejected_ambiguous')
    raise Rejected() from None
  if known_issues:
    issue = issue or known_issue(kind, config, expected, entry.measurement_names, invalid)
  if issue is not None and not COLLECT:
    _tally(kind, f'known_issue:{issue.id}')
    raise Rejected()
  spec = value_spec(kind, config)
  values = [spec.value(row) for row in clients.values]
  if unweighted:
    output = entry.process.next(entry.state, values)
  else:
    weights = [np.asarray(w, clients.weight_dtype) for w in clients.weights]
    output = entry.process.next(entry.state, values, weights)
  result = _flat_result(spec, output.result)
  measurements = output.measurements
  check = Check()
  base = KINDS[kind][0]
  enclosure = expected.enclosure if hasattr(expected, 'enclosure') else expected[0]
  if base == 'gma':
    check_enclosure(check, enclosure, result, measurements, entry.measurement_names, expected.nonzero_clients)
    check_gma_measurements(check, expected, measurements)
  elif base == 'rfa':
    check_enclosure(check, enclosure, result, measurements, entry.measurement_names, expected.nonzero_clients)
    check_rfa_measurements(check, kind, config, expected, measurements, clients)
  elif base == 'elastic':
    check_enclosure(check, enclosure, result, measurements, entry.measurement_names, expected.nonzero_clients)
    check.measurement(measurements, 'dropped_clients', expected.dropped)
  elif base == 'fedgma':
    check_enclosure(check, enclosure, result, measurements, entry.measurement_names, expected.nonzero_clients)
    check_gma_measurements(check, expected.gradient, measurements['gradient'])
  else:
    check_enclosure(check, enclosure, result, measurements, entry.measurement_names, None)
  width = _relative_width(enclosure, clients)
  if width is not None:
    _WIDTHS[kind].append(width)
    _WIDTHS[f'{kind}:{resolved_inner(base, config)}'].append(width)
  outcome = 'checked' if enclosure.status == im.FINITE else f'degenerate_{enclosure.status}'
  if issue is not None:
    outcome = f'known_issue:{issue.id}'
  _outcome(kind, config, clients, description, check.problems, outcome, entry.measurement_names, expected,
           invalid, result=result)


def _outcome(kind, config, clients, description, problems, outcome, names, expected, invalid, result=None):
  _tally(kind, outcome)
  if not problems:
    return
  _tally(kind, 'failed')
  record = dict(outcome=outcome, config=config, data=description, problems=problems, invalid=invalid,
                result=None if result is None else result.tolist(), reproducer=reproducer(kind, config, clients),
                values=clients.values.tolist(), weights=clients.weights.tolist(),
                weight_dtype=str(clients.weight_dtype))
  if COLLECT:
    _FAILURES[kind].append(record)
    return
  raise AssertionError(f'{kind} {config}\n' + '\n'.join(problems) + '\n' + record['reproducer'])


def check_gma_measurements(check: Check, expected: fr.GMAExpected, measurements) -> None:
  check.measurement(measurements, 'participating_clients', expected.participating)
  check.measurement(measurements, 'dropped_clients', expected.dropped)
  check.measurement(measurements, 'masked_fraction', expected.masked_fraction, 1e-6)
  check.measurement(measurements, 'mean_agreement', expected.mean_agreement, 1e-6)


def check_rfa_measurements(check: Check, kind: str, config: dict, expected: fr.RFAExpected, measurements,
                           clients: fr.Clients) -> None:
  """RFA's measurements: the objectives and smoothings within their enclosures, the smoothing rule exactly."""
  objective = np.asarray(measurements['objective'], np.float64)
  smoothing = np.asarray(measurements['smoothing'], np.float64)
  check.expect(len(objective) == len(expected.objectives),
               f'{len(objective)} objectives reported, {len(expected.objectives)} expected')
  check.expect(len(smoothing) == len(expected.smoothings),
               f'{len(smoothing)} smoothings reported, {len(expected.smoothings)} expected')
  for k, ((lo, hi), got) in enumerate(zip(expected.objectives, objective)):
    check.expect(lo <= got <= hi, f'objective[{k}] = {got} outside [{lo}, {hi}]')
  nu32, k32 = np.float32(config['smoothing']), np.float32(config['ratio'])
  for k, ((lo, hi), (rule, arg), got) in enumerate(zip(expected.smoothings, expected.smoothing_rules, smoothing)):
    check.expect(lo <= got <= hi, f'smoothing[{k}] = {got} outside [{lo}, {hi}] ({rule})')
    if rule == 'floored' and arg < len(objective):
      # max(nu, S / K) from the objective reported one round earlier, in float32 (within 2 ulps: TF may divide
      # by the constant K as a multiplication by its float32 reciprocal).
      want = float(np.maximum(nu32, np.float32(objective[arg]) / k32))
      check.expect(abs(got - want) <= 2.0**-22 * want,
                   f'smoothing[{k}] = {got}, but max(nu, objective[{arg}] / K) = {want}')
    elif rule == 'constant':
      check.expect(abs(got - arg) <= 2.0**-23 * arg, f'smoothing[{k}] = {got}, expected the constant {arg}')
  check.measurement(measurements, 'aggregation_calls', rfa_config(config).num_rounds)
  check.measurement(measurements, 'nonfinite_passes', expected.nonfinite_passes)
  check.measurement(measurements, 'participating_clients', expected.participating)
  check.measurement(measurements, 'dropped_clients', expected.dropped)
  check.measurement(measurements, 'value_clipped_clients', expected.value_clipped)
  check.measurement(measurements, 'weight_clipped_clients', expected.weight_clipped)
  check.measurement(measurements, 'nonfinite_result', 0)
  del kind, clients


# ----------------------------------------------------------------------------------------------------------------
# The properties.

_SETTINGS = dict(derandomize=True, database=None, deadline=None, print_blob=False,
                 suppress_health_check=list(hypothesis.HealthCheck))


def run_property(kind: str, configs: list, examples: int, invalid: bool = False, seed: Optional[int] = None) -> None:
  """`examples` hypothesis examples of `kind` over `configs`; derandomized (hypothesis' fixed seed for the test),
  or from `seed` (a long run's further chunks)."""
  settings = dict(_SETTINGS, derandomize=seed is None)

  @hypothesis.settings(max_examples=examples, **settings)
  @hypothesis.given(config=st.sampled_from(configs), data=st.data())
  def prop(config, data):
    spec = value_spec(kind, config)
    clients, description = data.draw(round_data(spec, np.dtype(config['weight_dtype']), invalid), label='round')
    hypothesis.note(f'data {description}')
    try:
      run_example(kind, config, clients, description, invalid)
    except Rejected:
      hypothesis.reject()

  if seed is not None:
    prop = hypothesis.seed(seed)(prop)
  prop()


ALL_KINDS = tuple(KINDS)


@pytest.mark.parametrize('kind', ALL_KINDS)
def test_matches_the_reference_fast(kind):
  run_property(kind, fast_configurations(kind), FAST_EXAMPLES)


def _slow_params():
  kinds = [k for k in ALL_KINDS if not KINDS_ENV or k in KINDS_ENV.split(',')]
  if CHUNKS == 1:
    return [pytest.param(0, kind, id=kind) for kind in kinds]
  return [pytest.param(chunk, kind, id=f'{kind}-{chunk}') for chunk in range(CHUNKS) for kind in kinds]


@pytest.mark.slow
@pytest.mark.parametrize('chunk, kind', _slow_params())
def test_matches_the_reference(chunk, kind):
  configs = configurations(kind)
  count = _num_configs(SLOW_EXAMPLES, len(configs))
  if KINDS[kind][1] != 'weighted':  # The unweighted uses differ from the weighted factory only in the weights.
    count = max(1, count // 2)
  run_property(kind, configs[:count], SLOW_EXAMPLES // CHUNKS, seed=None if chunk == 0 else 1000 + chunk)


@pytest.mark.slow
@pytest.mark.parametrize('kind', ALL_KINDS)
def test_invalid_clients_are_dropped(kind):
  configs = configurations(kind)
  examples = max(FAST_EXAMPLES, SLOW_EXAMPLES // 5)
  run_property(kind, configs[:_num_configs(examples, len(configs))], examples, invalid=True)


# The weighted factories other than RFA (whose main property draws float16 and bfloat16): the unweighted uses add
# only the unit weights, which the main property checks.
FLOAT16_KINDS = ('gma', 'elastic', 'fedgma', 'federated_mean', 'secure_weighted_mean')


@pytest.mark.slow
@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
@pytest.mark.parametrize('kind', FLOAT16_KINDS)
def test_half_precision_is_refused_in_one_line_or_right(kind, dtype):
  """float16/bfloat16 values: refused at create in one line, or a right result (the library's means weigh and sum
  them in float32 and cast the mean back)."""
  configs = [dict(c, dtype=dtype) for c in fast_configurations(kind)[:1]]
  run_property(kind, configs, FAST_EXAMPLES)


def test_configurations_cover_every_pair_and_every_inner_first():
  for kind in ('gma', 'rfa', 'fedgma'):
    configs = configurations(kind)
    base = KINDS[kind][0]
    inners = [c['inner'] for c in configs[:len(DIMS[base]['inner'])]]
    assert inners == list(DIMS[base]['inner']), inners
    for a, b in itertools.combinations(DIMS[base], 2):
      seen = {(c[a], c[b]) for c in configs}
      for va, vb in itertools.product(DIMS[base][a], DIMS[base][b]):
        if _valid({a: va, b: vb}):
          assert (va, vb) in seen, (kind, a, va, b, vb)


def test_the_references_enclosure_is_tight_for_an_exact_mean():
  """The reference is not vacuous: an exact float32 mean of values of size 1 is enclosed within about 1e-6."""
  layout = im.Layout(((3,),), (F32,))
  rng = np.random.default_rng(0)
  points = layout.round(rng.standard_normal((5, 3)))
  weights = np.asarray(rng.uniform(1, 2, 5), np.float32).astype(np.float64)
  enclosure = im.model_for('federated_mean').mean(points, points, weights, weights, layout, F32)
  assert np.all(enclosure.width < 5e-6), enclosure.width
  exact = weights @ points / weights.sum()
  assert np.all(enclosure.contains(exact))


# ----------------------------------------------------------------------------------------------------------------
# Regression tests of the issues this suite found (both failed on the library of 2026-12-02 07:10, e40b4eb).


def test_fedgma_with_tff_secure_aggregator_takes_integer_weights():
  """FedGMA handed integer weights to its mean_factory as they were, so TFF's secure_aggregator() refused them at
  create with TFF's two-line TypeError (GMA and RFA cast the weights to float first); now it casts them too."""
  config = dict(inner='tff_secure_plain', step=0.1, p=0.8, secure=False, bounds='tight', structure='vector',
                dtype='float32', weight_dtype='int32')
  clients = fr.Clients(np.array([[1.0, -2.0, 0.5, 1.0, 1.0, -1.0], [3.0, 0.0, 0.5, 1.0, -1.0, -1.0]]),
                       np.array([1.0, 3.0]), np.dtype(np.int32), value_spec('fedgma', config).layout)
  run_example('fedgma', config, clients, {}, known_issues=False)


@pytest.mark.parametrize('mean', ['federated_mean', 'secure_weighted_mean'])
def test_the_means_drop_invalid_clients(mean):
  """Two clients, one with a NaN coordinate: the documented result (docs/methods.md, "Non-finite input": every
  factory, the means included, drops it) is the other client's value, [1, 2, 3]. FederatedMeanFactory returned
  [nan, 1, 1.5] and SecureWeightedMeanFactory a finite wrong mean before they dropped such clients."""
  config = dict(bounds='tight', structure='vector', dtype='float32', weight_dtype='float32')
  layout = value_spec(mean, config).layout
  clients = fr.Clients(np.array([[np.nan, 0.0, 0.0], [1.0, 2.0, 3.0]]), np.array([1.0, 1.0]), F32, layout)
  run_example(mean, config, clients, {}, known_issues=False)
