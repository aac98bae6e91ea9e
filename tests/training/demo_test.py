"""The demo end to end at toy size: every kind of method through the one registry, its table and its files."""

import csv
import json
import os
import subprocess

import pytest

import tests
from training import demo


def _demo(tmp_path, *flags):
  return subprocess.run(
      ['bash', os.path.join(tests.ROOT, 'scripts', 'demo.sh'), '--rounds=1', '--num_clients=3', '--model=logistic',
       '--local_epochs=1', f'--output_dir={tmp_path / "demo"}', *flags],
      cwd=tmp_path, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))


@pytest.mark.slow
def test_demo_runs_every_kind_of_method(tmp_path):
  names = ['mean', 'rfa', 'elastic', 'fedgma', 'scaffold/gma']
  process = _demo(tmp_path, f'--aggregators={",".join(names)}', '--rounds=2')  # From elsewhere.
  assert process.returncode == 0, process.stderr[-3000:]
  assert 'defaults (no study choice)' in process.stdout  # A 3-client logistic demo is not the study's setting.
  (run_dir,) = list((tmp_path / 'demo').iterdir())
  output = json.loads((run_dir / 'summary.json').read_text())
  summary = output['aggregators']
  assert list(summary) == names
  assert output['attack']['kind'] == 'omniscient' and len(output['attack']['corrupted']) == 1  # 40% of 3.

  def last_row(name):
    with open(run_dir / f'metrics_{name.replace("/", "-")}.csv', newline='') as f:
      return list(csv.DictReader(f))[-1]

  # Both accuracies after the same round, the last, each that round's row of its run's metrics.
  for name, s in summary.items():
    assert s['round'] == 2 and last_row(name)['round'] == '2'
    assert s['clean_accuracy'] == pytest.approx(float(last_row(name)['test/accuracy']))
  attacked = ['mean', 'rfa']  # The FedAvg family with a model aggregator; the others do their own client work.
  for name in attacked:
    row = last_row(f'{name}_attacked')
    assert summary[name]['attacked_round'] == 2 and row['round'] == '2'
    assert summary[name]['attacked_accuracy'] == pytest.approx(float(row['test/accuracy']))
  assert all(summary[name]['attacked_accuracy'] is None for name in names if name not in attacked)
  # The table: method, clean and attacked accuracy at that round, audit; one line under it, as in summary.json.
  lines = process.stdout.splitlines()
  start = lines.index('| method | clean acc. (round 2) | attacked acc. (round 2) | audit |')
  assert lines[start + 1] == '|---|---|---|---|'
  rows = [line.strip('|').split(' | ') for line in lines[start + 2:start + 2 + len(names)]]
  assert [r[0].strip() for r in rows] == names
  for (name, clean, under_attack, verdict), s in zip(rows, summary.values()):
    assert float(clean) == pytest.approx(s['clean_accuracy'], abs=1e-4)
    assert under_attack == ('n/a' if s['attacked_accuracy'] is None else f"{s['attacked_accuracy']:.4f}")
    assert verdict.strip() == s['audit']
  assert lines[start + 2 + len(names)] == output['summary_line']
  assert output['summary_line'].startswith('Round 2, 1 of 3 clients (33%, under half) attacking: ')
  assert (run_dir / 'comparison.md').read_text().splitlines()[-1] == output['summary_line']
  # The audit column: RFA's round moves client data through means only; TFF's stock MeanFactory sums in the clear.
  assert summary['rfa']['audit'] == 'PASS' and summary['mean']['audit'] == 'FAIL (federated_sum)'


def _entry(clean, attacked, rounds=6, attacked_round=6):
  return {'round': rounds, 'clean_accuracy': clean, 'attacked_round': None if attacked is None else attacked_round,
          'attacked_accuracy': attacked, 'audit': 'PASS'}


