"""Resuming a run from its checkpoints: the newest one that loads, with its client state and metrics rows.

`resume` tries them newest first, moving damaged ones (and ones without their run record, `RECORD_FILE`) into
`checkpoints/damaged/`; `CheckpointError` names every path when none loads. `check_resume_files` refuses a damaged
metrics.csv, or one whose rows are not the checkpoint's, before anything is written.
Detail: docs/experiments.md#resuming-from-checkpoints"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Any, Optional

import tensorflow_federated as tff

from training import safe_files

CHECKPOINT_DIR = 'checkpoints'
DAMAGED_DIR = 'damaged'  # Under checkpoints/: not `program_state_*`, so TFF's manager ignores it.
PREFIX = 'program_state_'
_VERSION = re.compile(re.escape(PREFIX) + r'(\d+)')
METRICS_FILE = 'metrics.csv'
# What binds checkpoints to their run: the run's id, drawn at its first start and kept on resume (beside config.json,
# not under checkpoints/, so that checkpoints copied from another run do not bring it along) ...
RUN_ID_FILE = 'run_id.json'
# ... and each checkpoint's record of its run, inside the checkpoint's own directory (moved and removed with it):
# the run's id, its settings, and a digest of each metrics.csv row up to the checkpoint's round.
RECORD_FILE = 'run_record.json'


class CheckpointError(RuntimeError):
  """The output directory's run cannot resume: no checkpoint loads (the message names each damaged path and why),
  its `checkpoints` path is not a directory, or its metrics.csv is damaged (the message names the file)."""


def checkpoint_dir(output_dir: str) -> str:
  return os.path.join(output_dir, CHECKPOINT_DIR)


def saved_rounds(output_dir: str) -> list[int]:
  """The rounds of the checkpoints in `output_dir` (ascending; by name, not checked to load). Reads only.

  `CheckpointError` when the `checkpoints` path exists and is not a directory (TFF's manager would fail on it
  later, naming no file)."""
  directory = checkpoint_dir(output_dir)
  if not os.path.isdir(directory):
    if os.path.lexists(directory):
      what = 'a symbolic link to nothing' if os.path.islink(directory) else 'not a directory'
      raise CheckpointError(f'{directory} is {what}: a run keeps its checkpoints in that directory. Move it away '
                            f'(or use another --output_dir)')
    return []
  return sorted(int(m.group(1)) for name in os.listdir(directory)
                if (m := _VERSION.fullmatch(name)) and os.path.isdir(os.path.join(directory, name)))


def _reason(error: BaseException) -> str:
  lines = [line for line in str(error).splitlines() if line.strip()]
  return f'{type(error).__name__}: {lines[0] if lines else "(no message)"}'


@dataclasses.dataclass(frozen=True)
class Resumed:
  state: Any  # None: no checkpoint yet.
  round_num: int  # The round the state is of (0: the initial state, or no checkpoint).
  damaged: tuple[tuple[str, str], ...] = ()  # (path, reason) of each newer checkpoint that did not load.
  moved_to: Optional[str] = None  # Where the damaged ones were moved.

  def message(self) -> Optional[str]:
    """What to tell the user when newer checkpoints were skipped; None otherwise."""
    if not self.damaged:
      return None
    skipped = '; '.join(f'{path} ({reason})' for path, reason in self.damaged)
    return (f'resuming from round {self.round_num}, the newest checkpoint that loads: the newer ones are damaged: '
            f'{skipped}. They were moved to {self.moved_to}; their rounds are trained again.')


def resume(manager: tff.program.FileProgramStateManager, output_dir: str, structure: Any,
           restore_client_state: Callable[[int], None], identity: Optional[RunIdentity] = None) -> Resumed:
  """Loads the newest checkpoint of `output_dir` that loads, with its client state.

  The guarantees: docs/experiments.md#resuming-from-checkpoints.

  Args:
    manager: the run's state manager (rooted at `checkpoint_dir(output_dir)`).
    output_dir: the run's output directory.
    structure: the state structure to load into (the process's initial state).
    restore_client_state: restores the clients' values of a round (raises if they do not load).
    identity: the run's; when given, a checkpoint it does not exempt (`RunIdentity.needs_record`) without a
      readable record is damaged, and one recorded for another run refuses the resume.
  Raises:
    CheckpointError: checkpoints exist but none loads, or the newest with a record is another run's (nothing is
      moved).
  """
  directory = checkpoint_dir(output_dir)
  damaged = []
  for round_num in reversed(saved_rounds(output_dir)):
    path = os.path.join(directory, f'{PREFIX}{round_num}')
    if identity is not None and identity.needs_record(round_num):
      record, why = read_record(output_dir, round_num)
      if record is None:
        damaged.append((path, why))
        continue
      if record['run_id'] != identity.run_id:
        raise CheckpointError(foreign_message(path, record['run_id'], identity.run_id, []))
    try:
      state = asyncio.run(manager.load(round_num, structure))
    except Exception as e:  # pylint: disable=broad-except  # TF's loader raises many types; all mean damaged.
      damaged.append((path, _reason(e)))
      continue
    try:
      restore_client_state(round_num)
    except Exception as e:  # pylint: disable=broad-except
      damaged.append((path, f'its client state does not load: {_reason(e)}'))
      continue
    moved_to = _move_aside([p for p, _ in damaged], directory) if damaged else None
    return Resumed(state, round_num, tuple(damaged), moved_to)
  if damaged and saved_rounds(output_dir) == [0]:  # Only the seeded initial state, which the run makes again.
    moved_to = _move_aside([p for p, _ in damaged], directory)
    restore_client_state(0)
    return Resumed(None, 0, tuple(damaged), moved_to)
  if damaged:
    details = '; '.join(f'{path}: {reason}' for path, reason in damaged)
    raise CheckpointError(f'no checkpoint of {output_dir} loads: {details}. Move the damaged checkpoints away to '
                          f'train from the start, or use another --output_dir.')
  restore_client_state(0)
  return Resumed(None, 0)


def _move_aside(paths: list[str], directory: str) -> str:
  target = os.path.join(directory, DAMAGED_DIR)
  os.makedirs(target, exist_ok=True)
  for path in paths:
    destination = os.path.join(target, os.path.basename(path))
    if os.path.exists(destination):  # Damaged again at the same round: keep the newest copy.
      shutil.rmtree(destination)
    os.replace(path, destination)
  return target


_PARTIAL_SAVE = re.compile(re.escape(PREFIX) + r'[0-9]+_temp[0-9]+')  # TFF's file_utils writes there, then renames.


def remove_partial_saves(output_dir: str) -> list[str]:
  """Removes the temporary directories of checkpoints whose save never finished (a kill or a full disk while
  TFF's manager wrote `program_state_<round>_temp<n>`); returns their paths. TFF ignores them, but they hold up to
  a model's size each and accumulate over interrupted runs."""
  directory = checkpoint_dir(output_dir)
  if not os.path.isdir(directory):
    return []
  removed = []
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if _PARTIAL_SAVE.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
      removed.append(path)
  return removed


def remove_partial_releases(csv_path: str) -> list[str]:
  """Removes what an unfinished release of `csv_path` left beside it: TFF's CSV release manager writes the whole
  file to `<csv_path>_temp<n>` and renames it over `csv_path`; a kill or a full disk in between leaves the
  temporary file (a copy of every row). Returns the paths removed."""
  directory, name = os.path.split(csv_path)
  partial = re.compile(re.escape(name) + r'_temp[0-9]+')
  removed = []
  for entry in sorted(os.listdir(directory or '.')) if os.path.isdir(directory or '.') else []:
    path = os.path.join(directory, entry)
    if partial.fullmatch(entry) and os.path.isfile(path) and not os.path.islink(path):
      os.unlink(path)
      removed.append(path)
  return removed


def _damaged(csv_path: str, reason: str) -> CheckpointError:
  return CheckpointError(f'{csv_path} is damaged ({reason}): the run cannot resume with it. Repair it, move it away '
                         f'to resume without the rows of the rounds trained so far, or use another --output_dir')


def _metrics_text(csv_path: str) -> Optional[str]:
  """metrics.csv's text (None: there is none), read bounded; `CheckpointError` when it is damaged."""
  if not os.path.lexists(csv_path):
    return None
  try:
    return safe_files.read_text(csv_path, safe_files.MAX_CSV_BYTES)
  except safe_files.DamagedFileError as e:
    raise _damaged(csv_path, str(e)) from None


def _partial_row(lines: list[str]) -> bool:
  """Whether the last of `lines` is a row cut while written (no line end, or fewer fields than the header; never
  more fields, which no cut makes: such a row is damaged)."""
  if len(lines) < 2:
    return False
  try:
    header_fields = len(next(csv.reader([lines[0]])))
    last = next(csv.reader([lines[-1]]), [])
  except csv.Error:
    return True  # A cut row may end inside a quoted field; it is dropped as any other cut row.
  if len(last) > header_fields:
    return False
  return not lines[-1].endswith(('\n', '\r')) or len(last) < header_fields


def _round_of(csv_path: str, line: int, row: dict[str, str], key_fieldname: str) -> int:
  """The round of a metrics.csv row: a whole number >= 0 (TFF writes it as an integer); `CheckpointError` naming
  the line when it is not."""
  text = row.get(key_fieldname)
  try:
    value = float(text)
  except (TypeError, ValueError):
    value = None
  if value is None or not value.is_integer() or value < 0:
    raise _damaged(csv_path, f'line {line}: {key_fieldname} {text!r} is not a round number')
  return int(value)


def _rows(csv_path: str, key_fieldname: str) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
  try:
    fieldnames, rows = safe_files.read_csv(csv_path)
  except safe_files.DamagedFileError as e:
    raise _damaged(csv_path, str(e)) from None
  for line, row in rows:
    _round_of(csv_path, line, row, key_fieldname)
  return fieldnames, rows


def check_resume_files(output_dir: str, csv_name: str = 'metrics.csv', key_fieldname: str = 'round') -> None:
  """Raises `CheckpointError` naming the path when the run in `output_dir` cannot resume: its `checkpoints` path
  is not a directory, or its metrics.csv is damaged (a last row cut while written is allowed: the resume drops
  it). Reads only; the runner calls it before it writes anything."""
  saved_rounds(output_dir)
  csv_path = os.path.join(output_dir, csv_name)
  parsed = _parsed_rows(csv_path)
  if parsed is None:
    return
  header, rows = parsed
  for number, fields in enumerate(rows, start=2):
    if len(fields) > len(header):
      raise _damaged(csv_path, f'line {number} has {len(fields)} fields, more than the header\'s {len(header)}')
    _round_of(csv_path, number, dict(zip(header, fields)), key_fieldname)
  check_metrics_rows(output_dir, csv_name, key_fieldname)


def drop_partial_row(csv_path: str) -> bool:
  """Drops a last row of `csv_path` that was cut while written (no line end, or fewer fields than the header);
  returns whether one was dropped. Such a row would otherwise be read back, and summarised, as a round.
  `CheckpointError` when the file is damaged otherwise (see `check_resume_files`)."""
  text = _metrics_text(csv_path)
  if text is None:
    return False
  lines = text.splitlines(keepends=True)
  if not _partial_row(lines):
    return False
  safe_files.write_atomic(csv_path, ''.join(lines[:-1]))
  return True


def truncate_rows(csv_path: str, key_fieldname: str, last_key: int) -> int:
  """Drops the rows of `csv_path` keyed after `last_key` (atomically); returns how many were dropped.

  Resuming from round r, rows of later rounds come from a timeline the run no longer continues (a crash between a
  round's row and its checkpoint, or a damaged checkpoint); `tff.program.CSVFileReleaseManager` would replace them
  only once those rounds are released again. `CheckpointError` naming the file (and line) when it is damaged.
  """
  if not os.path.lexists(csv_path):
    return 0
  fieldnames, numbered = _rows(csv_path, key_fieldname)
  rows = [row for _, row in numbered]
  kept = [row for line, row in numbered if _round_of(csv_path, line, row, key_fieldname) <= last_key]
  if len(kept) == len(rows):
    return 0
  text = io.StringIO(newline='')
  writer = csv.DictWriter(text, fieldnames=fieldnames)
  writer.writeheader()
  writer.writerows(kept)
  safe_files.write_atomic(csv_path, text.getvalue())
  return len(rows) - len(kept)


# Which run a checkpoint belongs to.


@dataclasses.dataclass(frozen=True)
class RunIdentity:
  """What identifies a run: its id (`RUN_ID_FILE`) and the settings that determine its trajectory."""
  run_id: str
  settings: dict[str, Any]  # JSON values, without the settings a resume may change.
  # Checkpoints up to this round were saved before checkpoints recorded their run: they are taken without a record.
  unrecorded_up_to: int = -1

  def needs_record(self, round_num: int) -> bool:
    return round_num > self.unrecorded_up_to


def settings_digest(settings: dict[str, Any]) -> str:
  return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(',', ':')).encode()).hexdigest()


