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
