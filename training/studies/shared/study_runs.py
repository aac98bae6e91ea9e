"""A study's runs on disk: one runner directory per run, read back once finished, and shared among processes.

Every cell of a study is one run of the experiment runner (`training.runner.experiment`) into its own directory, so a
stopped study resumes, a finished run is read back from its summary.json (also from an extracted archive of them),
and several processes (`--shard=i/n`) can run parts of a study into one output directory.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import numpy as np

from training import config as config_lib
from training.engine import registry
from training.runner import experiment


def finished_summary(config: config_lib.ExperimentConfig) -> Optional[dict[str, Any]]:
  """The summary of a run already completed with exactly `config`, else None.

  Lets a rerun of the study (e.g. after its cells were run by several processes into one --output_dir) collect
  the finished cells from their summary.json instead of rebuilding each run's process.
  """
  path = os.path.join(config.output_dir, 'summary.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  # A setting missing from an older summary is read at the value that run used (as a resumed run's config.json);
  # where the run's files were (a study's archived cells extracted elsewhere) does not change what it computed.
  # Change nothing a run computes, or (the worker's intra-op threads) only its last bits, as the machine's core
  # count does: an archived run is the same run under any of them.
  where = ('output_dir', 'data_dir', 'workers', 'dataset_placement', 'client_loop', 'worker_intra_op_threads',
           'checkpoint_every')
  saved = json.loads(json.dumps(experiment.completed_config(summary.get('config', {}))))
  wanted = json.loads(json.dumps(dataclasses.asdict(config)))
  same_config = all(saved.get(k) == v for k, v in wanted.items() if k not in where + _unread_settings(config))
  # A run the runner stopped (its update non-finite round after round) is finished too: it cannot go on.
  if same_config and (summary.get('rounds_completed') == config.rounds or 'stopped' in summary):
    return summary
  return None


def _unread_settings(config: config_lib.ExperimentConfig) -> tuple[str, ...]:
  """The method settings `config`'s method does not read (`registry.used_settings`): a run computed the same
  whatever they held, so a default that changed since (`rfa_init` for a `mean` run) does not make it another run."""
  settings = registry.settings_of(config)
  used = registry.used_settings(config.algorithm, config.aggregator, settings, config.corruption)
  return tuple(name for name in settings if name not in used)


def metrics_rows(output_dir: str) -> list[dict[str, float]]:
  """A run's metrics.csv rows, each {column: value} ([] when it has none)."""
  return experiment._read_rows(os.path.join(output_dir, 'metrics.csv'))  # pylint: disable=protected-access


def curve(output_dir: str, key: str) -> list[float]:
  """A run's values of metrics column `key`, over the rounds that have one (e.g. the evaluated rounds)."""
  return [r[key] for r in metrics_rows(output_dir) if key in r]


def curves_with_rounds(output_dir: str, keys: Sequence[str]) -> dict[str, tuple[list[int], list[float]]]:
  """{key: (the rounds that have a value of metrics column `key`, those values)}, from one read of metrics.csv."""
  rows = metrics_rows(output_dir)
  return {key: ([int(r['round']) for r in rows if key in r], [r[key] for r in rows if key in r]) for key in keys}


def mean_of(output_dir: str, suffix: str) -> Optional[float]:
  """Mean over rounds of the first metrics column ending in `suffix` (e.g. GMA's masked_fraction)."""
  rows = metrics_rows(output_dir)
  keys = sorted({k for r in rows for k in r if k.endswith(suffix)})
  values = [r[keys[0]] for r in rows if keys and keys[0] in r]
  return float(np.mean(values)) if values else None


def parse_shard(text: str) -> tuple[int, int]:
  """'i/n' -> (i, n) with 0 <= i < n."""
  index, _, count = text.partition('/')
  try:
    index, count = int(index), int(count)
  except ValueError:
    raise ValueError(f"shard must be 'i/n' with integers 0 <= i < n, got {text!r}") from None
  if not 0 <= index < count:
    raise ValueError(f"shard must be 'i/n' with integers 0 <= i < n, got {text!r}")
  return index, count


class NamedRun(Protocol):
  """A study's run: its name is its directory's."""
  name: str
  tuning: bool


class StagedStudy(Protocol):
  """What `run_all` needs of a study whose later stages depend on its earlier stages' finished runs."""

  def runnable(self, stages: str) -> tuple[list[Any], int]:
    """(runs whose inputs are known, number of cells still blocked on unfinished earlier stages)."""

  def config(self, run: Any) -> config_lib.ExperimentConfig:
    """The runner's configuration of a run."""

  def summary(self, run: Any) -> Optional[dict[str, Any]]:
    """The run's summary once finished, else None."""


