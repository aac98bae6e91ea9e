"""A run's setup refused as a setting error where the data says so, and the context readied for its method."""

import dataclasses

import pytest

from tff_gma import runtime
from tff_gma.runtime import contexts as runtime_contexts
from tff_gma.data import idx
from training import config as config_lib
from training.runner import errors
from training.runner import run_setup

_TOY = config_lib.ExperimentConfig(dataset='digits', partition='label_skew', num_clients=4, clients_per_round=3,
                                   rounds=1, model='logistic', seed=3)


def test_what_only_the_data_can_tell_is_a_setting_error_and_a_damaged_file_is_not(monkeypatch):
  with pytest.raises(errors.ConfigError, match='classes_per_client'):  # k above digits' 10 classes.
    run_setup.build_checked_setup(dataclasses.replace(_TOY, classes_per_client=11))
  damaged = idx.IdxError('/data/train-images-idx3-ubyte: truncated')
  monkeypatch.setattr(run_setup, 'build_setup', lambda config: (_ for _ in ()).throw(damaged))
  with pytest.raises(idx.IdxError) as raised:
    run_setup.build_checked_setup(_TOY)
  assert raised.value is damaged


class _Runtime:
  """Records the runtime calls `install_context` makes; `fail` names one to fail with `error`."""

  def __init__(self, monkeypatch, fail=None, error=None, applies=True):
    self.calls = []
    for name in ('check_single_aggregation_stage', 'set_multi_worker_context', 'set_simulation_context',
                 'check_context_runs'):
      monkeypatch.setattr(runtime, name, self._call(name, fail, error))
    monkeypatch.setattr(runtime_contexts, 'simulation_context_applies', lambda: applies)

  def _call(self, name, fail, error):
    def call(*args, **kwargs):
      self.calls.append((name, args, kwargs))
      if name == fail:
        raise error
    return call


def test_the_runners_own_worker_takes_the_runs_intra_op_threads(monkeypatch):
  recorded = _Runtime(monkeypatch)
  run_setup.install_context(dataclasses.replace(_TOY, worker_intra_op_threads=2), 'process')
  assert recorded.calls == [('set_simulation_context', (), {'intra_op_threads': 2}),
                            ('check_context_runs', ('process',), {})]
  left_alone = _Runtime(monkeypatch, applies=False)  # A context the caller installed instead.
  run_setup.install_context(_TOY, 'process')
  assert left_alone.calls == [('check_context_runs', ('process',), {})]


def test_workers_are_checked_against_the_process_then_connected(monkeypatch):
  recorded = _Runtime(monkeypatch)
  run_setup.install_context(dataclasses.replace(_TOY, workers='h1:1,h2:2,'), 'process')
  assert recorded.calls == [('check_single_aggregation_stage', ('process',), {}),
                            ('set_multi_worker_context', (['h1:1', 'h2:2'],), {}),
                            ('check_context_runs', ('process',), {})]


@pytest.mark.parametrize('fail, error, workers, message', [
    ('check_single_aggregation_stage', ValueError('aggregates in 3 sequential stages'), 'h:1',
     '^workers: aggregates in 3 sequential stages$'),
    ('set_multi_worker_context', RuntimeError('no worker answers at h:1'), 'h:1', '^workers: no worker answers'),
    ('set_simulation_context', RuntimeError('the worker\n  exited'), None,
     '^worker_intra_op_threads: the TFF worker did not start with 1 thread\\(s\\): the worker exited$'),
])
def test_a_context_that_cannot_be_readied_is_one_setting_error(monkeypatch, fail, error, workers, message):
  recorded = _Runtime(monkeypatch, fail=fail, error=error)
  with pytest.raises(errors.ConfigError, match=message):
    run_setup.install_context(dataclasses.replace(_TOY, workers=workers), 'process')
  assert recorded.calls[-1][0] == fail  # Nothing after the failed call.