def read_run_id(output_dir: str) -> Optional[dict[str, Any]]:
  """The run's `RUN_ID_FILE` ({'run_id', 'unrecorded_up_to'}); None where there is none; `CheckpointError` naming it
  when it is damaged."""
  path = os.path.join(output_dir, RUN_ID_FILE)
  if not os.path.lexists(path):
    return None
  try:
    value = safe_files.read_json_object(path)
  except (OSError, ValueError) as e:
    value, problem = None, str(e)
  else:
    problem = None if (isinstance(value.get('run_id'), str) and isinstance(value.get('unrecorded_up_to'), int)) \
        else 'not a run id'
  if problem is not None:
    raise CheckpointError(f'{path} is damaged ({problem}): nothing says which checkpoints are this run\'s. Restore '
                          f'it, or use another --output_dir')
  return value


def start_run_id(output_dir: str) -> dict[str, Any]:
  """The run's `RUN_ID_FILE`, written at its first start. A run started before checkpoints recorded their run
  already has checkpoints: those are exempt from the record (`unrecorded_up_to`), the later ones are not."""
  existing = read_run_id(output_dir)
  if existing is not None:
    return existing
  value = {'run_id': uuid.uuid4().hex, 'unrecorded_up_to': max(saved_rounds(output_dir), default=-1)}
  safe_files.write_atomic(os.path.join(output_dir, RUN_ID_FILE), json.dumps(value))
  return value


