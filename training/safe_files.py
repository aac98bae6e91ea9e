"""A run's files written so that nobody else's symbolic link can redirect them, and read back within bounds.

Writes: `check_output_dir` refuses a directory others may plant links in, `write_atomic` renames a fresh file over
the target. Reads (`read_bytes` and the readers on it): a regular file only, bounded, UTF-8, else
`DamagedFileError`. Why and how: docs/experiments.md#a-runs-files-safe-from-links"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import re
import secrets
import stat
from collections.abc import Iterable
from typing import Optional

# What a run creates in its output directory (its own files and TFF's), checked for planted links up front.
RUN_OUTPUTS = ('config.json', 'summary.json', 'metrics.csv', 'accuracy.png', 'audit.md', 'membership.json',
               'tensorboard', 'checkpoints', 'personal', 'control_variate', '.run.lock')


class UnsafeOutputError(RuntimeError):
  """The output directory could let another user redirect the run's writes (the message says how)."""


def check_output_dir(directory: str, names: Iterable[str] = RUN_OUTPUTS) -> None:
  """Raises `UnsafeOutputError` if `directory` (when it exists) or one of `names` in it is unsafe to write."""
  try:
    info = os.lstat(directory)
  except FileNotFoundError:
    return  # Created by the run, with the user's umask.
  if stat.S_ISLNK(info.st_mode):
    real = os.path.realpath(directory)
    check_output_dir(real, names)  # A link to a directory is fine when that directory is safe.
    return
  others_write = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
  sticky_and_own = info.st_mode & stat.S_ISVTX and info.st_uid == os.geteuid()
  if others_write and not sticky_and_own:
    raise UnsafeOutputError(
        f'{directory} is writable by other users (mode {stat.filemode(info.st_mode)}): one of them could plant '
        f'links that redirect the run\'s writes. Use a directory only you can write to (chmod go-w), or one of '
        f'yours with the sticky bit')
  for name in names:
    path = os.path.join(directory, name)
    if os.path.islink(path):
      raise UnsafeOutputError(f'{path} is a symbolic link (to {os.readlink(path)}); a run does not write through '
                              f'one. Remove it, or use another --output_dir')


def output_dir_problem(directory: str, flag: str = 'output_dir', shown: Optional[str] = None) -> Optional[str]:
  """Why `directory` could not be created or written into (None: it can), naming `flag`; nothing is created.

  An empty path; a file; a path under a file; a nearest existing ancestor that this user may not write into, or
  that lies on a read-only file system (which even root cannot write). `shown`: the flag's value, when that is
  not `directory` itself (a file's path, whose directory is checked).
  """
  if not isinstance(directory, str) or not directory.strip():
    return f'{flag} is empty: give the directory the run writes into'
  named = f'{flag} {directory}' if shown is None else f'{flag} {shown}: {directory}'
  path = os.path.abspath(directory)
  if os.path.exists(path) and not os.path.isdir(path):
    return f'{named} is a file, not a directory'
  parent = path
  while not os.path.exists(parent):  # The nearest existing ancestor: the run creates the rest.
    parent = os.path.dirname(parent)
  named = f'{flag} {shown or directory}'
  if not os.path.isdir(parent):
    return f'{named}: {parent} is a file, not a directory'
  try:
    read_only = bool(os.statvfs(parent).f_flag & os.ST_RDONLY)
  except OSError:
    read_only = False
  if read_only:
    return f'{named}: {parent} is on a read-only file system'
  if not os.access(parent, os.W_OK | os.X_OK):
    return f'{named}: {parent} is not writable by this user'
  return None


def output_file_problem(path: str, flag: str) -> Optional[str]:
  """Why the file `path` (or files with `path` as their prefix) could not be written (None: it could)."""
  if not isinstance(path, str) or not path.strip():
    return f'{flag} is empty: give the path to write'
  if os.path.isdir(path):
    return f'{flag} {path} is a directory; give a file\'s path'
  return output_dir_problem(os.path.dirname(os.path.abspath(path)), flag, shown=path)


# TensorFlow's file system reports an errno as `tf.errors.OpError` 'CONTEXT; STRERROR' (tsl's errors::IOError).
_ERRNO_OF_STRERROR = {os.strerror(code): code for code in sorted(errno.errorcode, reverse=True)}
# And a path it expected to be a directory as 'PATH is not a directory', without the errno's text.
_NOT_A_DIRECTORY = re.compile(r'(\S.*) is not a directory')


def os_error_of(error: BaseException) -> Optional[OSError]:
  """The `OSError` that a TensorFlow file-system error stands for, or None.

  TensorFlow (and TFF's release and state managers, which write through it) raise a failed write as a
  `tf.errors.OpError` whose message is the path and the C library's text ('/run/metrics.csv_temp1666; No space
  left on device'), not as an `OSError`: this gives it back its errno and path, so a caller handles both alike.
  """
  message = getattr(error, 'message', None)
  if not isinstance(message, str):
    return None
  # An eager op's error (SaveV2 under a full disk or out of descriptors) ends in ' [Op:SaveV2]' after the text.
  message = re.sub(r'\s*\[Op:\w+\]\s*$', '', message)
  # A function's op (a checkpoint's SaveV2) puts '{{function_node NAME}} ' before the path.
  message = re.sub(r'^\s*\{\{function_node [^}]*\}\}\s*', '', message)
  not_a_directory = _NOT_A_DIRECTORY.fullmatch(message.strip())
  if not_a_directory:  # A directory it writes into replaced by a file (FailedPreconditionError).
    return OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), not_a_directory.group(1))
  context, separator, reason = message.strip().rpartition('; ')
  code = _ERRNO_OF_STRERROR.get(reason)
  if not separator or code is None:
    return None
  return OSError(code, reason, context)


