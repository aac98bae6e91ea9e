"""The Fashion-MNIST GMA study: tuning over partitions with the edge rule, its comparisons and claims, and the
read-back of finished runs into the side-by-side report (on run directories the test writes). The intervals, verdicts
and the edge rule's ladder steps are `training.studies.shared`'s (studies_shared_test.py)."""

import csv
import dataclasses
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

import tests
from training.runner import experiment
from training.studies import gma_fmnist
from training.studies.shared import fmnist_protocol

_ROOT = tests.ROOT


def _finish(study, run, score=None, test_curve=None, validation_curve=None):
  """Writes what a finished run leaves: summary.json (with its config) and metrics.csv."""
  config = study.config(run)
  os.makedirs(config.output_dir, exist_ok=True)
  with open(os.path.join(config.output_dir, 'summary.json'), 'w') as f:
    json.dump({'best_validation_accuracy': score, 'rounds_completed': config.rounds,
               'seconds_by_part': {'train': 0.5 * config.rounds, 'evaluate': 0.1 * config.rounds,
                                   'release_and_checkpoint': 0.05 * config.rounds, 'rounds': config.rounds},
               'config': dataclasses.asdict(config)}, f)
  curve = test_curve if test_curve is not None else validation_curve
  key = 'test/accuracy' if test_curve is not None else 'validation/accuracy'
  rows = [{'round': i + 1, key: v} for i, v in enumerate(curve or [score] * config.rounds)]
  with open(os.path.join(config.output_dir, 'metrics.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)


def _finish_point(study, setting, method, point, scores):
  for run, score in zip(study.tuning_runs(setting, method, point), scores):
    _finish(study, run, score)


def test_tuning_scores_points_by_the_mean_over_partitions_then_applies_the_edge_rule_then_tau(tmp_path):
  study = gma_fmnist.Study(['fmnist_label500'], ['fedavg/gma'], (0, 1), (2, 3), str(tmp_path), rounds=3)
  setting, method = 'fmnist_label500', ('fedavg', 'gma')
  points, chosen, _ = study.tuned(setting, method)
  assert chosen is None and len(points) == 9  # The SGD grid: client lr {0.01, 0.05, 0.1} x server lr {1, 1.5, 2}.
  assert {(p.client_lr, p.server_lr) for p in points} == {(c, s) for c in (0.01, 0.05, 0.1) for s in (1.0, 1.5, 2.0)}
  runs, blocked = study.runnable('all')
  assert len(runs) == 18 and blocked == 1 and all(r.tuning and r.tau == 0.4 for r in runs)
  for p in points:
    _finish_point(study, setting, method, p, [0.5, 0.5])
  # Partition 0 alone would pick (0.1, 1.0); the mean over both partitions picks (0.05, 2.0), an edge of the grid.
  _finish_point(study, setting, method, gma_fmnist.Point(0.1, 1.0, 0.4), [0.9, 0.5])
  _finish_point(study, setting, method, gma_fmnist.Point(0.05, 2.0, 0.4), [0.8, 0.8])
  points, chosen, _ = study.tuned(setting, method)
  assert chosen is None and points[9:] == [gma_fmnist.Point(0.05, 3.0, 0.4)]  # Server lr one step past 2.
  _finish_point(study, setting, method, points[9], [0.85, 0.85])  # The extension wins.
  points, chosen, found = study.tuned(setting, method)
  assert found['edge'] and chosen is None  # Tau is next, at the extension's learning rates.
  assert points[10:] == [gma_fmnist.Point(0.05, 3.0, 0.2), gma_fmnist.Point(0.05, 3.0, 0.6)]
  _finish_point(study, setting, method, points[10], [0.7, 0.7])
  _finish_point(study, setting, method, points[11], [0.86, 0.86])
  points, chosen, _ = study.tuned(setting, method)
  assert chosen == gma_fmnist.Point(0.05, 3.0, 0.6)
  finals = study.final_runs(setting, method, chosen)
  assert [r.seed for r in finals] == [2, 3] and not any(r.tuning for r in finals)
  runs, blocked = study.runnable('final')
  assert runs == finals and blocked == 0
  for run in finals:
    config = study.config(run)
    assert (config.validation_fraction == 0 and (config.eval_every, config.eval_last_rounds) == (5, 10)
            and config.tau == 0.6)


def test_avg_gets_no_tau_stage_and_adaptive_servers_their_own_grid(tmp_path):
  study = gma_fmnist.Study(['fmnist_label500'], [], (0,), (2, 3), str(tmp_path), rounds=3)
  points, _, _ = study.tuned('fmnist_label500', ('fedyogi', 'mean'))
  assert {(p.client_lr, p.server_lr) for p in points} == {(c, s) for c in (0.01, 0.05, 0.1) for s in (0.01, 0.1)}
  for p in points:
    _finish_point(study, 'fmnist_label500', ('fedyogi', 'mean'), p, [0.9 if p == gma_fmnist.Point(0.05, 0.1, 0.4)
                                                                      else 0.5])
  points, chosen, found = study.tuned('fmnist_label500', ('fedyogi', 'mean'))
  # Server lr 0.1 is the grid's top edge: one step past it is 1.0 (a cut value comes back); no tau stage for AVG.
  assert points[6:] == [gma_fmnist.Point(0.05, 1.0, 0.4)] and chosen is None
  _finish_point(study, 'fmnist_label500', ('fedyogi', 'mean'), points[6], [0.1])
  _, chosen, found = study.tuned('fmnist_label500', ('fedyogi', 'mean'))
  assert chosen == gma_fmnist.Point(0.05, 0.1, 0.4) and not found['edge']


def test_every_setting_and_method_is_a_valid_runner_config(tmp_path):
  study = gma_fmnist.Study(list(gma_fmnist.SETTINGS), [], fmnist_protocol.TUNE_SEEDS, fmnist_protocol.FINAL_SEEDS,
                           str(tmp_path))
  assert len(fmnist_protocol.FINAL_SEEDS) >= 5
  assert not set(fmnist_protocol.FINAL_SEEDS) & set(fmnist_protocol.TUNE_SEEDS)
  assert len(fmnist_protocol.TUNE_SEEDS) >= 2
  for setting in study.settings:
    for method in study.methods[setting]:
      run = study.tuning_runs(setting, method, study.tuned(setting, method)[0][0])[0]
      config = study.config(run)
      experiment.validate(config)
      assert (config.dataset, config.model, config.local_epochs, config.client_momentum) == (
          'fashion_mnist', 'lenet', 1, 0.9)
      assert config.validation_fraction == fmnist_protocol.VALIDATION_FRACTION
  assert {m for m in fmnist_protocol.METHODS} >= {(a, g) for a in ('fedavg', 'fedprox', 'fedadam', 'fedyogi')
                                               for g in ('mean', 'gma')}
  assert {('fedadam', 'gma_dropin'), ('fedyogi', 'gma_dropin')} <= set(fmnist_protocol.METHODS)


def test_collect_reads_finished_runs_back_into_the_side_by_side_report(tmp_path):
  setting = 'fmnist_label500'
  study = gma_fmnist.Study([setting], ['fedavg/mean', 'fedavg/gma'], (0,), (2, 3, 4), str(tmp_path), rounds=12)
  for method, level in ((('fedavg', 'mean'), 0.70), (('fedavg', 'gma'), 0.72)):
    points, _, _ = study.tuned(setting, method)
    for p in points:  # Every grid point equal: the first wins; it is an edge, so one extension per axis follows.
      _finish_point(study, setting, method, p, [0.6])
    while True:
      points, chosen, _ = study.tuned(setting, method)
      for p in points:
        if study.score(setting, method, p) is None:
          _finish_point(study, setting, method, p, [0.5])
      if chosen is not None:
        break
    for k, run in enumerate(study.final_runs(setting, method, chosen)):
      _finish(study, run, test_curve=[level + 0.01 * k] * 11 + [level + 0.01 * k + 0.05])
    if method == ('fedavg', 'mean'):  # AVG's finals done, GMA's not yet: no part of the cell is reported.
      assert gma_fmnist.collect(study) == []
  records = gma_fmnist.collect(study)
  assert [(r['algorithm'], r['aggregator']) for r in records] == [('fedavg', 'mean'), ('fedavg', 'gma')]
  rows = gma_fmnist.comparisons(records)
  assert len(rows) == 1
  row = rows[0]
  # Per seed GMA - AVG = 2 points on both metrics, no spread: the interval is the point, GMA ahead.
  for metric in ('best', 'last10'):
    assert row[metric]['differences'] == pytest.approx([2.0, 2.0, 2.0])
    assert row[metric]['low'] == pytest.approx(2.0) and row[metric]['verdict'] == 'GMA ahead'
  assert row['best']['avg'] == pytest.approx(100 * np.mean([0.75, 0.76, 0.77]))
  assert row['last10']['avg'] == pytest.approx(100 * np.mean([0.705, 0.715, 0.725]))
  assert row['paper'] == {'avg': 78.02, 'gma': 78.82, 'gap': pytest.approx(0.80)}
  assert [r['rounds'] for r in records] == [12, 12] and [r['evaluations'] for r in records] == [12, 12]
  assert records[0]['collapsed'] == [False] * 3
  report = gma_fmnist.write_results(study, records)
  assert '78.02 -> 78.82 (+0.80)' in report and 'GMA ahead' in report
  assert 'fmnist_label500: label skew k=2, 500 clients, 10 per round, 12 rounds' in report
  assert ('"GMA outperforms AVG", fmnist_label500: last-10 (primary): GMA ahead 1, AVG ahead 0, undecided 0 of 1'
          in report)
  assert 'AVG 0 of 3, GMA (all variants) 0 of 3' in report
  assert '"More so when non-iid": not tested' in report
  assert (tmp_path / 'results.png').stat().st_size > 0
  assert '| 0.500 | 0.100 | 0.050 | 23% |' in report  # Where a round's time goes: (0.1 + 0.05) / 0.65.
  saved = json.loads((tmp_path / 'results.json').read_text())
  assert saved['comparisons'][0]['best']['verdict'] == 'GMA ahead' and len(saved['records']) == 2


def test_invalid_settings_fail_with_one_line(tmp_path):
  proc = subprocess.run([sys.executable, '-m', 'training.studies.gma_fmnist', '--settings=fmnist_label7',
                         f'--output_dir={tmp_path / "x"}'], cwd=_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and 'unknown setting' in proc.stderr and 'Traceback' not in proc.stderr
  assert not (tmp_path / 'x').exists()


def test_a_run_the_runner_stopped_is_finished_and_scores_what_it_reached(tmp_path):
  # A diverged tuning run (stopped after 5 non-finite rounds, before any evaluation) must not block the grid.
  study = gma_fmnist.Study(['fmnist_label500'], ['fedavg/mean'], (0,), (2, 3), str(tmp_path), rounds=30)
  point = gma_fmnist.Point(0.1, 2.0, 0.4)
  (run,) = study.tuning_runs('fmnist_label500', ('fedavg', 'mean'), point)
  config = study.config(run)
  os.makedirs(config.output_dir)
  with open(os.path.join(config.output_dir, 'summary.json'), 'w') as f:
    json.dump({'best_validation_accuracy': None, 'rounds_completed': 4, 'stopped': 'stopped after round 5 of 30',
               'config': dataclasses.asdict(config)}, f)
  assert study.summary(run) is not None and study.score('fmnist_label500', ('fedavg', 'mean'), point) == 0.0


def test_equal_learning_rate_pairs_and_the_claims_read_the_tuning_runs(tmp_path):
  setting = 'fmnist_label500'
  study = gma_fmnist.Study([setting], ['fedavg/mean', 'fedavg/gma'], (0, 1), (2, 3), str(tmp_path), rounds=3)
  points = study.tuned(setting, ('fedavg', 'mean'))[0]
  for k, p in enumerate(points):  # AVG 0.5 everywhere; GMA above at the first 3 points, below at the next 2.
    _finish_point(study, setting, ('fedavg', 'mean'), p, [0.5, 0.5])
    if k < 5:
      _finish_point(study, setting, ('fedavg', 'gma'), p, [0.6, 0.5] if k < 3 else [0.4, 0.4])
  pairs = gma_fmnist.equal_lr_pairs(study, setting)
  assert [(a, g, p) for a, g, p, _ in pairs] == [('fedavg', 'gma', p) for p in points[:5]]
  assert [scores for *_, scores in pairs] == pytest.approx([(0.5, 0.55)] * 3 + [(0.5, 0.4)] * 2)
  assert not any('pairs' in line for line in gma_fmnist.claims(study, [], []))  # No finished cell: not reported.
  cell = [{'setting': setting, 'algorithm': 'fedavg', 'aggregator': 'mean', 'collapsed': [False]}]
  lines = gma_fmnist.claims(study, cell, [])
  assert any('GMA above AVG in 3 of 5 pairs, below in 2, equal in 0; median difference +5.00 points. Only GMA '
             'learns in 0, only AVG in 0, neither in 0.' in line for line in lines)


def test_more_so_when_non_iid_compares_the_two_cells_gaps(tmp_path):
  study = gma_fmnist.Study(['fmnist_label100', 'fmnist_iid100'], ['fedavg/mean', 'fedavg/gma'], (0,), (2, 3, 4),
                           str(tmp_path))

  def record(setting, aggregator, best):
    return {'setting': setting, 'algorithm': 'fedavg', 'aggregator': aggregator, 'best': best, 'last10': best,
            'collapsed': [False] * len(best)}

  records = [record('fmnist_label100', 'mean', [0.80, 0.81, 0.82]),
             record('fmnist_label100', 'gma', [0.83, 0.83, 0.86]),
             record('fmnist_iid100', 'mean', [0.88, 0.88, 0.88]),
             record('fmnist_iid100', 'gma', [0.88, 0.89, 0.87])]
  lines = gma_fmnist.claims(study, records, [])
  # Gaps (points): non-iid [3, 2, 4], iid [0, 1, -1]: difference of means 3, Welch df 4 (equal variances).
  half = 2.776 * np.sqrt(1 / 3 + 1 / 3)
  expected = f'fedavg {3:+.2f} [{3 - half:+.2f}, {3 + half:+.2f}]'
  assert any('"More so when non-iid"' in line and expected in line for line in lines), lines


# The study's committed results: the archive of its finished runs, the json collected from them, the doc.
_ARCHIVE = os.path.join(_ROOT, 'archives', 'gma_fmnist_runs.tar.gz')
_DOC = os.path.join(_ROOT, 'docs', 'research', 'gma_fmnist_study.md')
_DOC_JSON = os.path.join(_ROOT, 'docs', 'research', 'gma_fmnist_study.json')


def test_the_archived_runs_collect_into_the_committed_json_byte_for_byte(tmp_path):
  with tarfile.open(_ARCHIVE) as tar:
    tar.extractall(tmp_path / 'runs', filter='data')
  proc = subprocess.run([sys.executable, '-m', 'training.studies.gma_fmnist', '--stage=collect',
                         f'--output_dir={tmp_path}'], cwd=_ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(_DOC_JSON, 'rb') as f:
    assert (tmp_path / 'results.json').read_bytes() == f.read()


def test_the_docs_tables_and_claims_are_the_committed_jsons():
  with open(_DOC_JSON) as f:
    saved = json.load(f)
  with open(_DOC, encoding='utf-8') as f:
    doc = f.read()
  settings = list(dict.fromkeys(r['setting'] for r in saved['records']))
  assert settings, 'the committed json holds no finished cell'
  for setting in settings:
    assert gma_fmnist.side_by_side(saved['comparisons'], setting) in doc, f'{setting}: side-by-side table differs'
    assert gma_fmnist.table(saved['records'], setting) in doc, f'{setting}: per-method table differs'
  for line in saved['claims']:
    assert line in doc, f'claim not in the doc as collected: {line}'
  assert saved['cost_table'] in doc
  # Every reported cell is complete: all its methods, every seed at least 5.
  for setting in settings:
    methods = {(r['algorithm'], r['aggregator']) for r in saved['records'] if r['setting'] == setting}
    assert methods == set(gma_fmnist.SETTINGS[setting].methods), setting
    assert all(len(r['best']) >= 5 for r in saved['records'])