def record_path(output_dir: str, round_num: int) -> str:
  return os.path.join(checkpoint_dir(output_dir), f'{PREFIX}{round_num}', RECORD_FILE)


def write_record(output_dir: str, round_num: int, identity: RunIdentity) -> None:
  """Records the run in round `round_num`'s saved checkpoint, with metrics.csv's rows up to that round (released
  before the checkpoint). Written last, atomically: a checkpoint without its record is a save that never finished."""
  rows = metrics_rows(os.path.join(output_dir, METRICS_FILE)) or []
  record = {'run_id': identity.run_id, 'round': round_num, 'settings_digest': settings_digest(identity.settings),
            'settings': identity.settings, 'metrics_rows': [[r, d] for r, d in rows if r <= round_num]}
  safe_files.write_atomic(record_path(output_dir, round_num), json.dumps(record))


def _valid_record(record: dict[str, Any], round_num: int) -> bool:
  rows = record.get('metrics_rows')
  return (isinstance(record.get('run_id'), str) and record.get('round') == round_num
          and isinstance(record.get('settings'), dict) and isinstance(record.get('settings_digest'), str)
          and isinstance(rows, list) and all(isinstance(r, list) and len(r) == 2 and isinstance(r[0], int)
                                             and isinstance(r[1], str) for r in rows))