# A run's summary.json and config.json hold a few kilobytes; its metrics.csv about 20 bytes per column and round
# (46,000 rounds of 41 columns fill the bound), so these bounds leave orders of magnitude of room and still keep a
# reader's memory bounded: a metrics.csv's rows take more than ten times the file's size in memory once read.
MAX_JSON_BYTES = 1 << 20
MAX_CSV_BYTES = 32 << 20


class DamagedFileError(ValueError):
  """A file that cannot be what it should be: not a regular file, larger than its bound, not UTF-8, or not the
  structure expected. `str()` is the reason alone; `path` is the file."""

  def __init__(self, path: str, reason: str):
    super().__init__(reason)
    self.path = path


def _kind(mode: int) -> str:
  for test, name in ((stat.S_ISDIR, 'a directory'), (stat.S_ISFIFO, 'a FIFO'), (stat.S_ISCHR, 'a character device'),
                     (stat.S_ISBLK, 'a block device'), (stat.S_ISSOCK, 'a socket')):
    if test(mode):
      return name
  return 'a special file'


def read_bytes(path: str, max_bytes: int) -> bytes:
  """The bytes of the regular file `path`, at most `max_bytes` of them, else `DamagedFileError`.

  Refused before any read: anything but a regular file (checked with stat, then again with fstat on the
  descriptor opened with O_NONBLOCK, so a FIFO swapped in between cannot block the open or the read), and a file
  larger than `max_bytes`; one that grows past it while read is refused too. `OSError` as `open` raises it.
  """
  info = os.stat(path)
  if not stat.S_ISREG(info.st_mode):
    raise DamagedFileError(path, f'{_kind(info.st_mode)}, not a regular file')
  fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
  with os.fdopen(fd, 'rb', buffering=0) as f:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
      raise DamagedFileError(path, f'{_kind(info.st_mode)}, not a regular file')
    if info.st_size > max_bytes:
      raise DamagedFileError(path, f'{info.st_size} bytes, more than the {max_bytes} such a file may hold')
    chunks, size = [], 0
    while size <= max_bytes:
      chunk = f.read(max_bytes + 1 - size)
      if not chunk:
        break
      chunks.append(chunk)
      size += len(chunk)
  if size > max_bytes:
    raise DamagedFileError(path, f'more than the {max_bytes} bytes such a file may hold')
  return b''.join(chunks)


def read_text(path: str, max_bytes: int) -> str:
  """`read_bytes` decoded as UTF-8; `DamagedFileError` naming the offset of the first byte that is not."""
  data = read_bytes(path, max_bytes)
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as e:
    line = data.count(b'\n', 0, e.start) + 1
    raise DamagedFileError(path, f'not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} (line {line})'
                           ) from None


def read_json_object(path: str, max_bytes: int = MAX_JSON_BYTES) -> dict:
  """The JSON object in `path`; `DamagedFileError` (a ValueError) saying why when the file is not one (see
  `read_bytes`; not UTF-8, not JSON or nested too deeply to parse, another JSON value). OSError as `open` raises
  it."""
  text = read_text(path, max_bytes)
  try:
    value = json.loads(text)
  except RecursionError:
    raise DamagedFileError(path, 'JSON nested too deeply to read') from None
  except ValueError as e:
    raise DamagedFileError(path, f'not valid JSON: {e}') from None
  if not isinstance(value, dict):
    raise DamagedFileError(path, f'not a JSON object but a JSON {type(value).__name__}')
  return value


def read_csv(path: str, max_bytes: int = MAX_CSV_BYTES) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
  """The header of the CSV file `path` and its rows, each as (line number, {column: text}); a row shorter than the
  header lacks the missing columns. `DamagedFileError` (see `read_text`) for text the csv module cannot parse (a
  NUL byte, an unclosed quote at the end) and for a row with more fields than the header, naming the line."""
  text = read_text(path, max_bytes)
  reader = csv.reader(io.StringIO(text, newline=''))
  try:
    header = next(reader, [])
    rows = []
    for fields in reader:
      if len(fields) > len(header):
        raise DamagedFileError(path, f'line {reader.line_num} has {len(fields)} fields, more than the header\'s '
                               f'{len(header)}')
      rows.append((reader.line_num, dict(zip(header, fields))))
  except csv.Error as e:
    raise DamagedFileError(path, f'line {reader.line_num}: {e}') from None
  return header, rows


def write_atomic(path: str, data: bytes | str) -> None:
  """Writes `data` to `path` without following a link there: a fresh file beside it, renamed over it."""
  directory, name = os.path.split(path)
  tmp = os.path.join(directory, f'.{name}.{secrets.token_hex(6)}.tmp')
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data.encode('utf-8') if isinstance(data, str) else data)
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
    raise