def test_the_table_puts_both_accuracies_of_one_round_side_by_side():
  summary = {'mean': _entry(0.97, 0.10), 'rfa': _entry(0.96, 0.93), 'elastic': _entry(0.96, None)}
  assert demo.table_lines(summary, 6) == [
      '| method | clean acc. (round 6) | attacked acc. (round 6) | audit |', '|---|---|---|---|',
      '| mean | 0.9700 | 0.1000 | PASS |', '| rfa | 0.9600 | 0.9300 | PASS |', '| elastic | 0.9600 | n/a | PASS |']
  # Accuracies after different rounds are refused, not tabled side by side.
  for wrong in (_entry(0.96, 0.19, attacked_round=3), _entry(0.96, 0.19, rounds=25)):
    with pytest.raises(ValueError, match='rfa: accuracies after rounds'):
      demo.table_lines({'rfa': wrong}, 6)


def test_the_summary_line_says_which_methods_hold_and_why_rfa_falls():
  summary = {'mean': _entry(0.97, 0.10), 'gma': _entry(0.96, 0.10), 'rfa': _entry(0.96, 0.93),
             'rfa_one_step': _entry(0.96, 0.92), 'elastic': _entry(0.96, None)}
  assert demo.summary_line(summary, 6, 4, 10, 'iid', 0.1) == (
      'Round 6, 4 of 10 clients (40%, under half) attacking: rfa, rfa_one_step hold (within 10 points of clean); '
      'mean, gma fall by 86-87 points.')
  falling = {'mean': _entry(0.97, 0.10), 'rfa': _entry(0.96, 0.19)}
  assert demo.summary_line(falling, 6, 5, 10, 'iid', 0.1).endswith(
      'mean, rfa fall by 77-87 points. RFA falls because its guarantee needs fewer than half of the clients corrupt, '
      'and here 5 of 10 are.')
  assert 'RFA falls because on label_skew clients the honest updates differ widely' in demo.summary_line(
      falling, 6, 3, 10, 'label_skew', 0.1)
  assert 'RFA falls because the honest updates spread too widely' in demo.summary_line(falling, 6, 4, 10, 'iid', 0.1)
  assert 'RFA falls' not in demo.summary_line({'mean': _entry(0.97, 0.10)}, 6, 4, 10, 'label_skew', 0.1)
  # A method that learned nothing clean holds nothing: said apart, not counted as holding.
  untrained = {'mean': _entry(0.19, 0.10), 'rfa': _entry(0.29, 0.10)}
  assert demo.summary_line(untrained, 6, 4, 10, 'label_skew', 0.1) == (
      'Round 6, 4 of 10 clients (40%, under half) attacking: rfa falls by 19 points; mean is within 10 points of '
      "chance even clean. RFA falls because on label_skew clients the honest updates differ widely, and the geometric "
      "median's error grows with their spread.")


def test_without_attacked_runs_the_line_says_why():
  assert demo.no_attack_reason(['mean', 'rfa'], 'worker', 0.4, 4, 10) is None
  assert demo.no_attack_reason(['mean'], 'worker', 0.0, 0, 10) == '--corrupt_fraction=0: no attacked runs.'
  assert 'is none of them' in demo.no_attack_reason(['mean'], 'worker', 0.1, 0, 3)
  assert demo.no_attack_reason(['mean', 'rfa'], 'local', 0.4, 4, 10).startswith('--client_execution=local: ')
  assert 'their client work is their own' in demo.no_attack_reason(['elastic', 'fedgma'], 'worker', 0.4, 4, 10)


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
  assert all(s['attacked_accuracy'] is None for s in summary['aggregators'].values())  # The attack needs the worker.
  assert summary['summary_line'].startswith('--client_execution=local: ') and summary['summary_line'] in process.stdout
  (tmp_path / 'x').mkdir()
  refused = _demo(tmp_path / 'x', '--client_execution=local', '--aggregators=mean,scaffold')
  assert refused.returncode != 0 and 'client_execution' in refused.stderr and 'Traceback' not in refused.stderr
