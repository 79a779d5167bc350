"""`to_device`: host values (lists, numpy arrays) as a tensor on a device, the dtype asked for.
Arrays take from_numpy (torch.tensor converts them element by element); a strided or
differently typed array comes out as the same values, contiguous, in the dtype asked for."""

from __future__ import annotations

import numpy as np
import torch

from mili.engine.step.pinned import to_device

CPU = torch.device("cpu")


def test_lists_and_arrays_give_the_same_tensor() -> None:
    values = [3, 1, 4, 1, 5, 9, 2, 6]
    from_list = to_device(values, torch.int64, CPU)
    from_array = to_device(np.array(values, dtype=np.int64), torch.int64, CPU)
    assert from_array.dtype == torch.int64 and torch.equal(from_array, from_list)


def test_an_array_is_converted_and_made_contiguous() -> None:
    strided = np.arange(20, dtype=np.float64)[::3]  # not contiguous, float64
    out = to_device(strided, torch.float32, CPU)
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert out.tolist() == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0]
    rows = np.stack([np.array([0, 1]), np.array([7, 8])])  # [2, n]: the sampler's index
    assert to_device(rows, torch.int64, CPU).tolist() == [[0, 1], [7, 8]]
