"""The benchmark's entries: methods of the registry, each optionally with aggregator or method settings.

An entry is `NAME+setting=value+...` (`parse_candidate`): NAME as `registry.resolve` names a method, the settings
fields of `config_lib.AggregatorParams` or `config_lib.MethodParams`. `build_method` is the process a round section
times, `probe_factory` the aggregation alone, `round_target` the limit on the entry's round.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import tensorflow_federated as tff

from training import config as config_lib
from training.bench import presets
from training.engine import methods
from training.engine import registry


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A benchmark entry: `registry.resolve(name)` with aggregator and method settings."""
  label: str
  algorithm: str
  aggregator: str
  aggregator_params: config_lib.AggregatorParams = config_lib.AggregatorParams()
  method_params: config_lib.MethodParams = config_lib.MethodParams()

  def params(self, secure_bound: float) -> config_lib.AggregatorParams:
    """The aggregator settings, with `secure_bound` where the entry is secure and sets none."""
    if self.aggregator_params.secure and self.aggregator_params.secure_bound is None:
      return dataclasses.replace(self.aggregator_params, secure_bound=secure_bound)
    return self.aggregator_params


def _setting_value(field: dataclasses.Field, raw: Optional[str], entry: str) -> Any:
  kind = str(field.type)
  if 'bool' in kind:
    if raw is None or raw.lower() in ('true', '1', 'yes'):
      return True
    if raw.lower() in ('false', '0', 'no'):
      return False
    raise ValueError(f'{entry!r}: {field.name} takes true or false, got {raw!r}')
  if raw is None:
    raise ValueError(f'{entry!r}: {field.name} needs a value ({field.name}=...)')
  try:
    if 'int' in kind:
      return int(raw)
    if 'float' in kind:
      return float(raw)
  except ValueError:
    raise ValueError(f'{entry!r}: {field.name} takes a number, got {raw!r}') from None
  return raw


def parse_candidate(entry: str) -> Candidate:
  """'rfa+num_passes=5' -> Candidate('rfa+num_passes=5', 'fedavg', 'rfa', AggregatorParams(num_passes=5), ...).

  Raises ValueError naming the entry for an unknown method or setting or a value of the wrong type.
  """
  name, *settings = entry.split('+')
  try:
    algorithm, aggregator = registry.resolve(name)
  except ValueError as e:
    raise ValueError(f'{entry!r}: {e}') from None
  fields = {
      'aggregator': {f.name: f for f in dataclasses.fields(config_lib.AggregatorParams)},
      'method': {f.name: f for f in dataclasses.fields(config_lib.MethodParams)},
  }
  overrides: dict[str, dict[str, Any]] = {'aggregator': {}, 'method': {}}
  for setting in settings:
    key, sep, raw = setting.partition('=')
    where = next((w for w, known in fields.items() if key in known), None)
    if where is None:
      known = sorted(set(fields['aggregator']) | set(fields['method']))
      raise ValueError(f'{entry!r}: unknown setting {key!r}; expected NAME+setting=value+... with settings among '
                       f'{", ".join(known)}')
    overrides[where][key] = _setting_value(fields[where][key], raw if sep else None, entry)
  try:
    candidate = Candidate(entry, algorithm, aggregator, config_lib.AggregatorParams(**overrides['aggregator']),
                          config_lib.MethodParams(**overrides['method']))
    # A setting the method does not read is refused, as by the runner (`registry.check_settings`).
    registry.check_settings(algorithm, aggregator, registry.settings_of(
        presets.ALGORITHM_CONFIG, candidate.aggregator_params, candidate.method_params))
  except ValueError as e:
    raise ValueError(f'{entry!r}: {e}') from None
  return candidate


def probe_factory(candidate: Candidate,
                  value_bound: float) -> Optional[tuple[str, tff.aggregators.WeightedAggregationFactory]]:
  """(kind of client value, aggregation factory) of a FedAvg candidate's aggregator alone; None for the others.

  A registry aggregator is `registry.build`'s factory on model-sized vectors; Elastic (a learning process of its
  own in `methods.build`) is its `ElasticFactory` on an update and a sensitivity. Composed algorithms (and any
  other process aggregator) have no aggregation-only probe: their rounds are measured.
  """
  if candidate.algorithm != 'fedavg':
    return None
  params = candidate.params(value_bound)
  record = registry.aggregator(candidate.aggregator)
  if record.kind == registry.PROCESS:
    return registry.probe(candidate.aggregator, params, candidate.method_params)
  return 'vector', registry.build(candidate.aggregator, params)


def build_method(candidate: Candidate, model_fn, num_clients: int) -> methods.Method:
  """`methods.build` of the candidate on the digits setup (updates bounded by SECURE_VALUE_BOUND if secure)."""
  return methods.build(model_fn, candidate.algorithm, candidate.aggregator, algorithm_config=presets.ALGORITHM_CONFIG,
                       aggregator_params=candidate.params(presets.SECURE_VALUE_BOUND),
                       method_params=candidate.method_params, num_clients=num_clients)


def round_target(candidate: Candidate) -> Optional[float]:
  """The limit on the candidate's round time ratio to the mean, if it has one."""
  if candidate.algorithm != 'fedavg':
    return None
  if candidate.aggregator == 'rfa' and candidate.aggregator_params.num_passes != 3:
    return None  # The limit is RFA's with the paper's 3 passes.
  return presets.ROUND_TARGETS.get(candidate.aggregator)