def read_record(output_dir: str, round_num: int) -> tuple[Optional[dict[str, Any]], str]:
  """Round `round_num`'s checkpoint record, or None and why it is damaged (missing: its save never finished)."""
  path = record_path(output_dir, round_num)
  if not os.path.lexists(path):
    return None, f'no {RECORD_FILE}: its save never finished'
  try:
    record = safe_files.read_json_object(path)
  except (OSError, ValueError) as e:
    return None, f'its {RECORD_FILE} is damaged ({e})'
  if not _valid_record(record, round_num):
    return None, f'its {RECORD_FILE} is damaged (not the record of round {round_num})'
  return record, ''


def foreign_message(path: str, theirs: str, ours: Optional[str], differences: list[str]) -> str:
  """The refusal of a checkpoint recorded for another run (`ours` None: this run's id is missing)."""
  differ = f', with other settings: {", ".join(differences)}' if differences else ''
  if theirs == ours:  # Its id, but not the settings it was trained with (an edited config.json).
    what = f'{path} is a checkpoint of this run (run id {theirs}) trained with other settings{differ}'
  else:
    whose = f'this run\'s is {ours}' if ours else f'this run has no {RUN_ID_FILE}'
    what = f'{path} is a checkpoint of another run (run id {theirs}; {whose}){differ}'
  return (f'{what}: a run resumes only from its own checkpoints. Put its own checkpoints back, or use another '
          f'--output_dir')


