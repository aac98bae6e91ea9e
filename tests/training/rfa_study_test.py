"""The RFA robustness study: its grid and claims logic, and the script end to end at toy size."""

import tests
import dataclasses
import json
import os
import subprocess

import pytest

from training.runner import experiment
from training.studies import rfa as rfa_study
from training.studies.shared import study_runs

_ROOT = tests.ROOT


def test_cells_share_the_uncorrupted_runs():
  cells = rfa_study.cells(['logistic'], ['gaussian', 'omniscient'], [0.0, 0.1, 0.4], ['mean', 'rfa'], [0, 1])
  assert len(cells) == 2 * 2 * (1 + 2 * 2)
  assert ('logistic', 'none', 0.0, 'rfa', 1, None) in cells
  assert not any(c.corruption != 'none' and c.rho == 0 for c in cells)
  config = rfa_study.cell_config(rfa_study.Cell('cnn', 'omniscient', 0.25, 'krum', 3), 7, 2, '/tmp/x',
                                     local_epochs=2)
  assert (config.model, config.num_clients, config.clients_per_round, config.aggregator, config.corruption,
          config.corrupt_fraction, config.seed, config.rounds, config.eval_every, config.local_epochs) == (
              'cnn', 20, 10, 'krum', 'omniscient', 0.25, 3, 7, 2, 2)
  experiment.validate(config)
  assert config.client_execution == 'worker'
  # --client_execution reaches every cell; local mode refuses the update corruptions, naming the setting.
  local = rfa_study.cell_config(rfa_study.Cell('cnn', 'data_negate', 0.25, 'rfa', 3), 7, 2, '/tmp/x',
                                    client_execution='local')
  assert local.client_execution == 'local'
  experiment.validate(local)
  with pytest.raises(ValueError, match='client_execution'):
    experiment.validate(rfa_study.cell_config(rfa_study.Cell('cnn', 'omniscient', 0.25, 'rfa', 3), 7, 2, '/tmp/x',
                              client_execution='local'))


def test_aggregator_entries_carry_settings_and_participation_is_a_grid_axis():
  cells = rfa_study.cells(['cnn'], ['omniscient'], [0.0, 0.4], ['rfa+rfa_init=zero+num_passes=5'], [0],
                              [10, 20])
  assert len(cells) == 2 * 2
  configs = [rfa_study.cell_config(c, 3, 1, '/tmp/x') for c in cells]
  assert {(c.aggregator, c.rfa_init, c.num_passes) for c in configs} == {('rfa', 'zero', 5)}
  assert sorted(c.clients_per_round for c in configs) == [10, 10, 20, 20]
  assert len({c.output_dir for c in configs}) == 4  # Each cell its own run directory.
  assert rfa_study.setting_label(configs[-1]) == 'cnn, 20 of 20 per round'
  for bad in ('rfa+num_passes', 'rfa+seed=3', 'rfa+no_such_setting=1', 'rfa+num_passes=x'):
    with pytest.raises(ValueError, match='aggregators|invalid literal'):
      rfa_study.parse_aggregator(bad)


def test_start_goals_are_judged_per_seed():
  def record(setting, clients, corruption, rho, aggregator, seed, accuracy):
    return {'model': 'cnn', 'setting': setting, 'clients_per_round': clients, 'num_clients': 20,
            'corruption': corruption, 'rho': rho, 'aggregator': aggregator, 'seed': seed,
            'final_accuracy': accuracy}
  full, half = 'cnn, 20 of 20 per round', 'cnn, 10 of 20 per round'
  results = []
  for seed in (0, 1):
    results += [record(full, 20, 'none', 0.0, 'rfa', seed, 0.95),
                record(full, 20, 'omniscient', 0.25, 'rfa', seed, 0.93),
                record(full, 20, 'omniscient', 0.4, 'rfa', seed, 0.92 if seed == 0 else 0.80),
                record(half, 10, 'omniscient', 0.4, 'rfa', seed, 0.60),
                record(half, 10, 'omniscient', 0.4, 'median', seed, 0.50 if seed == 0 else 0.70)]
  goals = rfa_study.check_start_goals(results, [0.0, 0.25, 0.4])
  assert len(goals) == 2, goals
  assert 'does not hold (rho=0.4 seed 1: 80.0 vs 95.0)' in goals[0]  # 15 points down for seed 1 only.
  assert 'does not hold (rho=0.4 seed 1: 60.0 vs 70.0)' in goals[1]


def _results(values):
  """values: {(corruption, rho, aggregator): accuracy} for model 'logistic', two seeds each."""
  return [{'model': 'logistic', 'corruption': c, 'rho': rho, 'aggregator': a, 'seed': s,
           'final_accuracy': acc + (0.01 if s else -0.01)} for (c, rho, a), acc in values.items() for s in (0, 1)]


def test_claims_are_judged_from_the_numbers():
  holds = _results({('none', 0.0, 'mean'): 0.80, ('none', 0.0, 'rfa'): 0.79, ('none', 0.0, 'rfa_one_step'): 0.78,
                    ('omniscient', 0.4, 'mean'): 0.05, ('omniscient', 0.4, 'rfa'): 0.60,
                    ('omniscient', 0.4, 'rfa_one_step'): 0.50})
  claims = '\n'.join(rfa_study.check_claims(holds, [0.0, 0.4]))
  assert 'does not hold' not in claims and claims.count('holds') == 4, claims
  assert '(mean - RFA = +1.0 points)' in claims and 'keeps 82% of RFA' in claims
  fails = _results({('none', 0.0, 'mean'): 0.80, ('none', 0.0, 'rfa'): 0.70, ('none', 0.0, 'rfa_one_step'): 0.70,
                    ('omniscient', 0.4, 'mean'): 0.45, ('omniscient', 0.4, 'rfa'): 0.50,
                    ('omniscient', 0.4, 'rfa_one_step'): 0.45})
  claims = '\n'.join(rfa_study.check_claims(fails, [0.0, 0.4]))
  assert claims.count('does not hold') == 4, claims
  table = rfa_study.summarize(holds, [0.0, 0.4])
  assert '**logistic, omniscient**' in table and '| mean | 80.0 +- 1.0 | 5.0 +- 1.0 |' in table
  side_by_side = rfa_study.summarize_at(holds, 0.4)
  assert '| aggregator | logistic, omniscient |' in side_by_side and '| rfa | 60.0 |' in side_by_side


