"""The captured greedy decode step's host I/O kernels (csrc/layers/decode_io.cu, ops/cuda_decode_io.py) against
reference_decode_io.decode_inputs and ops.greedy_tokens. Tolerance: exact (integer copies and argmax).

The staging rows are read from pinned host memory by the kernel, so the graph tests rewrite that memory from
the host between replays and expect the replay to see it; the greedy tokens land in pinned memory the same way."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import InvalidRequestError
from exl2_backend.ops import reference
from exl2_backend.ops.reference_decode_io import FROM_PREVIOUS, STAGE_FIELDS, decode_inputs
from tests.helpers.tolerances import assert_exact

pytestmark = pytest.mark.cuda

DEV = "cuda"


def io():
    from exl2_backend.ops import cuda_decode_io

    return cuda_decode_io


def _random_stage(b: int, w: int, seed: int, previous_rows: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    st = torch.randint(0, 1 << 40, (b, STAGE_FIELDS + w), generator=g, dtype=torch.int64)
    st[:, 2] = torch.randint(1, 1 << 30, (b,), generator=g)  # context lengths fit int32
    st[:, STAGE_FIELDS:] = torch.randint(0, 1 << 30, (b, w), generator=g)  # page ids fit int32
    if previous_rows:
        st[::2, 0] = FROM_PREVIOUS
        if b > 2:
            st[1, 0] = -2  # only -1 means "previous": other negatives pass through as the reference does
    st[-1, 3] = -1  # a padded row's slot
    return st.pin_memory()


def _outputs(b: int, w: int, wide: int = 0):
    tables = torch.full((b, w + wide), -7, dtype=torch.int32, device=DEV)[:, :w]  # row stride past W
    def junk(shape, dtype):
        return torch.full(shape, -7, dtype=dtype, device=DEV)

    return (junk((b, 1), torch.int64), junk((b, 1), torch.int64), junk((b,), torch.int32), junk((b,), torch.int64),
            tables)


def _assert_like_reference(outs, stage: torch.Tensor, prev: torch.Tensor | None) -> None:
    want = decode_inputs(stage, prev)
    for got, ref in zip(outs, want):
        assert_exact(got.cpu(), ref)


@pytest.mark.parametrize("b, w", [(1, 0), (1, 1), (3, 5), (8, 128), (37, 130), (256, 9)])
@pytest.mark.parametrize("with_prev", [False, True])
def test_decode_inputs_matches_reference(b, w, with_prev):
    stage = _random_stage(b, w, b * 1000 + w, with_prev)
    prev = torch.randint(0, 128256, (b,), dtype=torch.int64).pin_memory() if with_prev else None
    m_stage, m_prev = io().MappedHost(stage), io().MappedHost(prev) if with_prev else None
    outs = _outputs(b, w, wide=3)
    io().decode_inputs(m_stage.view(stage), m_prev.view(prev) if with_prev else None, *outs)
    torch.cuda.synchronize()
    _assert_like_reference(outs, stage, prev)


def test_decode_inputs_in_a_graph_reads_host_memory_at_each_replay():
    """The captured kernel reads the pinned rows when it runs: rewriting them from the host between replays (as
    the runtime does) changes what each replay unpacks; parity slices of one buffer address separately."""
    b, w = 4, 6
    host = torch.zeros(2, b, STAGE_FIELDS + w, dtype=torch.int64).pin_memory()
    prev = torch.zeros(2, b, dtype=torch.int64).pin_memory()
    m_host, m_prev = io().MappedHost(host), io().MappedHost(prev)
    outs = _outputs(b, w)
    io().decode_inputs(m_host.view(host[1]), m_prev.view(prev[0]), *outs)  # eager once, outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        io().decode_inputs(m_host.view(host[1]), m_prev.view(prev[0]), *outs)
    for seed in range(3):
        host[1].copy_(_random_stage(b, w, seed, previous_rows=True))
        prev[0].copy_(torch.arange(b) + 1000 * seed)
        g.replay()
        torch.cuda.synchronize()
        _assert_like_reference(outs, host[1], prev[0])


@pytest.mark.parametrize("b, v", [(1, 40_000), (3, 2049), (8, 128_256)])
def test_greedy_tokens_to_host_equals_greedy_tokens(b, v):
    from exl2_backend.ops import cuda_layers

    wide = torch.randn(b, v + 40, device=DEV) * 4
    logits = wide[:, :v]  # the model's logits[:, :vocab_size] slice
    logits[0, 5] = logits[0, v - 1] = 100.0  # a tie across chunks: the lowest id
    if b > 2:
        logits[2, v // 2] = float("nan")
    host = torch.full((b + 2,), -7, dtype=torch.int64).pin_memory()
    mapped = io().MappedHost(host)
    io().greedy_tokens_to_host(logits, mapped.view(host[1 : b + 1]))
    torch.cuda.synchronize()
    want = reference.greedy_tokens(logits).tolist()  # argmax; -1 for the row holding a NaN
    assert host[1 : b + 1].tolist() == cuda_layers.greedy_tokens(logits).tolist() == want
    assert b <= 2 or want[2] == -1
    assert host[0].item() == -7 and host[b + 1].item() == -7  # nothing written past the view


def test_greedy_tokens_to_host_in_a_graph():
    logits = torch.randn(2, 32000, device=DEV)
    host = torch.zeros(2, dtype=torch.int64).pin_memory()
    view = io().MappedHost(host).view(host)
    io().greedy_tokens_to_host(logits, view)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        io().greedy_tokens_to_host(logits, view)
    for seed in range(3):
        logits.copy_(torch.randn(2, 32000, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed)))
        g.replay()
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        assert host.tolist() == torch.argmax(logits, -1).tolist()


def test_decode_io_rejects_bad_inputs():
    """Typed errors before any launch: unpinned or device memory as host memory, views of another buffer, wrong
    dtypes and shapes of the outputs or the logits."""
    b, w = 2, 3
    stage = torch.zeros(b, STAGE_FIELDS + w, dtype=torch.int64).pin_memory()
    m = io().MappedHost(stage)
    with pytest.raises(InvalidRequestError):
        io().MappedHost(torch.zeros(4, dtype=torch.int64))  # not pinned
    with pytest.raises(InvalidRequestError):
        io().MappedHost(torch.zeros(4, dtype=torch.int64, device=DEV))
    with pytest.raises(InvalidRequestError):
        m.view(torch.zeros(b, STAGE_FIELDS + w, dtype=torch.int64).pin_memory())  # another buffer
    ids, pos, lens, slots, tables = _outputs(b, w)
    for bad in ((ids.int(), pos, lens, slots, tables), (ids, pos, lens.long(), slots, tables),
                (ids, pos, lens, slots, tables[:, :2]), (ids[:1], pos, lens, slots, tables),
                (ids, pos.cpu(), lens, slots, tables)):
        with pytest.raises(InvalidRequestError):
            io().decode_inputs(m.view(stage), None, *bad)
    with pytest.raises(InvalidRequestError):  # stage int32
        s32 = torch.zeros(b, STAGE_FIELDS + w, dtype=torch.int32).pin_memory()
        io().decode_inputs(io().MappedHost(s32).view(s32), None, ids, pos, lens, slots, tables)
    host = torch.zeros(b, dtype=torch.int64).pin_memory()
    hv = io().MappedHost(host).view(host)
    with pytest.raises(InvalidRequestError):
        io().greedy_tokens_to_host(torch.randn(b, 100, device=DEV).half(), hv)
    with pytest.raises(InvalidRequestError):
        io().greedy_tokens_to_host(torch.randn(b + 1, 100, device=DEV), hv)  # host view of the wrong length
    with pytest.raises(InvalidRequestError):
        io().greedy_tokens_to_host(torch.randn(b, 0, device=DEV), hv)
