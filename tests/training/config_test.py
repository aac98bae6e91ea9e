"""training.config: one place for every default; the runner's flags are generated from it; every method
parameter reaches the method from a flag."""

import dataclasses

from absl import flags
import pytest

from tff_gma.aggregators import gradient_masked
from training import config as config_lib
from training import run
from training.engine import methods

_PARTS = ((config_lib.AggregatorParams, 'aggregator_params'), (config_lib.MethodParams, 'method_params'))


def test_every_field_is_a_flag_with_its_default_and_help():
  values = flags.FlagValues()
  run.define_flags(values)
  fields = dataclasses.fields(config_lib.ExperimentConfig)
  assert sorted(values) == sorted(f.name for f in fields)
  for field in fields:
    assert values[field.name].default == field.default, field.name
    assert values[field.name].help.endswith(field.metadata['help'])  # Enums prefix their choices.


def test_method_defaults_are_the_component_dataclasses():
  experiment = config_lib.ExperimentConfig()
  assert experiment.algorithm_config() == config_lib.AlgorithmConfig()
  for part, getter in _PARTS:
    assert getattr(experiment, getter)() == part()
  assert config_lib.AggregatorParams().tau == gradient_masked.DEFAULT_TAU  # The library's default, taken once.


@pytest.mark.parametrize('part, getter', _PARTS)
def test_every_method_parameter_reaches_its_dataclass(part, getter):
  for field in dataclasses.fields(part):
    value = {bool: True, str: 'mean', int: 7}.get(type(field.default), 0.123)
    if field.name == 'secure_bound':
      value = 0.5
    if field.name == 'krum_selected':  # Optional[int], None by default.
      value = 2
    experiment = dataclasses.replace(config_lib.ExperimentConfig(), **{field.name: value})
    assert getattr(getattr(experiment, getter)(), field.name) == value, field.name


def test_elastic_and_fedgma_parameters_reach_the_built_process(monkeypatch):
  seen = {}

  def record(name):
    def builder(*args, **kwargs):
      seen[name] = kwargs
      raise RuntimeError('stop')
    return builder

  monkeypatch.setattr('tff_gma.learning.build_elastic_fed_avg', record('elastic'))
  monkeypatch.setattr('tff_gma.learning.build_fedgma', record('fedgma'))
  experiment = dataclasses.replace(config_lib.ExperimentConfig(), elastic_tau=0.3, elastic_mu=0.8,
                                   sensitivity_fraction=0.2, fedgma_step_size=0.7, fedgma_threshold=0.6)
  for algorithm, aggregator in (('fedavg', 'elastic'), ('fedgma', 'mean')):
    with pytest.raises(RuntimeError, match='stop'):
      methods.build(lambda: None, algorithm, aggregator, algorithm_config=experiment.algorithm_config(),
                    method_params=experiment.method_params())
  assert (seen['elastic']['tau'], seen['elastic']['mu'], seen['elastic']['sensitivity_fraction']) == (0.3, 0.8, 0.2)
  assert (seen['fedgma']['server_step_size'], seen['fedgma']['mask_threshold']) == (0.7, 0.6)
