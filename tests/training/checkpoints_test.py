"""Resuming from the newest checkpoint that loads (server state and client state), and the rows kept with it."""

import asyncio
import csv
import os
import shutil

import numpy as np
import pytest
import tensorflow_federated as tff

from training.runner import checkpoints


def _state(value):
  return [np.full([3], value, np.float32), np.int32(value)]


def _save(output_dir, rounds):
  manager = tff.program.FileProgramStateManager(checkpoints.checkpoint_dir(output_dir), keep_total=0)
  for r in rounds:
    asyncio.run(manager.save(_state(r), r))
  return manager


def _damage(path, how):
  if how == 'empty saved_model.pb':
    open(os.path.join(path, 'saved_model.pb'), 'w').close()
  elif how == 'truncated variables':
    data = [f for f in os.listdir(os.path.join(path, 'variables')) if f.startswith('variables.data')][0]
    data = os.path.join(path, 'variables', data)
    with open(data, 'r+b') as f:
      f.truncate(os.path.getsize(data) // 2)
  elif how == 'missing variables/':
    shutil.rmtree(os.path.join(path, 'variables'))
  else:
    raise ValueError(how)


@pytest.mark.parametrize('how', ['empty saved_model.pb', 'truncated variables', 'missing variables/'])
def test_a_damaged_latest_checkpoint_resumes_from_the_previous_one(tmp_path, how):
  out = str(tmp_path)
  manager = _save(out, [0, 2, 3])
  latest = os.path.join(checkpoints.checkpoint_dir(out), 'program_state_3')
  _damage(latest, how)
  restored = []
  resumed = checkpoints.resume(manager, out, _state(0), restored.append)
  assert resumed.round_num == 2 and restored == [2]
  np.testing.assert_array_equal(resumed.state[0], _state(2)[0])
  assert [p for p, _ in resumed.damaged] == [latest]
  message = resumed.message()
  assert 'resuming from round 2' in message and latest in message
  # Moved aside (kept for inspection), so the round can be saved again; TFF's manager no longer lists it.
  assert not os.path.exists(latest) and os.path.isdir(os.path.join(out, 'checkpoints', 'damaged', 'program_state_3'))
  assert checkpoints.saved_rounds(out) == [0, 2]
  asyncio.run(manager.save(_state(3), 3))


def test_a_round_whose_client_state_does_not_load_is_skipped_too(tmp_path):
  out = str(tmp_path)
  manager = _save(out, [0, 2, 3])

  def restore(round_num):
    if round_num == 3:
      raise FileNotFoundError(f'no personal saved for round 3 ({out}/personal/round_3.npz)')

  resumed = checkpoints.resume(manager, out, _state(0), restore)
  assert resumed.round_num == 2
  assert 'client state does not load' in resumed.message() and 'round_3.npz' in resumed.message()


def test_no_loadable_checkpoint_fails_naming_every_damaged_path_and_moves_nothing(tmp_path):
  out = str(tmp_path)
  manager = _save(out, [0, 1])
  paths = [os.path.join(checkpoints.checkpoint_dir(out), f'program_state_{r}') for r in (0, 1)]
  _damage(paths[0], 'missing variables/')
  _damage(paths[1], 'empty saved_model.pb')
  with pytest.raises(checkpoints.CheckpointError) as raised:
    checkpoints.resume(manager, out, _state(0), lambda r: None)
  assert all(p in str(raised.value) for p in paths)
  assert checkpoints.saved_rounds(out) == [0, 1]


def test_no_checkpoint_starts_from_round_zero(tmp_path):
  manager = tff.program.FileProgramStateManager(checkpoints.checkpoint_dir(str(tmp_path)))
  restored = []
  resumed = checkpoints.resume(manager, str(tmp_path), _state(0), restored.append)
  assert (resumed.state, resumed.round_num, resumed.message(), restored) == (None, 0, None, [0])


def test_truncate_rows_keeps_the_rows_up_to_the_resumed_round(tmp_path):
  path = str(tmp_path / 'metrics.csv')
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=['round', 'loss', 'test/accuracy'])
    writer.writeheader()
    writer.writerows([{'round': r, 'loss': 1.0 / r, 'test/accuracy': 0.5} for r in (1, 2, 3)])
  assert checkpoints.truncate_rows(path, 'round', 3) == 0
  assert checkpoints.truncate_rows(path, 'round', 1) == 2
  with open(path, newline='') as f:
    rows = list(csv.DictReader(f))
  assert [r['round'] for r in rows] == ['1'] and list(rows[0]) == ['round', 'loss', 'test/accuracy']


def test_drop_partial_row_keeps_whole_rows(tmp_path):
  path = tmp_path / 'metrics.csv'
  path.write_text('round,a,b\n1,0.1,0.2\n2,0.3,0.4\n')
  assert not checkpoints.drop_partial_row(str(path))
  path.write_text('round,a,b\n1,0.1,0.2\n2,0.3,0.4\n3,0.5,0.6')  # No line end: cut.
  assert checkpoints.drop_partial_row(str(path))
  assert path.read_text() == 'round,a,b\n1,0.1,0.2\n2,0.3,0.4\n'
  path.write_text('round,a,b\n1,0.1,0.2\n2,0.3\n')  # Too few fields.
  assert checkpoints.drop_partial_row(str(path))
  assert path.read_text() == 'round,a,b\n1,0.1,0.2\n'
  assert not checkpoints.drop_partial_row(str(tmp_path / 'missing.csv'))
