"""A checkpoint belongs to its run: it records the run's id, its settings and the digests of metrics.csv's rows up
to its round, and a resume takes only its own run's checkpoints and rows. A refusal is one line naming the file and
what differs, and nothing in the directory changes; a checkpoint whose record is missing or damaged (a save killed
before it was written) is fallen back past, as a damaged one is."""

import dataclasses
import json
import os
import shutil

import pytest

from tests.training import resume_files_test
from training import config as config_lib
from training.runner import checkpoints
from training.runner import experiment
from training.runner import resume_checks

_TOY = config_lib.ExperimentConfig(dataset='digits', partition='iid', num_clients=3, clients_per_round=3, rounds=3,
                                   model='logistic', batch_size=32, eval_every=1, client_lr=0.1, checkpoint_every=1)
_snapshot = resume_files_test._snapshot  # pylint: disable=protected-access


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  """A finished three-round run saving every round (checkpoints 0, 2, 3 kept), trained once for the module."""
  out = tmp_path_factory.mktemp('finished') / 'run'
  experiment.run(dataclasses.replace(_TOY, output_dir=str(out)), show_progress=False)
  return out


def _copy(finished, tmp_path, name='run'):
  out = tmp_path / name
  shutil.copytree(finished, out, symlinks=True)
  return out


def _refused(config, error=experiment.CheckpointError):
  """The one-line refusal of `config`'s run; nothing in its directory changes."""
  before = _snapshot(config.output_dir)
  with pytest.raises(error) as raised:
    experiment.run(config, show_progress=False)
  text = str(raised.value)
  assert '\n' not in text, text
  assert _snapshot(config.output_dir) == before
  return text


@pytest.mark.slow
def test_another_runs_checkpoints_are_refused_naming_the_checkpoint_and_the_setting(finished, tmp_path):
  other = tmp_path / 'other'  # The same model and data, another client_lr: checkpoints of the same shape.
  experiment.run(dataclasses.replace(_TOY, output_dir=str(other), client_lr=0.05, rounds=2), show_progress=False)
  shutil.rmtree(other / 'checkpoints')
  shutil.copytree(finished / 'checkpoints', other / 'checkpoints')
  text = _refused(dataclasses.replace(_TOY, output_dir=str(other), client_lr=0.05, rounds=4))
  assert text.startswith(f'{other}/checkpoints/program_state_0 is a checkpoint of another run (run id '), text
  assert "client_lr: 0.1 there, 0.05 here" in text and 'another --output_dir' in text, text


def test_checkpoints_with_records_and_no_run_id_are_refused(finished, tmp_path):
  out = _copy(finished, tmp_path)
  os.remove(out / checkpoints.RUN_ID_FILE)
  text = _refused(dataclasses.replace(_TOY, output_dir=str(out)))
  assert 'is a checkpoint of another run (run id ' in text and f'this run has no {checkpoints.RUN_ID_FILE}' in text


def test_a_checkpoint_of_other_settings_under_the_same_id_is_refused(finished, tmp_path):
  """config.json edited to another client_lr, and resumed with that flag: the checkpoints say what they ran."""
  out = _copy(finished, tmp_path)
  config = dataclasses.replace(_TOY, output_dir=str(out), client_lr=0.2)
  (out / 'config.json').write_text(json.dumps(dataclasses.asdict(config)))
  text = _refused(config)
  assert 'trained with other settings, with other settings: client_lr: 0.1 there, 0.2 here' in text, text


def _lines(out):
  return (out / 'metrics.csv').read_bytes().splitlines(keepends=True)


def _set_accuracy(out, round_num, value):
  lines = _lines(out)
  header = lines[0].decode().rstrip('\r\n').split(',')
  fields = lines[round_num].decode().rstrip('\r\n').split(',')
  fields[header.index('test/accuracy')] = value
  lines[round_num] = (','.join(fields) + '\r\n').encode()
  (out / 'metrics.csv').write_bytes(b''.join(lines))


def _delete_row_2(out):
  lines = _lines(out)
  (out / 'metrics.csv').write_bytes(b''.join(lines[:2] + lines[3:]))


def _duplicate_row_2(out):
  lines = _lines(out)
  (out / 'metrics.csv').write_bytes(b''.join(lines[:3] + lines[2:]))


def _swap_rows_1_and_2(out):
  lines = _lines(out)
  (out / 'metrics.csv').write_bytes(b''.join([lines[0], lines[2], lines[1]] + lines[3:]))


