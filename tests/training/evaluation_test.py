"""training.evaluation: held-out examples for personalized evaluation."""

import numpy as np
import pytest

from tff_gma.data import client_data
from training import evaluation


def test_hold_out_splits_each_client_and_keeps_every_example():
  rng = np.random.default_rng(0)
  arrays = {f'c{i}': (rng.normal(size=(n, 2)).astype(np.float32), np.arange(n, dtype=np.int32))
            for i, n in enumerate([1, 4, 10, 23])}
  train = client_data.from_client_arrays(arrays)
  kept, held = evaluation.hold_out(train, 0.2, seed=3)
  assert sorted(held) == ['c2', 'c3']  # floor(0.2 * n) = 0 for the clients of 1 and 4 examples.
  for cid, (x, y) in arrays.items():
    kx, ky = kept.client_arrays(cid)
    hx, hy = held.get(cid, (x[:0], y[:0]))
    assert len(hy) == min(int(np.floor(0.2 * len(y))), len(y) - 1)
    np.testing.assert_array_equal(np.sort(np.concatenate([ky, hy])), y)
    np.testing.assert_array_equal(kx, x[ky])
    np.testing.assert_array_equal(hx, x[hy])
  again_kept, _ = evaluation.hold_out(train, 0.2, seed=3)
  np.testing.assert_array_equal(again_kept.client_arrays('c3')[1], kept.client_arrays('c3')[1])
  with pytest.raises(ValueError, match='fraction'):
    evaluation.hold_out(train, 1.0, seed=3)
