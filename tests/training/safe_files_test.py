"""training.safe_files: an output directory others can write into is refused, planted links are never written
through (for every file a run writes), and the run's own files are replaced atomically."""

import dataclasses
import os

import pytest

from training import config as config_lib
from training import safe_files
from training.runner import experiment

_TOY = config_lib.ExperimentConfig(dataset='digits', partition='iid', num_clients=3, clients_per_round=3, rounds=1,
                                   model='logistic', batch_size=32)


@pytest.mark.parametrize('mode', [0o777, 0o775, 0o757])
def test_a_directory_others_can_write_is_refused(tmp_path, mode):
  directory = tmp_path / 'shared'
  directory.mkdir()
  os.chmod(directory, mode)
  with pytest.raises(safe_files.UnsafeOutputError, match='writable by other users'):
    safe_files.check_output_dir(str(directory))
  config = dataclasses.replace(_TOY, output_dir=str(directory / 'run'))
  safe_files.check_output_dir(str(directory / 'run'))  # Not there yet: the run creates it.
  with pytest.raises(experiment.UnsafeOutputError, match='writable by other users'):
    experiment.run(dataclasses.replace(config, output_dir=str(directory)), show_progress=False)
  assert os.listdir(directory) == []  # Nothing written.


def test_an_own_sticky_directory_is_accepted(tmp_path):
  directory = tmp_path / 'sticky'
  directory.mkdir()
  os.chmod(directory, 0o1777)
  safe_files.check_output_dir(str(directory))


@pytest.mark.parametrize('name', safe_files.RUN_OUTPUTS)
def test_a_link_planted_at_any_output_name_is_refused_and_its_target_kept(tmp_path, name):
  victim = tmp_path / 'victim'
  victim.write_text('precious')
  out = tmp_path / 'run'
  out.mkdir()
  os.symlink(victim, out / name)
  with pytest.raises(experiment.UnsafeOutputError, match=f'{name} is a symbolic link'):
    experiment.run(dataclasses.replace(_TOY, output_dir=str(out)), show_progress=False)
  assert victim.read_text() == 'precious'
  assert sorted(os.listdir(out)) == [name]


def test_write_atomic_replaces_a_link_instead_of_writing_through_it(tmp_path):
  victim = tmp_path / 'victim'
  victim.write_text('precious')
  os.symlink(victim, tmp_path / 'summary.json')
  safe_files.write_atomic(str(tmp_path / 'summary.json'), '{"ok": 1}')
  assert victim.read_text() == 'precious'
  assert not os.path.islink(tmp_path / 'summary.json')
  assert (tmp_path / 'summary.json').read_text() == '{"ok": 1}'
  assert sorted(os.listdir(tmp_path)) == ['summary.json', 'victim']  # No temporary file left.


def test_a_run_into_a_safe_directory_writes_its_files(tmp_path):
  out = tmp_path / 'run'
  experiment.run(dataclasses.replace(_TOY, output_dir=str(out)), show_progress=False)
  assert {'config.json', 'summary.json', 'metrics.csv', 'accuracy.png'} <= set(os.listdir(out))
  assert not any(name.endswith('.tmp') for name in os.listdir(out))


def test_a_tensorflow_file_error_is_given_back_its_errno_and_path(tmp_path):
  import errno  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  missing = tmp_path / 'missing' / 'metrics.csv'
  with pytest.raises(tf.errors.OpError) as raised:
    with tf.io.gfile.GFile(str(missing), 'w') as f:
      f.write('x')
  error = safe_files.os_error_of(raised.value)
  assert isinstance(error, OSError) and error.errno == errno.ENOENT and error.filename == str(missing)
  full = tf.errors.ResourceExhaustedError(None, None, '/data/run/metrics.csv_temp1666; No space left on device')
  assert (safe_files.os_error_of(full).errno, safe_files.os_error_of(full).filename) == (
      errno.ENOSPC, '/data/run/metrics.csv_temp1666')
  # An eager op's error names the op after the text (SaveV2 out of descriptors under `ulimit -n`).
  descriptors = tf.errors.ResourceExhaustedError(
      None, None, '/run/ckpt/variables_temp; Too many open files [Op:SaveV2]')
  assert (safe_files.os_error_of(descriptors).errno, safe_files.os_error_of(descriptors).filename) == (
      errno.EMFILE, '/run/ckpt/variables_temp')
  # Not a file-system error: left alone.
  assert safe_files.os_error_of(tf.errors.InvalidArgumentError(None, None, 'shapes differ; [2] vs [3]')) is None
  assert safe_files.os_error_of(ValueError('x; No space left on device')) is None


def test_output_paths_are_checked_without_creating_anything(tmp_path):
  afile = tmp_path / 'afile'
  afile.write_text('')
  assert safe_files.output_dir_problem(str(tmp_path / 'new' / 'run')) is None
  assert safe_files.output_dir_problem('') == 'output_dir is empty: give the directory the run writes into'
  assert safe_files.output_dir_problem(str(afile)) == f'output_dir {afile} is a file, not a directory'
  assert safe_files.output_dir_problem(str(afile / 'x'), 'out') == f'out {afile}/x: {afile} is a file, not a directory'
  assert safe_files.output_file_problem(str(tmp_path / 'new' / 'bench.json'), 'output') is None
  assert safe_files.output_file_problem(str(tmp_path), 'output') == (
      f'output {tmp_path} is a directory; give a file\'s path')
  assert safe_files.output_file_problem(str(afile / 'b.json'), 'output') == (
      f'output {afile}/b.json: {afile} is a file, not a directory')
  assert not (tmp_path / 'new').exists()


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary_file(tmp_path, monkeypatch):
  # config.json's resume guard depends on it: a write cut short (a full disk, a kill) keeps the old file or the
  # new one, never a half that would refuse the resume.
  import errno  # pylint: disable=g-import-not-at-top
  target = tmp_path / 'config.json'
  target.write_text('{"seed": 3}')

  def disk_full(src, dst):
    raise OSError(errno.ENOSPC, 'No space left on device', dst)

  monkeypatch.setattr(safe_files.os, 'replace', disk_full)
  with pytest.raises(OSError, match='No space left'):
    safe_files.write_atomic(str(target), '{"seed": 4, "rounds": 10}')
  assert target.read_text() == '{"seed": 3}'
  assert os.listdir(tmp_path) == ['config.json']