@pytest.mark.parametrize('edit, difference', [
    (lambda out: _set_accuracy(out, 3, '0.999'), "round 3's row differs from the one the checkpoint recorded"),
    (_delete_row_2, 'the row of round 2 is missing'),
    (_duplicate_row_2, 'round 2 has more than one row'),
    (_swap_rows_1_and_2, "the rows are out of order (round 2's where round 1's was)"),
], ids=['edited_value', 'deleted_row', 'duplicated_row', 'reordered_rows'])
def test_edited_metrics_rows_refuse_the_resume_naming_the_file_and_the_round(finished, tmp_path, edit, difference):
  out = _copy(finished, tmp_path)
  edit(out)
  text = _refused(dataclasses.replace(_TOY, output_dir=str(out)))
  assert text.startswith(f'{out}/metrics.csv is not the rows of the run checkpointed at round 3 ({difference})'), text


@pytest.mark.slow
def test_a_newest_checkpoint_without_its_record_is_fallen_back_past(finished, tmp_path, caplog):
  """A save killed between the state and its record: round 3 is trained again from round 2's checkpoint, and the
  run ends with the metrics.csv of the uninterrupted run, byte for byte (its rows past round 2 cut back first)."""
  out = _copy(finished, tmp_path)
  latest = out / 'checkpoints' / 'program_state_3'
  (latest / checkpoints.RECORD_FILE).unlink(missing_ok=True)
  rounds_seen = []
  experiment.run(dataclasses.replace(_TOY, output_dir=str(out)), show_progress=False,
                 on_round=lambda r, s: rounds_seen.append(r))
  assert rounds_seen == [3]
  assert any(str(latest) in r.getMessage() and 'its save never finished' in r.getMessage() for r in caplog.records)
  assert (out / 'metrics.csv').read_bytes() == (finished / 'metrics.csv').read_bytes()
  assert (out / 'checkpoints' / 'damaged' / 'program_state_3').is_dir()
  record = json.loads((latest / checkpoints.RECORD_FILE).read_text())
  assert record == json.loads((finished / 'checkpoints' / 'program_state_3' / checkpoints.RECORD_FILE).read_text())


def test_a_damaged_record_is_a_damaged_checkpoint(finished, tmp_path):
  out = _copy(finished, tmp_path)
  (out / 'checkpoints' / 'program_state_3' / checkpoints.RECORD_FILE).write_text('{"run_id": ')
  record, why = checkpoints.read_record(str(out), 3)
  assert record is None and why.startswith(f'its {checkpoints.RECORD_FILE} is damaged (')
  experiment.prepare(dataclasses.replace(_TOY, output_dir=str(out)))  # Left to the resume, which falls back.


def _write_csv(out, text):
  (out / 'metrics.csv').write_bytes(text.encode())


def test_the_rows_digest_survives_the_header_widening_of_later_rows(tmp_path):
  """TFF's CSV release rewrites every row with a wider header when a row brings a new column: not an edit."""
  out = tmp_path
  (out / 'checkpoints' / 'program_state_1').mkdir(parents=True)
  run = checkpoints.start_run_id(str(out))
  assert run['unrecorded_up_to'] == 1  # A run from before checkpoints recorded their run: round 1 is exempt.
  os.remove(out / checkpoints.RUN_ID_FILE)
  shutil.rmtree(out / 'checkpoints' / 'program_state_1')
  run = checkpoints.start_run_id(str(out))
  assert run['unrecorded_up_to'] == -1 and checkpoints.start_run_id(str(out)) == run  # Kept on resume.
  (out / 'checkpoints' / 'program_state_1').mkdir(parents=True)
  identity = resume_checks.run_identity(str(out), dataclasses.asdict(_TOY))
  _write_csv(out, 'round,loss\r\n1,1.5\r\n')
  checkpoints.write_record(str(out), 1, identity)
  _write_csv(out, 'round,loss,test/accuracy\r\n1,1.5,\r\n2,1.25,0.5\r\n2,1.0,')  # Round 2 after the checkpoint.
  checkpoints.check_metrics_rows(str(out))
  _write_csv(out, 'round,loss,test/accuracy\r\n1,1.5,0.9\r\n')
  with pytest.raises(experiment.CheckpointError, match=r"round 1's row differs"):
    checkpoints.check_metrics_rows(str(out))


def test_a_run_from_before_checkpoints_recorded_their_run_resumes_as_before(tmp_path):
  """No run id and checkpoints without records: trusted on config.json alone, as before; the run id written at
  its next start exempts those checkpoints (and only those) from the record."""
  config = dataclasses.replace(_TOY, output_dir=str(tmp_path), rounds=8)
  (tmp_path / 'config.json').write_text(json.dumps(dataclasses.asdict(config)))
  for r in (0, 7):
    (tmp_path / 'checkpoints' / f'program_state_{r}').mkdir(parents=True)
  _write_csv(tmp_path, 'round,loss\r\n1,1.5\r\n')
  experiment.prepare(config)
  checkpoints.start_run_id(str(tmp_path))
  identity = resume_checks.run_identity(str(tmp_path), dataclasses.asdict(config))
  assert [identity.needs_record(r) for r in (0, 7, 8)] == [False, False, True]
  experiment.prepare(config)
