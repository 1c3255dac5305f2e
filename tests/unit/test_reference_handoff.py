"""The norm handoff's reference (ops/reference_handoff.py): producer and consumer chained are add_rms_norm up to the
order of the sum of squares (the stream bit for bit; the normalized rows within one fp16 ulp), for hidden sizes with
a partial last column block; bad shapes raise."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops import reference
from exl2_backend.ops.reference_handoff import handoff_in, handoff_out


@pytest.mark.parametrize("m,h", [(1, 576), (5, 4096), (3, 1056), (32, 256), (2, 8192)])
def test_handoff_chained_is_add_rms_norm(m, h):
    g = torch.Generator().manual_seed(m * h)
    y = torch.randn(m, h, generator=g).half()
    residual = (torch.randn(m, h, generator=g) * 4).half()
    w = (torch.rand(h, generator=g) + 0.5).half()
    r, sq = handoff_out(y, residual)
    want_x, want_r = reference.add_rms_norm(y, residual, w, 1e-5)
    assert torch.equal(r, want_r)
    assert sq.shape == (m, -(-h // 256)) and sq.dtype == torch.float32
    torch.testing.assert_close(sq.sum(-1), r.float().pow(2).sum(-1), rtol=1e-5, atol=0)
    x = handoff_in(r, sq, w, 1e-5)
    ulp = (want_x.float().abs() * 2.0**-10).clamp_min(2.0**-24)
    assert ((x.float() - want_x.float()).abs() <= ulp).all()


def test_handoff_rejects_bad_shapes():
    a = torch.zeros(2, 512, dtype=torch.float16)
    with pytest.raises(TensorShapeError, match="residual"):
        handoff_out(a, a[:, :256])
    with pytest.raises(TensorShapeError, match="sq"):
        handoff_in(a, torch.zeros(2, 3), torch.ones(512, dtype=torch.float16), 1e-5)
