"""The demo end to end at toy size: every kind of method through the one registry, its table and its files."""

import json
import os
import subprocess

import pytest

import tests


def _demo(tmp_path, *flags):
  return subprocess.run(
      ['bash', os.path.join(tests.ROOT, 'scripts', 'demo.sh'), '--rounds=1', '--num_clients=3', '--model=logistic',
       f'--output_dir={tmp_path / "demo"}', *flags],
      cwd=tmp_path, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))


@pytest.mark.slow
def test_demo_runs_every_kind_of_method(tmp_path):
  names = ['mean', 'rfa', 'elastic', 'fedgma', 'scaffold/gma']
  process = _demo(tmp_path, f'--aggregators={",".join(names)}')  # From another directory than the checkout.
  assert process.returncode == 0, process.stderr[-3000:]
  for name in names:
    assert f'| {name} |' in process.stdout
  (run_dir,) = list((tmp_path / 'demo').iterdir())
  summary = json.loads((run_dir / 'summary.json').read_text())
  assert list(summary['aggregators']) == names
  assert all(0 <= s['final_accuracy'] <= 1 for s in summary['aggregators'].values())
  assert all((run_dir / f'metrics_{name.replace("/", "-")}.csv').exists() for name in names)


@pytest.mark.slow
def test_demo_refuses_an_unknown_method_without_a_traceback(tmp_path):
  process = _demo(tmp_path, '--aggregators=mean,nope')
  assert process.returncode != 0
  assert "unknown method 'nope'" in process.stderr and 'Traceback' not in process.stderr
  assert not (tmp_path / 'demo').exists()


@pytest.mark.slow
def test_demo_trains_clients_locally_and_leaves_out_what_cannot(tmp_path):
  process = _demo(tmp_path, '--client_execution=local')
  assert process.returncode == 0, process.stderr[-3000:]
  assert 'leaving out elastic, fedgma' in process.stdout
  (run_dir,) = list((tmp_path / 'demo').iterdir())
  summary = json.loads((run_dir / 'summary.json').read_text())
  assert 'mean' in summary['aggregators'] and 'elastic' not in summary['aggregators']
  assert all('CPU' in d for s in summary['aggregators'].values() for d in s['client_devices'])
  (tmp_path / 'x').mkdir()
  refused = _demo(tmp_path / 'x', '--client_execution=local', '--aggregators=mean,scaffold')
  assert refused.returncode != 0 and 'client_execution' in refused.stderr and 'Traceback' not in refused.stderr
