"""Personalized RFA through the runner: the clients' v_k are checkpointed per round and a run resumes exactly."""

import dataclasses
import os

import numpy as np
import pytest

from tests.training import interrupt
from training import config as config_lib
from training.engine.client_state import ClientStateStore
from training.runner import experiment

_TOY = config_lib.ExperimentConfig(
    dataset='digits', partition='label_skew', num_clients=5, clients_per_round=3, rounds=2, model='logistic',
    batch_size=32, client_lr=0.1, algorithm='personalized', aggregator='rfa', seed=2, checkpoint_every=1)


def test_update_corruption_is_refused_for_personalized_rfa():
  with pytest.raises(ValueError, match='corruption'):
    experiment.validate(dataclasses.replace(_TOY, corruption='omniscient', corrupt_fraction=0.2))


def test_personalized_rfa_runs_and_resumes_exactly(tmp_path):
  whole = experiment.run(dataclasses.replace(_TOY, output_dir=str(tmp_path / 'a')), show_progress=False)
  config_b = dataclasses.replace(_TOY, output_dir=str(tmp_path / 'b'))
  interrupt.run_until(config_b, 1)
  assert os.path.exists(tmp_path / 'b' / 'personal' / 'round_1.npz')
  resumed = experiment.run(config_b, show_progress=False)

  for a, b in zip(whole.model_weights.trainable, resumed.model_weights.trainable):
    np.testing.assert_array_equal(a, b)
  store_a = ClientStateStore([(64, 10), (10,)], [np.float32, np.float32], what='personal', key='personal')
  store_b = ClientStateStore([(64, 10), (10,)], [np.float32, np.float32], what='personal', key='personal')
  store_a.restore(str(tmp_path / 'a'), 2)
  store_b.restore(str(tmp_path / 'b'), 2)
  assert 3 <= len(store_a) == len(store_b) <= 5  # Clients of rounds 1 and 2 (3 per round, 5 in all).
  for cid in ['client_000', 'client_001', 'client_002', 'client_003', 'client_004']:
    assert (cid in store_a) == (cid in store_b)
    for a, b in zip(store_a.get(cid), store_b.get(cid)):
      np.testing.assert_array_equal(a, b)
  assert any(np.abs(store_a.get(c)[0]).max() > 0 for c in ['client_000', 'client_001', 'client_002', 'client_003',
                                                            'client_004'] if c in store_a)
  assert 0 <= whole.summary['final_personalized_accuracy'] <= 1
  assert whole.summary['final_personalized_accuracy'] == resumed.summary['final_personalized_accuracy']
  rows = experiment._read_rows(str(tmp_path / 'a' / 'metrics.csv'))
  assert {'personalized/accuracy', 'personalized/shared_accuracy', 'client_work/train/loss'} <= set(rows[-1])