def in_shard(run: NamedRun, shard: int, num_shards: int) -> bool:
  """Whether shard `shard` of `num_shards` runs `run`: by a hash of its name, the same in every process.

  A cryptographic hash, not a CRC: a CRC is affine over GF(2), so `crc32 % 2` is a parity of the name's bits and
  names that differ by the same bits (a point's tuning seeds, one grid axis) always share or always split shards;
  a cell's last runs could then all fall to one shard while the other idles."""
  digest = hashlib.sha256(run.name.encode()).digest()
  return int.from_bytes(digest[:8], 'big') % num_shards == shard


def run_all(study: StagedStudy, stages: str, shard: int, num_shards: int, poll_seconds: float = 30.0) -> None:
  """Runs this shard's runs as they become runnable; returns when no run of this shard is left."""
  started, done = time.monotonic(), 0
  while True:
    runs, blocked = study.runnable(stages)
    todo = [r for r in runs if in_shard(r, shard, num_shards) and study.summary(r) is None]
    if not todo:
      pending = [r for r in runs if study.summary(r) is None]
      if not blocked and not pending:
        return
      if stages == 'final' or (num_shards == 1 and not pending):
        # Nothing this shard can run will appear: a `final` shard runs no tuning and needs no other shard's
        # finals, and a lone shard waiting only on blocked cells would wait on itself.
        if blocked:
          print(f'{blocked} (setting, method) cells wait for tuning runs that this call does not run; '
                'run --stage=tune (or all) for them', flush=True)
        return
      time.sleep(poll_seconds)  # Waiting for the other shards' runs of an earlier stage.
      continue
    # One run, then the list again, a final's too: while it ran, another shard's tuning run may have made an earlier
    # setting's runs known, and the list's order (the plan's) puts those first. Keeping the stale list let a shard
    # run a later cell's long finals (hours at E = 20) while the tuning it had just unblocked waited.
    run = todo[0]
    try:
      summary = experiment.run(study.config(run), show_progress=False).summary
    except experiment.TrainingStopped as e:  # A diverged run: finished, scored on the rounds it ran.
      print(f'{run.name}: {e}', flush=True)
      summary = study.summary(run)
    done += 1
    score = summary.get('best_validation_accuracy') if run.tuning else summary.get('best_accuracy')
    print(f'[{done}, {time.monotonic() - started:.0f}s] {run.name}: best '
          f'{"validation" if run.tuning else "test"} {100 * (score or 0):.1f}%', flush=True)


def cost_rows(settings: Sequence[str], runs: Sequence[Any], summary: Callable[[Any], Optional[dict[str, Any]]]
              ) -> list[dict[str, Any]]:
  """Where a round's time goes, per setting and client loop: medians over the finished `runs` (each with a
  `setting`) of seconds per round (training, evaluation, release and checkpoint; `waited` where the summaries have
  it), from each run's summary.json `seconds_by_part`, which counts the rounds of the run's last session; a summary
  without `client_loop` was written before the setting existed, by TFF's iterator loop."""
  out = []
  for setting in settings:
    parts, waited = collections.defaultdict(list), collections.defaultdict(list)
    for run in runs:
      found = summary(run) if run.setting == setting else None
      if found is not None and 'seconds_by_part' in found and found['seconds_by_part']['rounds'] > 0:
        p, loop = found['seconds_by_part'], found.get('client_loop', 'iterator')
        parts[loop].append(
            [p['train'] / p['rounds'], p['evaluate'] / p['rounds'], p['release_and_checkpoint'] / p['rounds']])
        if 'waited' in p:
          waited[loop].append(p['waited'] / p['rounds'])
    for loop in config_lib.CLIENT_LOOPS:
      if parts[loop]:
        train, evaluate, release = (float(x) for x in np.median(np.asarray(parts[loop]), axis=0))
        out.append({'setting': setting, 'client_loop': loop, 'runs': len(parts[loop]), 'train': train,
                    'evaluate': evaluate, 'release_and_checkpoint': release,
                    'waited': float(np.median(waited[loop])) if waited[loop] else None})
  return out


def cost_table(rows: Sequence[dict[str, Any]]) -> str:
  """`cost_rows` as a markdown table, with the share of the parts' own time that is not training; a `waited`
  column (the rounds' wait for the after-round work run beside them) where a row has one."""
  waits = any(r.get('waited') is not None for r in rows)
  lines = ['| setting | client loop | runs | train s/round | evaluate s/round | release + checkpoint s/round | '
           'not training |' + (' waited s/round |' if waits else ''), '|---|---|---|---|---|---|---|'
           + ('---|' if waits else '')]
  for r in rows:
    train, evaluate, release = r['train'], r['evaluate'], r['release_and_checkpoint']
    waited = '-' if r.get('waited') is None else f"{r['waited']:.3f}"
    lines.append(f"| {r['setting']} | {r['client_loop']} | {r['runs']} | {train:.3f} | {evaluate:.3f} | "
                 f"{release:.3f} | {(evaluate + release) / (train + evaluate + release):.0%} |"
                 + (f' {waited} |' if waits else ''))
  return '\n'.join(lines)
