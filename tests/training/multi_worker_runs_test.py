"""Each method the runner offers, on two TFF workers, ends as on one worker (to 1e-5; bit for bit as measured):
every algorithm, every aggregator, with and without secure sums, each at least once; RFA's passes in stages, at 1-5
passes and from both starts, personalized RFA with it."""

import dataclasses

import numpy as np
import pytest

from tff_gma import runtime
from training import config as config_lib
from training.runner import experiment

_BASE = config_lib.ExperimentConfig(model='logistic', num_clients=4, clients_per_round=3, batch_size=32, seed=3,
                                    rounds=2, output_dir='unused')
# (algorithm, aggregator, secure): each algorithm, both secure settings, and the aggregators of each kind (the
# GMA masks, one-step RFA, the robust statistics, Elastic, the norm-bounded means). The whole matrix (70 runnable
# combinations, 2 rounds) was measured to end bit for bit as on one worker; these keep each kind in the suite.
_CASES = [
    ('scaffold', 'mean', True), ('personalized', 'mean', False), ('fedgma', 'mean', True), ('fedavg', 'gma', True),
    ('fedprox', 'gma_binary', False), ('fedyogi', 'rfa_one_step', True), ('fedadam', 'krum', False),
    ('fedavg', 'elastic', True), ('fedyogi', 'zeroing_mean', False),
]
# RFA in stages (one computation per Weiszfeld pass): (algorithm, secure, num_passes, rfa_init).
_RFA_CASES = [
    ('fedavg', False, 3, 'zero'), ('fedprox', True, 5, 'mean'), ('fedadam', False, 1, 'zero'),
    ('fedyogi', True, 2, 'zero'), ('fedavg', True, 4, 'mean'), ('personalized', True, 3, 'zero'),
    ('personalized', False, 2, 'mean'),
]
_FAST_RFA_CASE = ('fedavg', False, 3, 'zero')  # The fast tier's multi-stage case.


@pytest.fixture(scope='module')
def two_workers():
  workers = runtime.start_local_workers(2)
  yield ','.join(w.target for w in workers)
  runtime.set_simulation_context()  # Back to the suite's context.
  for w in workers:
    w.stop()


@pytest.mark.slow
@pytest.mark.parametrize('algorithm, aggregator, secure', _CASES, ids=['-'.join(map(str, c)) for c in _CASES])
def test_two_workers_end_as_one(tmp_path, two_workers, algorithm, aggregator, secure):
  _assert_two_end_as_one(tmp_path, two_workers, dataclasses.replace(
      _BASE, algorithm=algorithm, aggregator=aggregator, secure=secure, secure_bound=1.0 if secure else None))


@pytest.mark.parametrize(
    'algorithm, secure, num_passes, rfa_init',
    [c if c == _FAST_RFA_CASE else pytest.param(*c, marks=pytest.mark.slow) for c in _RFA_CASES],
    ids=['-'.join(map(str, c)) for c in _RFA_CASES])
def test_rfa_in_stages_on_two_workers_ends_as_on_one(tmp_path, two_workers, algorithm, secure, num_passes,
                                                     rfa_init):
  _assert_two_end_as_one(tmp_path, two_workers, dataclasses.replace(
      _BASE, algorithm=algorithm, aggregator='rfa', secure=secure, secure_bound=1.0 if secure else None,
      num_passes=num_passes, rfa_init=rfa_init))


def _assert_two_end_as_one(tmp_path, two_workers, config):
  runtime.set_simulation_context()
  one = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'one')), show_progress=False)
  two = experiment.run(dataclasses.replace(config, output_dir=str(tmp_path / 'two'), workers=two_workers),
                       show_progress=False)
  runtime.set_simulation_context()
  for a, b in zip(one.model_weights.trainable, two.model_weights.trainable):
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
  assert not all(np.allclose(w, 0) for w in one.model_weights.trainable)
  rows = lambda run: (tmp_path / run / 'metrics.csv').read_text().splitlines()
  assert [r.split(',')[:1] for r in rows('one')] == [r.split(',')[:1] for r in rows('two')]
  assert one.summary['best_accuracy'] == pytest.approx(two.summary['best_accuracy'], abs=1e-5)
