"""training.safe_files' readers, which training.compare and the runner's resume read a run's files with: a regular
file only (a FIFO or a device refused without blocking), bounded, UTF-8, JSON objects and CSV rows checked."""

import json
import os
import threading

import pytest

from training import safe_files


@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture: these tests read files only (no TFF worker)."""
  yield None


@pytest.mark.parametrize('make, kind', [
    (os.mkfifo, 'a FIFO'),
    (os.mkdir, 'a directory'),
    (lambda path: os.symlink('/dev/zero', path), 'a character device'),
])
def test_only_a_regular_file_is_read(tmp_path, make, kind):
  path = str(tmp_path / 'metrics.csv')
  make(path)
  with pytest.raises(safe_files.DamagedFileError, match=f'^{kind}, not a regular file$') as raised:
    safe_files.read_bytes(path, 100)
  assert raised.value.path == path


def test_a_fifo_with_a_writer_is_refused_too(tmp_path):
  """Even with a writer attached (a read would then wait for its data), nothing is read."""
  path = str(tmp_path / 'summary.json')
  os.mkfifo(path)
  opened = threading.Event()

  def writer():
    fd = os.open(path, os.O_WRONLY)  # Blocks until a reader opens it.
    opened.set()
    os.close(fd)

  thread = threading.Thread(target=writer, daemon=True)
  thread.start()
  reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # Lets the writer's open return.
  try:
    assert opened.wait(10)
    with pytest.raises(safe_files.DamagedFileError, match='a FIFO'):
      safe_files.read_json_object(path)
  finally:
    os.close(reader)
    thread.join(10)


def test_size_is_bounded(tmp_path):
  path = tmp_path / 'metrics.csv'
  path.write_bytes(b'x' * 101)
  assert safe_files.read_bytes(str(path), 101) == b'x' * 101
  with pytest.raises(safe_files.DamagedFileError, match='^101 bytes, more than the 100 such a file may hold$'):
    safe_files.read_bytes(str(path), 100)


@pytest.mark.parametrize('text, reason', [
    (b'{"a": 1', 'not valid JSON: Expecting'),
    (b'[' * 100000, 'JSON nested too deeply to read'),
    (b'[1, 2]', 'not a JSON object but a JSON list'),
    (b'"text"', 'not a JSON object but a JSON str'),
    (b'{"a": "\xff"}', r'not UTF-8 text: byte 0xff at offset 7 \(line 1\)'),
], ids=['cut', 'nested', 'list', 'string', 'non_utf8'])
def test_json_objects_are_checked(tmp_path, text, reason):
  path = tmp_path / 'summary.json'
  path.write_bytes(text)
  with pytest.raises(safe_files.DamagedFileError, match=f'^{reason}'):
    safe_files.read_json_object(str(path))
  path.write_text(json.dumps({'a': [1]}))
  assert safe_files.read_json_object(str(path)) == {'a': [1]}


def test_csv_rows_are_checked(tmp_path):
  path = tmp_path / 'metrics.csv'
  path.write_text('round,a,b\r\n1,0.5,0.25\r\n2,0.75\r\n')
  assert safe_files.read_csv(str(path)) == (['round', 'a', 'b'], [(2, {'round': '1', 'a': '0.5', 'b': '0.25'}),
                                                                   (3, {'round': '2', 'a': '0.75'})])
  path.write_text('round,a\r\n1,0.5\r\n2,0.75,9\r\n')
  with pytest.raises(safe_files.DamagedFileError, match="^line 3 has 3 fields, more than the header's 2$"):
    safe_files.read_csv(str(path))
  path.write_text('round,a\r\n1,' + 'x' * 200_000 + '\r\n')  # Past the csv module's field limit.
  with pytest.raises(safe_files.DamagedFileError, match='^line 2: field larger than field limit'):
    safe_files.read_csv(str(path))
