"""The argument check of RoPE inside the q/k/v GEMV (cuda_quant._rope_args; the kernel is tested on the GPU in
tests/kernels/test_gemv_rope_kv.py): which tensors it takes, the typed error for each it refuses, and the int64
arguments it hands the library. Host code over CPU tensors, so it runs where the library loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exl2_backend.errors import TensorShapeError
from exl2_backend.ops import library

pytestmark = pytest.mark.skipif(not library.available(), reason="compiled library not loaded")

CPU = torch.device("cpu")


def _launch(widths: tuple[int, ...], k: int = 256):
    from exl2_backend.ops import cuda_quant
    from tests.helpers.synth import random_qtensor

    return cuda_quant._Launch([cuda_quant.pack_qtensor(random_qtensor(f"p{i}", k, n, "4:1@128", seed=i), CPU)
                               for i, n in enumerate(widths)], CPU)


def _inputs(m=3, hk=2, d=64, pages=4, page=16):
    kc = torch.zeros(pages, page, hk, d, dtype=torch.float16)
    return (torch.arange(m), torch.ones(d // 2), kc, torch.zeros_like(kc), torch.arange(m))


def test_takes_whole_heads_and_returns_the_pointers():
    from exl2_backend.ops.cuda_quant import _rope_args

    launch = _launch((256, 128, 128))
    pos, inv, kc, vc, slots = _inputs()
    got = _rope_args(launch, 3, pos, inv, kc, vc, slots)
    want = [pos.data_ptr(), inv.data_ptr(), slots.data_ptr(), kc.data_ptr(), vc.data_ptr(), 4 * 16, 64]
    assert got.dtype == np.int64 and got.tolist() == want


@pytest.mark.parametrize("case,match", [
    ("two_parts", "q, k and v"), ("cache_dtype", "k_cache"), ("v_shape", "v_cache"), ("heads", "kv heads"),
    ("head_dim", "head_dim must divide"), ("positions", "positions"), ("slots_dtype", "slots"),
    ("inv_freq", "inv_freq"), ("strided", "k_cache"),
])
def test_refuses_with_a_typed_error(case, match):
    from exl2_backend.ops.cuda_quant import _rope_args

    launch = _launch((256, 128) if case == "two_parts" else (288, 96, 96) if case == "head_dim" else (256, 128, 128))
    pos, inv, kc, vc, slots = _inputs(d=48 if case == "head_dim" else 64, hk=2)
    if case == "cache_dtype":
        kc = kc.float()
    elif case == "v_shape":
        vc = vc[:2].contiguous()
    elif case == "heads":
        kc, vc = kc[:, :, :1].contiguous(), vc[:, :, :1].contiguous()
    elif case == "positions":
        pos = pos[:2]
    elif case == "slots_dtype":
        slots = slots.int()
    elif case == "inv_freq":
        inv = inv.double()
    elif case == "strided":
        kc = torch.zeros(4, 16, 2, 128, dtype=torch.float16)[..., :64]
    with pytest.raises(TensorShapeError, match=match):
        _rope_args(launch, 3, pos, inv, kc, vc, slots)
