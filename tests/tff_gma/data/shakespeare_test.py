"""Shakespeare's tokenisation (`tff_gma.data.shakespeare`): ids, chunking, padding, against hand-computed ids
and TFF's own baseline preprocessing."""

import numpy as np
import pytest
import tensorflow_federated as tff
from tensorflow_federated.python.simulation.baselines.shakespeare import char_prediction_preprocessing

from tff_gma.data import shakespeare

BOS, EOS, OOV, PAD = 88, 89, 87, 0  # Hand-written: 86 characters at 1..86, then OOV, BOS, EOS.


def _decode(ids):
  return ''.join(shakespeare.CHAR_VOCAB[i - 1] for i in ids)


def _tff_baseline_sequences(ds, sequence_length):
  """TFF's own Shakespeare preprocessing, an independent reference for the tokenisation."""
  spec = tff.simulation.baselines.ClientSpec(num_epochs=1, batch_size=10_000, shuffle_buffer_size=1)
  batches = list(char_prediction_preprocessing.create_preprocess_fn(spec, sequence_length)(ds).as_numpy_iterator())
  return np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])


# Moved from tests/tff_gma/data/loaders_test.py.
def test_shakespeare_tokenisation_matches_tffs_baseline():
  synthetic = tff.simulation.datasets.shakespeare.get_synthetic()
  for cid in synthetic.client_ids:
    ds = synthetic.create_tf_dataset_for_client(cid)
    x_ref, y_ref = _tff_baseline_sequences(ds, 12)
    x, y = shakespeare.to_sequences([e['snippets'] for e in ds.as_numpy_iterator()], 12)
    np.testing.assert_array_equal(x, x_ref)
    np.testing.assert_array_equal(y, y_ref)
  assert shakespeare.VOCAB_SIZE == len(char_prediction_preprocessing.CHAR_VOCAB) + 4
  assert (shakespeare.PAD, shakespeare.OOV, shakespeare.BOS, shakespeare.EOS) == (
      char_prediction_preprocessing.get_special_tokens())


# Moved from tests/tff_gma/data/loaders_test.py.
def test_shakespeare_to_sequences_by_hand():
  x, y = shakespeare.to_sequences([b'ab', 'dh\x01'], sequence_length=3)
  a, b = 1 + shakespeare.CHAR_VOCAB.index('a'), 1 + shakespeare.CHAR_VOCAB.index('b')
  bos, eos, oov = shakespeare.BOS, shakespeare.EOS, shakespeare.OOV
  # 'ab' -> [BOS a b EOS] (one chunk of 4); 'dh\x01' -> [BOS d h OOV EOS] padded to 8 (two chunks).
  np.testing.assert_array_equal(x, [[bos, a, b], [bos, 1, 2], [eos, 0, 0]])
  np.testing.assert_array_equal(y, [[a, b, eos], [1, 2, oov], [0, 0, 0]])
  with pytest.raises(ValueError, match='sequence_length'):
    shakespeare.to_sequences([b'a'], 0)


def test_special_ids_and_vocabulary():
  assert (shakespeare.PAD, shakespeare.OOV, shakespeare.BOS, shakespeare.EOS) == (PAD, OOV, BOS, EOS)
  assert shakespeare.VOCAB_SIZE == 90 and shakespeare.DEFAULT_SEQUENCE_LENGTH == 80
  vocab = shakespeare.CHAR_VOCAB
  assert len(vocab) == 86 and len(set(vocab)) == 86
  assert all(len(c) == 1 and ord(c) < 128 for c in vocab)
  assert {'\n', '\r', ' ', "'", '"'} <= set(vocab) and '~' not in vocab and '<' not in vocab


def test_snippet_ids_by_hand():
  # T=12, o=24, ' '=14, b=42, e=65, .=59 (positions in CHAR_VOCAB, counted from 1).
  expected = [BOS, 12, 24, 14, 42, 65, 59, EOS]
  for snippet in ('To be.', b'To be.', np.bytes_(b'To be.')):
    ids = shakespeare.snippet_ids(snippet)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, expected)
  np.testing.assert_array_equal(shakespeare.snippet_ids(''), [BOS, EOS])
  # H=9, i=66, '~' is out of vocabulary; a non-ASCII character is one OOV per UTF-8 byte (as TFF's bytes_split).
  np.testing.assert_array_equal(shakespeare.snippet_ids('Hi~'), [BOS, 9, 66, OOV, EOS])
  np.testing.assert_array_equal(shakespeare.snippet_ids('\u00e9\n\r'), [BOS, OOV, OOV, 63, 86, EOS])