# metrics.csv's rows as a checkpoint records them.


def _row_digest(header: list[str], fields: list[str]) -> str:
  """A row's digest: of its non-empty cells by column name. TFF's CSV release rewrites the whole file with a
  wider header once a row brings a new column (an evaluation's), which changes earlier rows' bytes but not this."""
  cells = sorted((name, value) for name, value in zip(header, fields) if value != '')
  return hashlib.sha256(json.dumps(cells, separators=(',', ':')).encode()).hexdigest()[:16]


def _parsed_rows(csv_path: str) -> Optional[tuple[list[str], list[list[str]]]]:
  """metrics.csv's header and rows, without a last row cut while written (None: there is no metrics.csv)."""
  text = _metrics_text(csv_path)
  if text is None:
    return None
  lines = text.splitlines(keepends=True)
  if _partial_row(lines):
    lines = lines[:-1]
  try:
    rows = list(csv.reader(io.StringIO(''.join(lines), newline='')))
  except csv.Error as e:
    raise _damaged(csv_path, str(e)) from None
  return (rows[0] if rows else []), rows[1:]


def metrics_rows(csv_path: str, key_fieldname: str = 'round') -> Optional[list[tuple[int, str]]]:
  """(round, digest) of each row of `csv_path` in file order (None: there is no such file)."""
  parsed = _parsed_rows(csv_path)
  if parsed is None:
    return None
  header, rows = parsed
  return [(_round_of(csv_path, number, dict(zip(header, fields)), key_fieldname), _row_digest(header, fields))
          for number, fields in enumerate(rows, start=2)]


def rows_difference(recorded: list[tuple[int, str]], found: list[tuple[int, str]]) -> Optional[str]:
  """How metrics.csv's rows up to a checkpoint's round (`found`) first differ from those it recorded; None: same."""
  found_rounds = [r for r, _ in found]
  for index in range(max(len(recorded), len(found))):
    want = tuple(recorded[index]) if index < len(recorded) else None
    got = tuple(found[index]) if index < len(found) else None
    if want == got:
      continue
    if got is None:
      return f'the row of round {want[0]} is missing'
    if found_rounds.count(got[0]) > 1:
      return f'round {got[0]} has more than one row'
    if want is not None and want[0] == got[0]:
      return f'round {got[0]}\'s row differs from the one the checkpoint recorded'
    if want is None:
      return f'round {got[0]}\'s row is not one the checkpoint recorded'
    if want[0] not in found_rounds:
      return f'the row of round {want[0]} is missing'
    return f'the rows are out of order (round {got[0]}\'s where round {want[0]}\'s was)'
  return None


def _newest_record(output_dir: str, run_id: str) -> Optional[tuple[int, dict[str, Any]]]:
  """The newest checkpoint recorded for `run_id` and its record: where the resume starts, unless its state is
  damaged (the rows of an older one are then a prefix of the same run's)."""
  for round_num in reversed(saved_rounds(output_dir)):
    record, _ = read_record(output_dir, round_num)
    if record is not None and record['run_id'] == run_id:
      return round_num, record
  return None


def check_metrics_rows(output_dir: str, csv_name: str = METRICS_FILE, key_fieldname: str = 'round') -> None:
  """`CheckpointError` naming metrics.csv and the first row that differs when its rows up to the resumed
  checkpoint's round are not those the checkpoint recorded (an edited, deleted, repeated or moved row). Rows after
  that round are the resume's to drop; a missing metrics.csv resumes without the rows of the rounds so far."""
  run = read_run_id(output_dir)
  newest = _newest_record(output_dir, run['run_id']) if run is not None else None
  csv_path = os.path.join(output_dir, csv_name)
  found = metrics_rows(csv_path, key_fieldname) if newest is not None else None
  if found is None:
    return
  round_num, record = newest
  difference = rows_difference([tuple(r) for r in record['metrics_rows']], [r for r in found if r[0] <= round_num])
  if difference is not None:
    raise CheckpointError(
        f'{csv_path} is not the rows of the run checkpointed at round {round_num} ({difference}): resuming would '
        f'keep them. Restore it, move it away to resume without the rows of the rounds trained so far, or use '
        f'another --output_dir')
