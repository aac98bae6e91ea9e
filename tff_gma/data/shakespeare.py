"""Shakespeare next-character prediction (LEAF; McMahan et al., 2017; Reddi et al., 2021), as arrays.

The tokenisation of TFF's baseline (`tff.simulation.baselines.shakespeare`): 86 characters, padding, OOV, begin
and end of snippet, 90 ids. Snippets are cut into chunks of `sequence_length + 1` (x = c[:-1], y = c[1:]) padded
with PAD, which losses and metrics skip (`tff_gma.models.model_fn(..., pad_id=PAD)`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tff_gma import checks

# The vocabulary of TFF's text-generation tutorial and Shakespeare baseline.
CHAR_VOCAB = tuple(
    'dhlptx@DHLPTX'
    ' $(,048cgkoswCGKOSW[_#\'/37;?bfjnrvzBFJNRVZ"&*.26:\naeimquyAEIMQUY]!%)-159\r')
PAD = 0
OOV = len(CHAR_VOCAB) + 1
BOS = len(CHAR_VOCAB) + 2
EOS = len(CHAR_VOCAB) + 3
VOCAB_SIZE = len(CHAR_VOCAB) + 4
DEFAULT_SEQUENCE_LENGTH = 80  # McMahan et al. (2017); Reddi et al. (2021).

# Byte value -> token id; bytes outside the vocabulary map to OOV.
_BYTE_TO_ID = np.full(256, OOV, np.int32)
for _i, _c in enumerate(CHAR_VOCAB):
  _BYTE_TO_ID[ord(_c)] = _i + 1


def snippet_ids(snippet: bytes | str) -> np.ndarray:
  """[BOS, ids of the snippet's bytes..., EOS] as int32."""
  if isinstance(snippet, str):
    snippet = snippet.encode('utf-8')
  return np.concatenate([[BOS], _BYTE_TO_ID[np.frombuffer(snippet, np.uint8)], [EOS]]).astype(np.int32)


def to_sequences(
    snippets: Iterable[bytes | str], sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
) -> tuple[np.ndarray, np.ndarray]:
  """Input and target id sequences, int32 [M, sequence_length] each, of a list of snippets."""
  sequence_length = checks.check_positive_int(sequence_length, 'sequence_length')
  chunk = sequence_length + 1
  chunks = []
  for snippet in snippets:
    ids = snippet_ids(snippet)
    padded = np.concatenate([ids, np.full((-len(ids)) % chunk, PAD, np.int32)])
    chunks.append(padded.reshape(-1, chunk))
  if not chunks:
    empty = np.zeros([0, sequence_length], np.int32)
    return empty, empty.copy()
  chunks = np.concatenate(chunks)
  return chunks[:, :-1].copy(), chunks[:, 1:].copy()
