"""The captured greedy decode step's input unpacking on the CPU: reference_decode_io.decode_inputs (the kernel's
reference) and cuda_graphs.fill_stage_rows (the staging rows both graph paths upload or read)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exl2_backend.errors import InvalidRequestError
from exl2_backend.ops.reference_decode_io import FROM_PREVIOUS, STAGE_FIELDS, decode_inputs
from exl2_backend.runtime.cuda_graphs import fill_stage_rows


def _stage(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def test_decode_inputs_unpacks_rows():
    stage = _stage([[11, 5, 6, 261, 1, 2], [12, 0, 1, 512, 2, 0]])
    got = decode_inputs(stage)
    assert got.ids.tolist() == [[11], [12]] and got.ids.dtype == torch.int64
    assert got.pos.tolist() == [[5], [0]] and got.pos.dtype == torch.int64
    assert got.lens.tolist() == [6, 1] and got.lens.dtype == torch.int32
    assert got.slots.tolist() == [261, 512] and got.slots.dtype == torch.int64
    assert got.tables.tolist() == [[1, 2], [2, 0]] and got.tables.dtype == torch.int32


def test_decode_inputs_takes_previous_tokens_where_staged():
    stage = _stage([[FROM_PREVIOUS, 7, 8, 7], [40, 3, 4, 3], [FROM_PREVIOUS, 0, 1, -1]])
    got = decode_inputs(stage, torch.tensor([101, 102, 103]))
    assert got.ids.flatten().tolist() == [101, 40, 103]
    assert got.tables.shape == (3, 0)
    assert decode_inputs(stage).ids.flatten().tolist() == [FROM_PREVIOUS, 40, FROM_PREVIOUS]  # no previous tokens


def test_decode_inputs_outputs_do_not_alias_the_stage():
    stage = _stage([[1, 2, 3, 4, 5]])
    got = decode_inputs(stage)
    stage.fill_(0)
    assert got.ids.item() == 1 and got.pos.item() == 2 and got.slots.item() == 4 and got.tables.tolist() == [[5]]


@pytest.mark.parametrize("stage, prev", [
    (torch.zeros(2, 3, dtype=torch.int64), None),  # fewer than the four fields
    (torch.zeros(2, 5, dtype=torch.int32), None),
    (torch.zeros(5, dtype=torch.int64), None),
    (torch.zeros(2, 5, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)),
    (torch.zeros(2, 5, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)),
])
def test_decode_inputs_rejects_bad_shapes(stage, prev):
    with pytest.raises(InvalidRequestError):
        decode_inputs(stage, prev)


def test_fill_stage_rows_pads_the_bucket():
    page_size, w = 16, 4
    st = np.full((4, STAGE_FIELDS + w), 99, dtype=np.int64)  # stale values of an earlier, larger step
    fill_stage_rows(st, [7, FROM_PREVIOUS], [20, 3], [[5, 9], [2]], 3, page_size)
    assert st[0].tolist() == [7, 20, 21, 9 * 16 + 4, 5, 9, 0, 0]
    assert st[1].tolist() == [FROM_PREVIOUS, 3, 4, 2 * 16 + 3, 2, 0, 0, 0]
    assert st[2].tolist() == [0, 0, 1, -1, 0, 0, 0, 0]  # padded row: one position of page 0, no KV write
    assert st[3].tolist() == [99] * 8  # past the bucket: untouched
    got = decode_inputs(torch.from_numpy(st[:3]), torch.tensor([5, 6, 7]))
    assert got.ids.flatten().tolist() == [7, 6, 0] and got.slots.tolist() == [148, 35, -1]


def test_zero_temperatures_outlive_a_larger_request(monkeypatch):
    """A greedy graph captured with the shared zero temperatures holds their address: a later, larger request
    replaces them without freeing them (freed, the memory could be reused and the graph's rows would sample with
    nonzero temperatures). The reuse path is exercised on CPU tensors; the kernels never see them here."""
    from exl2_backend.ops import cuda_layers

    monkeypatch.setattr(cuda_layers, "_zero_temperatures", {})
    monkeypatch.setattr(cuda_layers, "_retired_zeros", [])
    dev = torch.device("cpu")
    first = cuda_layers.zero_temperatures(dev, 8)
    assert first.shape == (8,) and first.untyped_storage().nbytes() == 64 * 4  # at least 64 rows
    assert cuda_layers.zero_temperatures(dev, 64).data_ptr() == first.data_ptr()  # reused while large enough
    larger = cuda_layers.zero_temperatures(dev, 100)
    assert larger.shape == (100,) and larger.data_ptr() != first.data_ptr()
    assert any(z.data_ptr() == first.data_ptr() for z in cuda_layers._retired_zeros)  # still alive
    assert torch.count_nonzero(larger) == 0
