"""Valid EXL2 directories with random values at real model shapes, for benchmarks and loader tests.

No quantization is run: packed q_weight words are random ints with every code's lowest bit set (odd codes are
symmetric around the zero point, so the weights average 0: `center_codes`), scale codes and invperms are random,
and per-layer options come from the real option tables, mixed so the decoder averages the requested bpw.
Tensors are generated one linear at a time and streamed into shards, so a 70B-shaped directory needs only a few
GB of RAM.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from exl2_backend.format.config import ModelConfig
from exl2_backend.format.layout import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS, QuantOption
from exl2_backend.format.packing import pack_columns, pack_scales, unpack_scales
from exl2_backend.format.qtensor import pad32
from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, layer_linear_key, linear_shape
from exl2_backend.format.writer import (
    TensorSpec,
    atomic_output_dir,
    copy_tokenizer_files,
    make_quantization_config,
    plan_shards,
    shard_file_names,
    spec_nbytes,
    write_config,
    write_safetensors,
)

_LLAMA3 = {"rope_theta": 500000.0, "max_position_embeddings": 131072, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}, "bos_token_id": 128000, "eos_token_id": 128001}
SHAPES: dict[str, dict] = {
    "llama3-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True, **_LLAMA3},
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "vocab_size": 128256, **_LLAMA3},
    "llama3-70b": {"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, **_LLAMA3},
}
_DEFAULTS = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
             "hidden_act": "silu", "torch_dtype": "float16"}


def choose_options(config: ModelConfig, bpw: float) -> list[tuple[int, int]]:
    """(attention option, MLP option) per layer, average decoder bpw as close to `bpw` as fits under it.

    Per slot kind, every layer gets the dearest option whose bpw is <= target or the next one up; slots
    are upgraded in a checkerboard order (layer parity x attention/MLP) while the budget allows, so
    neighbouring layers alternate between two adjacent options and bit widths are mixed.
    """
    kinds = [(ATTENTION_OPTIONS, ATTN_PROJS), (MLP_OPTIONS, MLP_PROJS)]
    numel = [sum(_kn(config, p)[0] * _kn(config, p)[1] for p in projs) for _, projs in kinds]
    cost = [[sum(o.total_bits(*_kn(config, p)) for o, p in zip(opts, projs)) for opts in table]
            for table, projs in kinds]  # [kind][option] bits of one layer's module
    low = [max([i for i, c in enumerate(cost[k]) if c <= bpw * numel[k]], default=0) for k in (0, 1)]
    layers = config.num_hidden_layers
    budget = bpw * sum(numel) * layers
    choice = [[low[0], low[1]] for _ in range(layers)]
    total = layers * (cost[0][low[0]] + cost[1][low[1]])
    for layer, kind in sorted(((l_, k) for l_ in range(layers) for k in (0, 1)), key=lambda s: ((s[0] + s[1]) % 2, s)):
        i = choice[layer][kind]
        if i + 1 < len(cost[kind]) and total + cost[kind][i + 1] - cost[kind][i] <= budget:
            total += cost[kind][i + 1] - cost[kind][i]
            choice[layer][kind] = i + 1
    return [(a, m) for a, m in choice]


def _kn(config: ModelConfig, proj: str) -> tuple[int, int]:
    k, n = linear_shape(config, proj)
    return k, pad32(n)


def seeded_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def center_codes(q_weight: torch.Tensor, layout: list[tuple[int, int]]) -> torch.Tensor:
    """Sets the lowest bit of every code of packed q_weight [sum qrows, Np] (groups of `layout`: (bits, rows)), in
    place: odd codes are symmetric around the zero point 2^(b-1), so random weights average 0. Uniform codes
    average z - 1/2, an offset of one sign in every column that the residual stream summed layer after layer:
    ~600 per layer at the 70B's width, whose 80 layers overflowed fp16 (NaN logits, H100 call BA2 of 2026-12-06)."""
    row = 0
    for bits, rows in layout:
        lsb = pack_columns(torch.ones(32, 1, dtype=torch.int32), bits)  # [bits, 1]: one 32-row unit of code 1
        qr = rows * bits // 32
        q_weight[row : row + qr].view(rows // 32, bits, -1).bitwise_or_(lsb.to(q_weight.device).view(1, bits, 1))
        row += qr
    return q_weight


def random_linear_tensors(key: str, k: int, n: int, option: QuantOption, gen: torch.Generator,
                          bias: bool = False) -> dict[str, torch.Tensor]:
    """Random but valid `<key>.q_*` tensors for a K x N linear laid out by `option`."""
    layout = option.group_layout(k)
    np_ = pad32(n)
    qrows = [rows * bits // 32 for bits, rows in layout]
    q_weight = torch.empty(sum(qrows), np_, dtype=torch.int32)  # [sum qrows, Np]; any bit pattern is valid
    q_weight.random_(-(2**31), 2**31, generator=gen)
    center_codes(q_weight, layout)
    q_scale = torch.empty(len(layout), np_ // 8, dtype=torch.int32).random_(-(2**31), 2**31, generator=gen)
    if np_ > n:  # padding columns: zero-point values (decode to 0) and code 0, as the converter writes them
        row = 0
        for (bits, rows), qr in zip(layout, qrows):
            q_weight[row : row + qr, n:] = pack_columns(torch.full((rows, 1), 1 << (bits - 1)), bits)
            row += qr
        codes = unpack_scales(q_scale)  # [G, Np]
        codes[:, n:] = 0
        q_scale = pack_scales(codes)
    # Scale so weights have rms ~ 1/sqrt(K): activations stay O(1) through many layers (no fp16 overflow).
    z = torch.tensor([1 << (b - 1) for b, _ in layout], dtype=torch.float32)
    smax = torch.empty(len(layout)).uniform_(0.7, 1.4, generator=gen) * 3.6 / (z * math.sqrt(k))
    q_groups = [v for (bits, _), off in zip(layout, itertools.accumulate([0] + qrows)) for v in (bits, off)]
    out = {
        f"{key}.q_weight": q_weight,  # int32 [sum qrows, Np]
        f"{key}.q_scale": q_scale,  # int32 [G, Np/8]
        f"{key}.q_scale_max": smax.half(),  # fp16 [G]
        f"{key}.q_groups": torch.tensor(q_groups, dtype=torch.int16),  # int16 [2G]
        f"{key}.q_invperm": torch.randperm(k, generator=gen).to(torch.int32),  # int32 [K]
    }
    if bias:
        b = torch.empty(np_).normal_(0, 0.02, generator=gen)
        b[n:] = 0
        out[f"{key}.bias"] = b.half()
    return out


def linear_specs(key: str, k: int, n: int, option: QuantOption, bias: bool = False) -> list[TensorSpec]:
    layout = option.group_layout(k)
    np_, g = pad32(n), len(layout)
    specs = [(f"{key}.q_weight", torch.int32, (sum(r * b // 32 for b, r in layout), np_)),
             (f"{key}.q_scale", torch.int32, (g, np_ // 8)), (f"{key}.q_scale_max", torch.float16, (g,)),
             (f"{key}.q_groups", torch.int16, (2 * g,)), (f"{key}.q_invperm", torch.int32, (k,))]
    return specs + ([(f"{key}.bias", torch.float16, (np_,))] if bias else [])


def _plan(config: ModelConfig, bpw: float, head_bits: int) -> list[tuple[list[TensorSpec], Callable]]:
    """Module-order list of (specs, make(seed) -> dict of those tensors)."""
    h, v = config.hidden_size, config.vocab_size
    plan = []

    def dense(name, shape, fill):
        plan.append(([(name, torch.float16, shape)], lambda seed: {name: fill(shape, seeded_generator(seed, name))}))

    def linear(key, proj, option):
        k, n = linear_shape(config, proj)
        b = config.has_bias(proj)
        plan.append((linear_specs(key, k, n, option, b),
                     lambda seed: random_linear_tensors(key, k, n, option, seeded_generator(seed, key), b)))

    def embed(shape, g):
        # Rows drawn from a 4096-row random block: values don't matter for benchmarks, and a full normal_
        # draw of a 128256 x 8192 table costs more than writing it.
        block = torch.empty(min(4096, shape[0]), shape[1]).normal_(0, 1.0, generator=g).half()
        t = torch.empty(shape, dtype=torch.float16)
        for i in range(0, shape[0], 16384):
            rows = min(16384, shape[0] - i)
            t[i : i + rows] = block[torch.randint(0, block.shape[0], (rows,), generator=g)]
        return t

    def norm(shape, g):
        return torch.empty(shape).uniform_(0.8, 1.2, generator=g).half()

    dense("model.embed_tokens.weight", (v, h), embed)
    for layer, (ai, mi) in enumerate(choose_options(config, bpw)):
        pre = f"model.layers.{layer}"
        dense(f"{pre}.input_layernorm.weight", (h,), norm)
        for proj, opt in zip(ATTN_PROJS, ATTENTION_OPTIONS[ai]):
            linear(layer_linear_key(layer, proj), proj, opt)
        dense(f"{pre}.post_attention_layernorm.weight", (h,), norm)
        for proj, opt in zip(MLP_PROJS, MLP_OPTIONS[mi]):
            linear(layer_linear_key(layer, proj), proj, opt)
    dense("model.norm.weight", (h,), norm)
    linear("lm_head", "lm_head", HEAD_OPTIONS[head_bits])  # stored even when tied, like the converter
    return plan


def shape_config_dict(shape: str | dict) -> dict:
    """The config.json dict of a named shape (SHAPES) or of a dict of overrides on the defaults."""
    return {**_DEFAULTS, **(SHAPES[shape] if isinstance(shape, str) else shape)}


def estimate_bytes(shape: str | dict, bpw: float = 4.0, head_bits: int = 6) -> int:
    """Tensor bytes write_random_exl2_model would write (e.g. to check disk space first)."""
    plan = _plan(ModelConfig.from_dict(shape_config_dict(shape)), bpw, head_bits)
    return sum(spec_nbytes(spec) for specs, _ in plan for spec in specs)


def write_random_exl2_model(out_dir: str | Path, shape: str | dict, bpw: float = 4.0, head_bits: int = 6,
                            seed: int = 0, tokenizer_from: str | Path | None = None, *,
                            shard_mb: float = 8192, workers: int | None = None) -> Path:
    """Write a loadable EXL2 directory of the given shape (a SHAPES name or config fields) with random values.

    Modules are generated by `workers` threads (default: up to 8 CPUs; torch's generators release the GIL)
    a few modules ahead of the writer, each from its own seeded generator: the files do not depend on the
    count. One thread took ~10 s for the 1B shape here, so the 70B shape (35 GB) did not fit a device call."""
    if head_bits not in HEAD_OPTIONS:
        raise ValueError(f"head_bits must be one of {sorted(HEAD_OPTIONS)}")
    cfg_dict = shape_config_dict(shape)
    if tokenizer_from is not None and (Path(tokenizer_from) / "config.json").is_file():
        src = json.loads((Path(tokenizer_from) / "config.json").read_text())
        cfg_dict.update({k: src[k] for k in ("bos_token_id", "eos_token_id") if k in src})
    config = ModelConfig.from_dict(cfg_dict)
    plan = _plan(config, bpw, head_bits)
    owner = {name: i for i, (specs, _) in enumerate(plan) for name, _, _ in specs}
    workers = max(1, workers if workers is not None else min(8, os.cpu_count() or 1))
    made: dict[int, dict[str, torch.Tensor]] = {}  # module -> its tensors not yet written
    pending: dict[int, Future] = {}
    submitted = 0

    def produce(name: str) -> torch.Tensor:
        # Tensors are asked for in module order: keep up to `workers` modules ahead in flight, hand each module
        # out piece by piece.
        nonlocal submitted
        i = owner[name]
        while submitted < len(plan) and submitted <= i + workers:
            pending[submitted] = pool.submit(plan[submitted][1], seed)
            submitted += 1
        if i not in made:
            made[i] = pending.pop(i).result()
        t = made[i].pop(name)
        if not made[i]:
            del made[i]
        return t

    specs = [s for module_specs, _ in plan for s in module_specs]
    shards = plan_shards(specs, shard_mb)
    with ThreadPoolExecutor(workers) as pool, atomic_output_dir(out_dir) as tmp:
        if tokenizer_from is not None:
            copy_tokenizer_files(tokenizer_from, tmp)
        else:
            bos, eos = write_byte_tokenizer(tmp, config.vocab_size)
            cfg_dict.update(bos_token_id=bos, eos_token_id=eos)
        for fname, shard in zip(shard_file_names(len(shards)), shards):
            write_safetensors(tmp / fname, shard, produce)
        write_config(tmp, cfg_dict, make_quantization_config(bpw, head_bits, {"rows": 0, "length": 0,
                                                                              "dataset": "(random)"}))
    return Path(out_dir)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to code points from 256 up."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "o n", "Ġ a", "r e", "a t", "e n", "i s", "Ġ s", "Ġ w",
           "o r", "e s", "Ġ o", "in g", "Ġ c", "Ġ b", "Ġ f", "Ġ p", "e d", "a l", "Ġ m", "a r", "i t", "Ġa n",
           "Ġan d", "o u", "Ġo f", "Ġ i", "Ġ in", "Ġt o"]


def write_byte_tokenizer(out_dir: str | Path, vocab_size: int) -> tuple[int, int]:
    """Minimal byte-level BPE tokenizer.json (+ tokenizer_config.json); returns (bos_id, eos_id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if vocab_size < 258:
        raise ValueError(f"vocab_size {vocab_size} is too small for 256 byte tokens and 2 special tokens")
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    merges = []
    for m in _MERGES[: vocab_size - 258]:
        a, b = m.split()
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    bos_s, eos_s = "<|begin_of_text|>", "<|end_of_text|>"
    tok.add_special_tokens([AddedToken(bos_s, special=True), AddedToken(eos_s, special=True)])
    bos, eos = tok.token_to_id(bos_s), tok.token_to_id(eos_s)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos_s} $A", pair=f"{bos_s} $A {bos_s} $B",
                                                       special_tokens=[(bos_s, bos)])
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    template = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": bos_s, "eos_token": eos_s, "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template}, indent=2))
    return bos, eos
