"""A parameter's path from its flag to the object that uses it (issue 39): `tau`, `num_passes` and `client_lr`.

Each test parses the runner's flags as `python -m training.run` does (`run.config_from_flags`), then checks and
builds the run as the runner does (`experiment.validate`, `experiment.build_setup`: the `ExperimentConfig`, its
method dataclasses, `methods.build`, the registry's builders, `tff_gma`), and finds the value on what uses it:
GMA's tau on the `GradientMaskedFactory` and RFA's num_passes on the `GeometricMedianFactory` whose `create` built
the round's aggregation; client_lr in the client optimizer the built process trains with (its client work's
hyperparameters or, where the client work keeps none, the optimizer the library builder got). The values
are nobody's default, so a hop that drops one (leaving a default) or substitutes another setting fails.
"""

from absl import flags
import pytest
import tensorflow as tf

import tff_gma.learning
from tff_gma import aggregators
from training import run  # Defines the runner's flags.
from training.runner import experiment

TAU, NUM_PASSES, CLIENT_LR = 0.37, 5, 0.0123
_TINY = ('--dataset=digits', '--model=logistic', '--num_clients=3', '--clients_per_round=3')


def _config(tmp_path, *args):
  """The runner's configuration from its command line `args` (as configs_test parses a flagfile)."""
  flags.FLAGS.unparse_flags()
  flags.FLAGS(['run', *_TINY, *args, f'--output_dir={tmp_path / "never"}'])
  try:
    return run.config_from_flags()
  finally:
    flags.FLAGS.unparse_flags()


def _process(tmp_path, *args):
  """The learning process the runner builds for `args`, after the runner's checks."""
  config = _config(tmp_path, *args)
  experiment.validate(config)
  return experiment.build_setup(config).method.process


def _spy(monkeypatch, owner, name, seen):
  """Replaces `owner.name` with a call-through that appends (args, kwargs, result) to `seen`."""
  original = getattr(owner, name)

  def spy(*args, **kwargs):
    result = original(*args, **kwargs)
    seen.append((args, kwargs, result))
    return result

  monkeypatch.setattr(owner, name, spy)


def _client_work_learning_rate(process) -> float:
  return float(process.get_hparams(process.initialize())['client_work']['learning_rate'])


def _optimizer_learning_rate(optimizer) -> float:
  return float(optimizer.initialize((tf.TensorSpec([2], tf.float32),))['learning_rate'])


def test_the_values_are_nobodys_default(tmp_path):
  config = _config(tmp_path)
  assert (config.tau, config.num_passes, config.client_lr) != (TAU, NUM_PASSES, CLIENT_LR)
  assert {TAU, NUM_PASSES, CLIENT_LR}.isdisjoint({config.tau, config.num_passes, config.client_lr, config.server_lr,
                                                 config.client_momentum, config.smoothing})


def test_tau_reaches_the_gma_factory_and_client_lr_the_client_optimizer(tmp_path, monkeypatch):
  created = []
  _spy(monkeypatch, aggregators.GradientMaskedFactory, 'create', created)
  process = _process(tmp_path, '--aggregator=gma', f'--tau={TAU}', f'--client_lr={CLIENT_LR}')
  assert created, 'no GradientMaskedFactory built the round\'s aggregation'
  assert {args[0].tau for args, _, _ in created} == {TAU}  # args[0]: the factory (self).
  assert _client_work_learning_rate(process) == pytest.approx(CLIENT_LR, rel=1e-6)


def test_num_passes_reaches_the_geometric_median_factory(tmp_path, monkeypatch):
  created = []
  _spy(monkeypatch, aggregators.GeometricMedianFactory, 'create', created)
  _process(tmp_path, '--aggregator=rfa', f'--num_passes={NUM_PASSES}')
  assert created, 'no GeometricMedianFactory built the round\'s aggregation'
  assert {args[0].num_passes for args, _, _ in created} == {NUM_PASSES}


@pytest.mark.parametrize('method', ['fedgma/mean', 'fedavg/elastic'])
def test_client_lr_reaches_the_client_work_of_the_registrys_processes(tmp_path, method):
  """FedGMA (a composed algorithm) and Elastic (a process aggregator) get the optimizers the registry builds."""
  algorithm, aggregator = method.split('/')
  process = _process(tmp_path, f'--algorithm={algorithm}', f'--aggregator={aggregator}', f'--client_lr={CLIENT_LR}')
  assert _client_work_learning_rate(process) == pytest.approx(CLIENT_LR, rel=1e-6)


@pytest.mark.parametrize('algorithm, builder', [('personalized', 'build_personalized_rfa'),
                                               ('scaffold', 'build_scaffold')])
def test_client_lr_reaches_the_optimizer_the_library_builder_gets(tmp_path, monkeypatch, algorithm, builder):
  """Personalized RFA's and SCAFFOLD's client works keep no hyperparameters: the optimizer their library builder
  got."""
  calls = []
  _spy(monkeypatch, tff_gma.learning, builder, calls)
  _process(tmp_path, f'--algorithm={algorithm}', f'--client_lr={CLIENT_LR}')
  (args, kwargs, _), = calls
  client_optimizer = kwargs['client_optimizer_fn'] if 'client_optimizer_fn' in kwargs else args[1]
  assert _optimizer_learning_rate(client_optimizer) == pytest.approx(CLIENT_LR, rel=1e-6)


@pytest.mark.parametrize('args, flag', [
    (('--aggregator=gma', '--tau=1.5'), 'tau'),
    (('--aggregator=rfa', '--num_passes=0'), 'num_passes'),
    (('--client_lr=0',), 'client_lr'),
    (('--client_lr=nan',), 'client_lr'),
])
def test_an_invalid_value_is_refused_in_one_line_naming_its_flag(tmp_path, args, flag):
  """Checked where the configuration is built (the method dataclasses, through `experiment.validate`)."""
  config = _config(tmp_path, *args)
  with pytest.raises(experiment.ConfigError) as refused:
    experiment.validate(config)
  message = str(refused.value)
  assert message.startswith(f'{flag} must ') and '\n' not in message, message
  assert not (tmp_path / 'never').exists()
