"""Random EXL2 weights generated directly on a device, for benchmarks at real shapes without writing files.

Writing a 70B-shape directory (format/random_model.py) means generating ~35 GB of random words on the CPU,
writing them and reading them back; here each tensor is drawn on the GPU with a generator seeded from the
tensor's name, one layer at a time (a generator of LayerWeights: the model prepares and drops each layer
before the next is drawn). The layout -- per-layer option choice, group layout, shapes -- is that of
`write_random_exl2_model` (and of `plan.describe_random`), so the memory plan of such a model is exact; the
values are not the same draws as the written directory's.

`RandomSource` is picklable: tensor-parallel ranks (runtime/tp_group.py) draw the same full tensors on their
own GPUs from the same seeds and keep their shards. Same seed, same GPU model -> same values (philox).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from exl2_backend.format.config import ModelConfig
from exl2_backend.format.layout import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS, QuantOption
from exl2_backend.format.packing import pack_columns, pack_scales, unpack_scales
from exl2_backend.format.qtensor import QTensor, pad32
from exl2_backend.format.random_model import center_codes
from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, LayerWeights, ModelWeights, layer_linear_key, linear_shape


def _gen(device: torch.device, seed: int, name: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def random_qtensor_on(key: str, k: int, n: int, option: QuantOption, device: torch.device, seed: int,
                      bias: bool = False) -> QTensor:
    """A valid QTensor of random words on `device` (weights rms ~ 1/sqrt(K), like random_model's)."""
    g = _gen(device, seed, key)
    layout = option.group_layout(k)
    np_ = pad32(n)
    qrows = [rows * bits // 32 for bits, rows in layout]
    q_weight = torch.empty(sum(qrows), np_, dtype=torch.int32, device=device).random_(-(2**31), 2**31, generator=g)
    center_codes(q_weight, layout)  # weights of mean 0 (random_model.center_codes)
    q_scale = torch.empty(len(layout), np_ // 8, dtype=torch.int32, device=device).random_(-(2**31), 2**31,
                                                                                          generator=g)
    if np_ > n:  # padding columns: zero point and scale code 0, as the converter writes them
        row = 0
        for (bits, rows), qr in zip(layout, qrows):
            q_weight[row : row + qr, n:] = pack_columns(torch.full((rows, 1), 1 << (bits - 1)), bits).to(device)
            row += qr
        codes = unpack_scales(q_scale.cpu())
        codes[:, n:] = 0
        q_scale = pack_scales(codes).to(device)
    z = torch.tensor([1 << (b - 1) for b, _ in layout], dtype=torch.float32, device=device)
    smax = torch.empty(len(layout), device=device).uniform_(0.7, 1.4, generator=g) * 3.6 / (z * math.sqrt(k))
    offsets = [0]
    for qr in qrows[:-1]:
        offsets.append(offsets[-1] + qr)
    q_groups = torch.tensor([v for (bits, _), off in zip(layout, offsets) for v in (bits, off)], dtype=torch.int16)
    b = None
    if bias:
        b = torch.empty(np_, device=device).normal_(0, 0.02, generator=g)
        b[n:] = 0
        b = b.half()
    return QTensor(key=key, q_weight=q_weight, q_scale=q_scale, q_scale_max=smax.half(), q_groups=q_groups.to(device),
                   q_invperm=torch.randperm(k, generator=g, device=device).to(torch.int32), out_features=n, bias=b,
                   source=f"random:{key}")


@dataclass(frozen=True)
class RandomSource:
    """A random EXL2 model of `shape` (a format.random_model.SHAPES name) at `bpw`, drawn on the device."""

    shape: str
    bpw: float = 4.0
    head_bits: int = 6
    seed: int = 0

    def config(self) -> ModelConfig:
        from exl2_backend.format.random_model import shape_config_dict

        return ModelConfig.from_dict(shape_config_dict(self.shape))

    def weights(self, config: ModelConfig, device: torch.device) -> ModelWeights:
        """ModelWeights whose `layers` is a generator (one layer's tensors alive at a time)."""
        from exl2_backend.format.random_model import choose_options

        device = torch.device(device)
        h, v = config.hidden_size, config.vocab_size

        def norm(name: str) -> torch.Tensor:
            return torch.empty(h, device=device).uniform_(0.8, 1.2, generator=_gen(device, self.seed, name)).half()

        def layers():
            for i, (ai, mi) in enumerate(choose_options(config, self.bpw)):
                lin = {}
                for projs, opts in ((ATTN_PROJS, ATTENTION_OPTIONS[ai]), (MLP_PROJS, MLP_OPTIONS[mi])):
                    for proj, opt in zip(projs, opts):
                        k, n = linear_shape(config, proj)
                        key = layer_linear_key(i, proj)
                        lin[proj] = random_qtensor_on(key, k, n, opt, device, self.seed, config.has_bias(proj))
                pre = f"model.layers.{i}"
                yield LayerWeights(input_layernorm=norm(f"{pre}.input_layernorm.weight"),
                                   post_attention_layernorm=norm(f"{pre}.post_attention_layernorm.weight"), **lin)

        embed = torch.empty(v, h, device=device).normal_(0, 1.0, generator=_gen(device, self.seed, "embed")).half()
        k, n = linear_shape(config, "lm_head")
        head = random_qtensor_on("lm_head", k, n, HEAD_OPTIONS[self.head_bits], device, self.seed)
        return ModelWeights(embed_tokens=embed, norm=norm("model.norm.weight"), layers=layers(), lm_head=head)