def test_study_script_runs_end_to_end(tmp_path):
  out = tmp_path / 'rfa'
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  study = lambda *extra: subprocess.run(
      ['bash', os.path.join(_ROOT, 'scripts', 'reproduce_rfa.sh'), '--seeds=0', '--rounds=1', '--local_epochs=1',
       '--models=logistic', '--corruptions=omniscient', '--fractions=0,0.4', '--aggregators=mean,rfa',
       f'--output_dir={out}', *extra],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
  proc = study('--shard=1/2')  # Half of the grid first, as one of two processes would.
  assert proc.returncode == 0, proc.stderr[-3000:]
  shard_runs = sorted(os.listdir(out / 'runs'))
  assert len(shard_runs) == 2 and len(json.loads((out / 'results.json').read_text())) == 2
  shard_summaries = {r: (out / 'runs' / r / 'summary.json').stat().st_mtime_ns for r in shard_runs}
  proc = study()  # Then the whole grid: the shard's cells are read back, not run again.
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert {r: (out / 'runs' / r / 'summary.json').stat().st_mtime_ns for r in shard_runs} == shard_summaries
  results = json.loads((out / 'results.json').read_text())
  assert len(results) == 2 * 2  # aggregators x (uncorrupted + omniscient at 0.4)
  assert all(0 <= r['final_accuracy'] <= 1 for r in results)
  report = (out / 'results.md').read_text()
  assert '**logistic, 10 of 20 per round, omniscient**' in report and '| rfa |' in report
  assert 'no seed below median' not in report  # The median did not run: that goal gets no verdict.
  assert report.count('hold') >= 3  # Every claim the runs allow gets a verdict (one-step RFA did not run).
  assert (out / 'results.png').stat().st_size > 1000
  assert len(os.listdir(out / 'runs')) == 4


def test_finished_cells_are_read_back_not_rerun(tmp_path):
  config = rfa_study.cell_config(rfa_study.Cell('logistic', 'gaussian', 0.1, 'mean', 0), 4, 1,
                                     str(tmp_path))
  assert study_runs.finished_summary(config) is None  # Nothing there yet.
  os.makedirs(config.output_dir)
  summary = {'final_accuracy': 0.5, 'best_accuracy': 0.6, 'rounds_completed': 4,
             'config': dataclasses.asdict(config)}
  with open(os.path.join(config.output_dir, 'summary.json'), 'w') as f:
    json.dump(summary, f)
  assert study_runs.finished_summary(config)['best_accuracy'] == 0.6
  # Cells extracted from an archive into another directory are the same cells.
  moved = dict(summary, config=dict(summary['config'], output_dir='/elsewhere/runs/cell'))
  with open(os.path.join(config.output_dir, 'summary.json'), 'w') as f:
    json.dump(moved, f)
  assert study_runs.finished_summary(config)['best_accuracy'] == 0.6
  # A summary written before a setting existed (at its default) still counts as the same cell.
  older = dict(summary, config={k: v for k, v in summary['config'].items() if k != 'membership_inference'})
  with open(os.path.join(config.output_dir, 'summary.json'), 'w') as f:
    json.dump(older, f)
  assert study_runs.finished_summary(config)['best_accuracy'] == 0.6
  # ... at the value it ran with where the default changed since: RFA started from the mean before rfa_init. That
  # makes an RFA run another run, not a mean run (the mean reads no rfa_init: the archived start study's mean cells).
  older = dict(summary, config={k: v for k, v in summary['config'].items() if k != 'rfa_init'})
  with open(os.path.join(config.output_dir, 'summary.json'), 'w') as f:
    json.dump(older, f)
  assert config.rfa_init == 'zero' and study_runs.finished_summary(config)['best_accuracy'] == 0.6
  rfa = dataclasses.replace(config, aggregator='rfa')
  with open(os.path.join(config.output_dir, 'summary.json'), 'w') as f:
    json.dump(dict(older, config=dict(older['config'], aggregator='rfa')), f)
  assert rfa.rfa_init == 'zero' and study_runs.finished_summary(rfa) is None
  assert study_runs.finished_summary(dataclasses.replace(rfa, rfa_init='mean'))['best_accuracy'] == 0.6
  # Nor does a mean run read tau or num_passes: a value it held does not make it another run; a setting it reads does.
  with open(os.path.join(config.output_dir, 'summary.json'), 'w') as f:
    json.dump(dict(summary, config=dict(summary['config'], tau=0.9, num_passes=7)), f)
  assert study_runs.finished_summary(config)['best_accuracy'] == 0.6
  assert study_runs.finished_summary(dataclasses.replace(config, secure=True, secure_bound=1.0)) is None
  with open(os.path.join(config.output_dir, 'summary.json'), 'w') as f:
    json.dump(summary, f)
  # Another setting of the same cell directory, or a run stopped before its last round, must run (again).
  assert study_runs.finished_summary(dataclasses.replace(config, client_lr=0.1)) is None
  summary['rounds_completed'] = 3
  with open(os.path.join(config.output_dir, 'summary.json'), 'w') as f:
    json.dump(summary, f)
  assert study_runs.finished_summary(config) is None
