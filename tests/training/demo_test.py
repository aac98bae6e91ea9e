"""The demo end to end at toy size: every kind of method through the one registry, its table and its files."""

import json
import os
import subprocess

import pytest

import tests
from training import demo


def _demo(tmp_path, *flags):
  return subprocess.run(
      ['bash', os.path.join(tests.ROOT, 'scripts', 'demo.sh'), '--rounds=1', '--num_clients=3', '--model=logistic',
       f'--output_dir={tmp_path / "demo"}', *flags],
      cwd=tmp_path, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))


@pytest.mark.slow
def test_demo_runs_every_kind_of_method(tmp_path):
  names = ['mean', 'rfa', 'elastic', 'fedgma', 'scaffold/gma']
  process = _demo(tmp_path, f'--aggregators={",".join(names)}', '--omniscient_rounds=1')  # From elsewhere.
  assert process.returncode == 0, process.stderr[-3000:]
  for name in names:
    assert f'| {name} |' in process.stdout
  assert 'defaults (no study choice)' in process.stdout  # A 3-client logistic demo is not the study's setting.
  (run_dir,) = list((tmp_path / 'demo').iterdir())
  summary = json.loads((run_dir / 'summary.json').read_text())['aggregators']
  assert list(summary) == names
  assert all(0 <= s['final_accuracy'] <= 1 for s in summary.values())
  assert all((run_dir / f'metrics_{name.replace("/", "-")}.csv').exists() for name in names)
  # The audit column: RFA's round moves client data through means only; TFF's stock MeanFactory sums in the clear.
  assert summary['rfa']['audit'] == 'PASS' and summary['mean']['audit'] == 'FAIL (federated_sum)'
  assert '| rfa |' in process.stdout and '| PASS |' in process.stdout
  # The omniscient column: for the FedAvg family with a model aggregator; n/a for methods with their own client work.
  assert 0 <= summary['rfa']['omniscient_accuracy'] <= 1 and summary['elastic']['omniscient_accuracy'] is None


def test_demo_takes_the_study_hyperparameters_of_its_setting(tmp_path):
  study = tmp_path / 'gma_study.json'
  study.write_text(json.dumps([
      {'setting': 'label10', 'algorithm': 'fedavg', 'aggregator': 'mean', 'client_lr': 0.1, 'server_lr': 1.5,
       'tau': None},
      {'setting': 'label10', 'algorithm': 'fedavg', 'aggregator': 'gma', 'client_lr': 0.01, 'server_lr': 1.0,
       'tau': 0.6},
      {'setting': 'label100', 'algorithm': 'fedavg', 'aggregator': 'gma_binary', 'client_lr': 0.05,
       'server_lr': 1.0, 'tau': 0.2},
  ]))
  chosen = demo.choose_hyperparameters(['mean', 'gma', 'gma_binary', 'rfa'], str(study), True)
  assert (chosen['mean'].algorithm_config.client_lr, chosen['mean'].algorithm_config.server_lr) == (0.1, 1.5)
  assert (chosen['gma'].algorithm_config.client_lr, chosen['gma'].params.tau) == (0.01, 0.6)
  assert 'GMA study (label10)' in chosen['gma'].source
  # Not tuned in label10 (gma_binary only elsewhere, RFA not at all): FedAvg-mean's learning rates, said so.
  for name in ('gma_binary', 'rfa'):
    assert chosen[name].algorithm_config.client_lr == 0.1 and 'not tuned' in chosen[name].source
  assert chosen['gma_binary'].params.tau == 0.4
  # Another setting than the study's, or no study: the defaults.
  for args in ((str(study), False), (str(tmp_path / 'missing.json'), True)):
    assert demo.choose_hyperparameters(['gma'], *args)['gma'].source == 'defaults (no study choice)'


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
