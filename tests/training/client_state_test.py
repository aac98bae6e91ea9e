"""training.engine.client_state: the clients' kept values, by client id, checkpointed per round beside the server
state."""

import numpy as np
import pytest

from training.engine.client_state import ClientStateStore


def test_store_checkpoints_prunes_and_restores(tmp_path):
  store = ClientStateStore([(2, 3), (3,)], [np.float32, np.float32], what='personal', key='personal')
  np.testing.assert_array_equal(store.get('a')[0], np.zeros((2, 3)))
  for round_num in (1, 2, 3):
    store.set('a', (np.full((2, 3), round_num), np.arange(3)))
    store.set(f'id with spaces {round_num}', (np.ones((2, 3)), np.ones(3)))
    store.checkpoint(str(tmp_path), round_num, keep_total=2)
  assert sorted(p.name for p in (tmp_path / 'personal').iterdir()) == ['round_2.npz', 'round_3.npz']
  restored = ClientStateStore([(2, 3), (3,)], [np.float32, np.float32], what='personal', key='personal')
  restored.restore(str(tmp_path), 2)
  assert len(restored) == 3 and 'id with spaces 3' not in restored
  np.testing.assert_array_equal(restored.get('a')[0], np.full((2, 3), 2.0))
  restored.restore(str(tmp_path), 0)
  assert len(restored) == 0
  with pytest.raises(FileNotFoundError, match='round 1'):
    restored.restore(str(tmp_path), 1)
  with pytest.raises(ValueError, match='shapes'):
    store.set('b', (np.ones(3), np.ones(3)))


def test_store_builds_client_data_under_its_key():
  store = ClientStateStore([(2,)], [np.float32], key='control_variate')
  store.set('a', [np.array([1.0, 2.0])])
  data = store.client_data('a', 'batches-of-a')
  assert list(data) == ['batches', 'control_variate'] and data['batches'] == 'batches-of-a'
  (element,) = list(data['control_variate'])
  np.testing.assert_array_equal(element[0], [1.0, 2.0])
  with pytest.raises(ValueError, match='LearningProcessWithClientState'):
    ClientStateStore.for_process(object())