def test_vocabulary_round_trip():
  everything = ''.join(shakespeare.CHAR_VOCAB)
  ids = shakespeare.snippet_ids(everything)
  np.testing.assert_array_equal(ids[1:-1], np.arange(1, 87))
  assert _decode(ids[1:-1]) == everything
  line = "HAMLET. To be, or not to be: that is the question;\nWhether 'tis nobler [aside] (3) & 'AY!'"
  ids = shakespeare.snippet_ids(line)
  assert PAD not in ids and OOV not in ids[1:-1]
  assert _decode(ids[1:-1]) == line


def test_to_sequences_chunks_pads_and_shifts_by_hand():
  x, y = shakespeare.to_sequences(['To be.', 'Hi~'], sequence_length=4)
  # 'To be.' -> 8 ids, padded to 10 (two chunks of 5); 'Hi~' -> exactly 5 ids (one chunk, no padding).
  np.testing.assert_array_equal(x, [[BOS, 12, 24, 14], [65, 59, EOS, PAD], [BOS, 9, 66, OOV]])
  np.testing.assert_array_equal(y, [[12, 24, 14, 42], [59, EOS, PAD, PAD], [9, 66, OOV, EOS]])
  assert x.dtype == y.dtype == np.int32 and x.flags.c_contiguous and y.flags.c_contiguous
  x, y = shakespeare.to_sequences([''], sequence_length=4)
  np.testing.assert_array_equal(x, [[BOS, EOS, PAD, PAD]])
  np.testing.assert_array_equal(y, [[EOS, PAD, PAD, PAD]])


@pytest.mark.parametrize('sequence_length', [1, 3, 7, np.int64(5)])
def test_to_sequences_reconstructs_the_padded_snippets(sequence_length):
  rng = np.random.default_rng(int(sequence_length))
  alphabet = np.array(list(shakespeare.CHAR_VOCAB) + ['~', '{'])
  snippets = [''.join(rng.choice(alphabet, size=n)) for n in (0, 1, 5, 13, 30)]
  x, y = shakespeare.to_sequences((s for s in snippets), sequence_length)  # Any iterable, here a generator.
  chunk = int(sequence_length) + 1
  expected_rows, expected = 0, []
  for s in snippets:
    ids = [BOS] + [shakespeare.CHAR_VOCAB.index(c) + 1 if c in shakespeare.CHAR_VOCAB else OOV for c in s] + [EOS]
    padded = ids + [PAD] * (-len(ids) % chunk)
    expected.append(np.reshape(padded, [-1, chunk]))  # Chunks never cross snippets.
    expected_rows += -(-len(ids) // chunk)
  expected = np.concatenate(expected)
  assert x.shape == y.shape == (expected_rows, sequence_length)
  np.testing.assert_array_equal(x, expected[:, :-1])
  np.testing.assert_array_equal(y, expected[:, 1:])
  # Padding is exactly where the targets are PAD: no character has id 0.
  assert np.array_equal(y == PAD, expected[:, 1:] == PAD)


def test_default_sequence_length_and_empty_input():
  x, y = shakespeare.to_sequences(['a' * 200])
  assert x.shape == y.shape == (3, 80)  # 202 ids -> 3 chunks of 81.
  x, y = shakespeare.to_sequences([], sequence_length=6)
  assert x.shape == y.shape == (0, 6) and x.dtype == y.dtype == np.int32
  assert x is not y


@pytest.mark.parametrize('sequence_length', [0, -3, 2.0, 2.5, True, '4', None])
def test_invalid_sequence_length(sequence_length):
  with pytest.raises(ValueError, match='sequence_length'):
    shakespeare.to_sequences(['abc'], sequence_length)
