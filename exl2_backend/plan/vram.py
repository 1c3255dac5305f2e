"""The memory plan of a load, per device, computed before anything is allocated.

For every device the plan counts: the weights placed there (decoder layers, embedding on the first device,
final norm + head on the last; sizes from `plan/sizes.py`), the KV cache of its layers for the requested
context and cache type, the draft model and its cache (first device), scratch (kernel workspace, the
CUDA-graph pool of the largest decode bucket, the peak of one prefill forward) and a fixed reserve (cuBLAS
workspaces, allocator slack; NCCL buffers under tensor parallelism). `VramPlan.check()` raises
`VramPlanError` naming the first device that does not fit and its shortfall in GB.

Layer placement (`mode`):
- "single": everything on one device.
- "split" with `gpu_split` (GB per device, 1 GB = 1e9 bytes; the budget covers everything the plan puts on
  that device) or `autosplit` (every visible GPU, budget = its free memory): layers fill the devices in
  order, each layer costing its weights plus its share of the KV cache; the embedding (and a draft model)
  go first, the head after the last layer.
- "tensor_parallel": N ranks, each with its shard of every layer (model/tp_shard.py splits the same way).

Scratch terms are estimates (documented per term below); scripts/device/multigpu.py measures them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from exl2_backend.errors import ConfigError, VramPlanError
from exl2_backend.format.qtensor_slice import balanced_ranges
from exl2_backend.plan.sizes import LinearDesc, ModelDesc, describe_dir

GB = 1e9
CUDA_RESERVE = 512 << 20  # cuBLAS workspaces, allocator rounding and fragmentation, per CUDA device
NCCL_RESERVE = 1 << 30  # NCCL communicator buffers of a tensor-parallel rank
KERNEL_WORKSPACE = 64 << 20  # split-K partials and tickets of the EXL2 kernels (ops/cuda_quant.workspace)


@dataclass
class DevicePlan:
    """Bytes planned on one device. `capacity` None means unchecked (CPU without a budget)."""

    device: str
    capacity: int | None = None
    capacity_source: str = "unchecked"  # "gpu_split" | "free memory" | "unchecked"
    free_memory: int | None = None  # what the device reported free (CUDA), checked against a gpu_split budget
    layers: tuple[int, int] = (0, 0)  # [first, end) decoder layers (all layers' shards under TP)
    embed: bool = False
    head: bool = False
    weights: int = 0
    kv_cache: int = 0
    draft: int = 0
    scratch: int = 0
    load_transient: int = 0  # repacking one linear at load (before the cache exists)
    reserve: int = 0

    @property
    def resident(self) -> int:
        """Weights, caches and the draft: what stays allocated while idle."""
        return self.weights + self.kv_cache + self.draft

    @property
    def peak(self) -> int:
        run = self.resident + self.scratch
        load = self.weights + self.draft + self.load_transient
        return max(run, load) + self.reserve

    @property
    def shortfall(self) -> int:
        limits = [c for c in (self.capacity, self.free_memory) if c is not None]
        return max(0, self.peak - min(limits)) if limits else 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(resident=self.resident, peak=self.peak, shortfall=self.shortfall)
        return d


@dataclass
class VramPlan:
    mode: str  # "single" | "split" | "tensor_parallel"
    model: str
    backend: str  # "packed" (CUDA library) | "dense" (reference ops)
    devices: list[DevicePlan]
    max_seq_len: int
    cache_tokens: int  # rounded up to whole pages
    page_size: int
    cache_type: str
    tensor_parallel: int = 1
    notes: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Raise VramPlanError for the first device whose planned peak exceeds its budget or free memory."""
        for d in self.devices:
            if not d.shortfall:
                continue
            limit, what = (d.capacity, d.capacity_source)
            if d.free_memory is not None and (limit is None or d.free_memory < limit):
                limit, what = d.free_memory, "free memory"
            raise VramPlanError(
                f"{d.device} needs {d.peak / GB:.2f} GB but has {limit / GB:.2f} GB ({what}): {d.shortfall / GB:.2f}"
                f" GB short ({_parts(d)}); {_advice(self)}",
                device=d.device, shortfall_bytes=d.shortfall, field="gpu_split" if self.mode == "split" else None)

    def segments(self) -> list[tuple[str, int, int]]:
        """(device, first layer, end layer) of each device holding layers, in order (layer split)."""
        return [(d.device, *d.layers) for d in self.devices if d.layers[1] > d.layers[0]]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["devices"] = [x.to_dict() for x in self.devices]
        return d


def _parts(d: DevicePlan) -> str:
    items = [("weights", d.weights), ("KV cache", d.kv_cache), ("draft", d.draft), ("scratch", d.scratch),
             ("reserve", d.reserve)]
    return ", ".join(f"{k} {v / GB:.2f}" for k, v in items if v)


def _advice(plan: VramPlan) -> str:
    if plan.mode == "split":
        return "raise that device's gpu_split budget, add a device, or lower max_seq_len / cache_tokens"
    if plan.mode == "tensor_parallel":
        return "use more ranks, lower max_seq_len / cache_tokens, or a lower-bpw model"
    return "lower max_seq_len / cache_tokens, use gpu_split / autosplit over more GPUs, or a lower-bpw model"


# --- devices -------------------------------------------------------------------------------------------------


def plan_devices(settings, visible: int | None = None) -> tuple[str, list[str]]:
    """(mode, device names) from LoadSettings (device, gpu_split, autosplit, tensor_parallel). On the CPU every
    gpu_split entry / rank is a segment on "cpu" (tests, and checking a plan without a GPU). `visible`: number
    of CUDA devices autosplit may use (default: torch.cuda.device_count())."""
    dev = settings.torch_device
    split = getattr(settings, "gpu_split", None)
    tp = int(getattr(settings, "tensor_parallel", 1) or 1)
    base = dev.index or 0

    def names(n: int) -> list[str]:
        if dev.type == "cpu":
            return ["cpu"] * n
        return [f"cuda:{base + i}" for i in range(n)]

    if tp > 1:
        return "tensor_parallel", names(tp)
    if split:
        return "split", names(len(split))
    if getattr(settings, "autosplit", False):
        n = (torch.cuda.device_count() if visible is None else visible) - base if dev.type == "cuda" else 1
        return ("split" if n > 1 else "single"), names(max(n, 1))
    return "single", [str(dev) if dev.type == "cpu" else f"cuda:{base}"]


def query_free_memory(devices: list[str]) -> dict[str, int]:
    """Free bytes of each CUDA device (creates its context); CPU devices are left out (unchecked)."""
    out = {}
    for name in dict.fromkeys(devices):
        if name.startswith("cuda") and torch.cuda.is_available():
            out[name] = int(torch.cuda.mem_get_info(torch.device(name))[0])
    return out


# --- sizes of one device's parts -----------------------------------------------------------------------------


def _kv_bytes_layer_token(config, num_kv_heads: int, dtype: torch.dtype, cache_type: str) -> int:
    """K+V bytes of one token in one layer, for the cache type (codes and scales) -- cache/paged.py's count."""
    from exl2_backend.cache import kv_bytes_per_token

    try:
        return kv_bytes_per_token(1, num_kv_heads, config.head_dim, dtype, cache_type)
    except TypeError:  # a cache module without storage types: fp16 elements of `dtype`
        return kv_bytes_per_token(1, num_kv_heads, config.head_dim, dtype)


@dataclass(frozen=True)
class _Dims:
    """Per-rank attention/MLP widths (the full model's unless tensor parallel)."""

    hq: int
    hkv: int
    inter: int
    vocab: int


def _activation_bytes(desc: ModelDesc, dims: _Dims, tokens: int, itemsize: int) -> int:
    """Live activations of one decoder layer for `tokens` rows: hidden-size temporaries (h, residual, normed,
    o_proj and down outputs, ~6 x H), the fused q/k/v output, attention output (x2: result and its copy), the
    fused gate/up output and the silu product."""
    c = desc.config
    per = 6 * c.hidden_size + (dims.hq + 2 * dims.hkv) * c.head_dim + 2 * dims.hq * c.head_dim + 3 * dims.inter
    return tokens * per * itemsize


class _OpShape:
    """What runtime/scratch.py reads of a prepared linear op, from LinearDescs sharing an input."""

    def __init__(self, descs: list[LinearDesc]):
        self.splits = [d.out_features for d in descs]
        self.out_features = sum(self.splits)
        self.in_features = descs[0].in_features


class _LayerShape:
    def __init__(self, parts: dict[str, LinearDesc]):
        self.qkv = _OpShape([parts["q_proj"], parts["k_proj"], parts["v_proj"]])
        self.o = _OpShape([parts["o_proj"]])
        self.gate_up = _OpShape([parts["gate_proj"], parts["up_proj"]])
        self.down = _OpShape([parts["down_proj"]])


class _Heads:
    """A config with a rank's head counts."""

    def __init__(self, config, dims: _Dims):
        self._config = config
        self.num_attention_heads, self.num_key_value_heads = dims.hq, dims.hkv

    def __getattr__(self, name):
        return getattr(self._config, name)


class _ModelShape:
    """The attributes runtime/scratch.prefill_scratch_bytes reads of a loaded model, before loading."""

    def __init__(self, desc: ModelDesc, dims: _Dims, layers: list[dict[str, LinearDesc]], head, itemsize: int,
                 device: str):
        self.config = _Heads(desc.config, dims)
        self.dtype = torch.float16 if itemsize == 2 else torch.float32
        self.vocab_size = dims.vocab
        cuda_here = device.startswith("cuda") and torch.cuda.is_available()
        self.device = torch.device(device if cuda_here else "cpu")  # the SM count is read from a real GPU only
        self.layers = [_LayerShape(p) for p in layers]
        self.lm_head = None if head is None else _OpShape([head])


def _scratch(desc: ModelDesc, dims: _Dims, settings, backend: str, itemsize: int, *, last: bool,
             layers: list[dict[str, LinearDesc]], head: LinearDesc | None, device: str) -> int:
    """Kernel workspace + decode graph pool (largest bucket) + one prefill forward's peak (the bound of
    runtime/scratch.prefill_scratch_bytes, which the GPU tests check against measured peaks)."""
    from exl2_backend.runtime.scratch import prefill_scratch_bytes

    batch = settings.max_batch_size
    t = getattr(settings, "max_input_len", None) or settings.max_chunk_size
    chunk = min(settings.max_chunk_size, t)
    shape = _ModelShape(desc, dims, layers, head if last else None, itemsize, device)
    prefill = prefill_scratch_bytes(shape, t, chunk, batch, settings.max_seq_len, settings.page_size)
    if backend != "packed":  # eager reference path: no graphs, no kernel workspace
        return prefill
    decode = _activation_bytes(desc, dims, batch, itemsize)
    if last:
        buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < batch] + [batch]
        decode += batch * dims.vocab * (4 + itemsize) + sum(buckets) * dims.vocab * 4  # logits, kept outputs
    return KERNEL_WORKSPACE + decode + prefill


def _transient(linears: list[LinearDesc], backend: str) -> int:
    """Repacking the largest linear (ops/cuda_quant.pack_qtensor): its on-disk tensors copied to the device,
    the unpacked uint8 values [K, Np] and the int64 word buffers (about 8x the packed int32 words)."""
    if backend != "packed":
        return 0
    best = 0
    for d in linears:
        if d.quantized:
            words = sum(rows * bits // 32 for bits, rows in d.groups) * d.padded_out_features
            best = max(best, d.disk_bytes() + d.in_features * d.padded_out_features + 8 * 4 * words)
    return best


# --- the plan ------------------------------------------------------------------------------------------------


def plan_load(settings, *, desc: ModelDesc | None = None, draft: ModelDesc | None = None,
              free_memory: dict[str, int] | None = None, backend: str | None = None) -> VramPlan:
    """The memory plan of loading `settings` (LoadSettings); nothing is allocated. `desc` defaults to the
    headers of settings.model_dir, `draft` to those of settings.draft_model (if any), `free_memory` to what
    the CUDA devices report now, `backend` to "packed" on CUDA and "dense" on the CPU. Call `.check()`."""
    if desc is None:
        if settings.model_dir is None:
            raise ConfigError("model_dir is required to plan a load", field="model_dir")
        desc = describe_dir(settings.model_dir)
    draft_dir = getattr(settings, "draft_model", None)
    if draft is None and draft_dir is not None:
        draft = describe_dir(draft_dir)
    mode, devices = plan_devices(settings, None if free_memory is None else len(free_memory))
    cuda = devices[0].startswith("cuda")
    backend = backend or ("packed" if cuda else "dense")
    itemsize = 2 if cuda else 4  # activations / reference weights: fp16 on GPUs, fp32 on the CPU
    dtype = torch.float16 if cuda else torch.float32
    if free_memory is None:
        free_memory = query_free_memory(devices)
    config = desc.config
    if mode == "tensor_parallel":
        _check_tp(config, len(devices))
    plan = VramPlan(mode=mode, model=desc.source, backend=backend, devices=[], max_seq_len=0, cache_tokens=0,
                    page_size=settings.page_size, cache_type=settings.cache_type,
                    tensor_parallel=len(devices) if mode == "tensor_parallel" else 1)
    budgets = list(getattr(settings, "gpu_split", None) or [])
    for i, name in enumerate(devices):
        dp = DevicePlan(device=name, free_memory=free_memory.get(name) if cuda else None,
                        reserve=(CUDA_RESERVE + (NCCL_RESERVE if mode == "tensor_parallel" else 0)) if cuda else 0)
        if budgets:
            dp.capacity, dp.capacity_source = int(budgets[i] * GB), "gpu_split"
        elif dp.free_memory is not None:
            dp.capacity, dp.capacity_source = dp.free_memory, "free memory"
        plan.devices.append(dp)

    builder = _TPBuilder(desc, len(devices)) if mode == "tensor_parallel" else None
    # 1) weights and scratch at the smallest cache, to size a default cache from what is left
    probe = settings.model_copy(update={"max_seq_len": settings.max_seq_len or _default_ctx(settings, config)})
    _place(plan, desc, draft, probe, 0, backend, itemsize, dtype, builder)
    kv_token = _kv_token_bytes(desc, draft, settings.cache_type, dtype, builder)
    room = [max(0, (d.capacity or 0) - d.peak) for d in plan.devices]
    free = (min(room) * len(room) if builder else sum(room)) if cuda else None
    resolved = settings.resolve(config, kv_token, free)
    tokens = math.ceil(resolved.cache_tokens / settings.page_size) * settings.page_size
    plan.max_seq_len, plan.cache_tokens = resolved.max_seq_len, tokens
    # 2) the real placement with that cache
    for d in plan.devices:
        d.layers, d.embed, d.head = (0, 0), False, False
        d.weights = d.kv_cache = d.draft = d.scratch = d.load_transient = 0
    _place(plan, desc, draft, resolved, tokens, backend, itemsize, dtype, builder)
    return plan


def _default_ctx(settings, config) -> int:
    from exl2_backend.runtime.settings import DEFAULT_MAX_SEQ_LEN

    return min(int(config.max_position_embeddings), DEFAULT_MAX_SEQ_LEN)


def _kv_token_bytes(desc, draft, cache_type, dtype, builder) -> int:
    """KV bytes per token of the whole model (one rank's under TP) plus the draft's -- what `resolve` divides
    the free memory by."""
    c = desc.config
    hkv = c.num_key_value_heads // (builder.world if builder else 1)
    total = c.num_hidden_layers * _kv_bytes_layer_token(c, hkv, dtype, cache_type)
    if draft is not None:
        dc = draft.config
        total += dc.num_hidden_layers * _kv_bytes_layer_token(dc, dc.num_key_value_heads, dtype, cache_type)
    return total


def _draft_bytes(draft: ModelDesc | None, tokens: int, cache_type, backend, itemsize, dtype) -> int:
    if draft is None:
        return 0
    dc = draft.config
    w = sum(draft.layer_bytes(i, backend, itemsize) for i in range(dc.num_hidden_layers))
    w += draft.embed_bytes(itemsize) + draft.head_bytes(backend, itemsize)
    return w + tokens * dc.num_hidden_layers * _kv_bytes_layer_token(dc, dc.num_key_value_heads, dtype, cache_type)


def _place(plan: VramPlan, desc: ModelDesc, draft, settings, tokens: int, backend: str, itemsize: int, dtype,
           builder) -> None:
    c = desc.config
    n_layers = c.num_hidden_layers
    kv_layer = tokens * _kv_bytes_layer_token(c, c.num_key_value_heads, dtype, settings.cache_type)
    draft_b = _draft_bytes(draft, tokens, settings.cache_type, backend, itemsize, dtype)
    all_linears = [d for layer in desc.layers for d in layer.values()] + ([desc.head] if desc.head else [])
    if builder is not None:
        builder.fill(plan, settings, tokens, backend, itemsize, dtype, draft_b)
        return
    full = _Dims(c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size)
    devs = plan.devices
    first, last_dev = devs[0], devs[-1]
    scratch = _scratch(desc, full, settings, backend, itemsize, last=True, layers=list(desc.layers), head=desc.head,
                       device=devs[0].device)  # every device may run the widest layer and the head
    transient = _transient(all_linears, backend)
    for d in devs:
        d.scratch, d.load_transient = scratch, transient
    first.embed, first.weights, first.draft = True, desc.embed_bytes(itemsize), draft_b
    head_b = desc.head_bytes(backend, itemsize)
    if len(devs) == 1:
        first.layers, first.head = (0, n_layers), True
        first.weights += sum(desc.layer_bytes(i, backend, itemsize) for i in range(n_layers)) + head_b
        first.kv_cache = kv_layer * n_layers
        return
    # layer split: fill in order; a device is left once the next item would push its peak past the budget
    di, start = 0, 0
    for i in range(n_layers + 1):
        is_head = i == n_layers
        cost_w = head_b if is_head else desc.layer_bytes(i, backend, itemsize)
        cost_kv = 0 if is_head else kv_layer
        while True:
            d = devs[di]
            if is_head and desc.head is None and di > 0:
                cost_w = head_b + desc.embed_bytes(itemsize)  # a tied head needs the table on its own device
            fits = d.capacity is None or d.peak + cost_w + cost_kv <= d.capacity
            if fits or di == len(devs) - 1:
                break
            d.layers = (start, i)
            di, start = di + 1, i
        d = devs[di]
        d.weights += cost_w
        d.kv_cache += cost_kv
        if is_head:
            d.head = True
        else:
            d.layers = (start, i + 1)
    for d in devs[di + 1 :]:  # devices past the head hold nothing
        d.scratch = d.load_transient = d.reserve = 0
    if plan.notes is not None and last_dev is not devs[di]:
        plan.notes.append(f"{len(devs) - di - 1} device(s) after {devs[di].device} are not needed")


def _check_tp(config, world: int) -> None:
    if config.num_key_value_heads % world or config.num_attention_heads % world:
        common = math.gcd(config.num_attention_heads, config.num_key_value_heads)
        raise ConfigError(f"tensor_parallel={world} must divide the model's {config.num_attention_heads} attention "
                          f"heads and {config.num_key_value_heads} KV heads; use a divisor of {common}",
                          field="tensor_parallel")


class _TPBuilder:
    """Per-rank bytes under tensor parallelism, split exactly as model/tp_shard.py splits the tensors."""

    def __init__(self, desc: ModelDesc, world: int):
        self.desc, self.world = desc, world

    def layer_parts(self, i: int, rank: int) -> list[LinearDesc]:
        c, w = self.desc.config, self.world
        lay = self.desc.layers[i]
        d = c.head_dim
        down = lay["down_proj"]
        if down.quantized:
            g0, g1 = balanced_ranges([r for _, r in down.groups], w)[rank]
            rows = sum(r for _, r in down.groups[g0:g1])
            down_part = down.row_part(g0, g1, with_bias=rank == 0)
        else:
            r0, r1 = _even(down.in_features, w, rank)
            rows, down_part = r1 - r0, down.row_part(r0, r1, with_bias=rank == 0)
        return [lay["q_proj"].column_part(c.num_attention_heads // w * d),
                lay["k_proj"].column_part(c.num_key_value_heads // w * d),
                lay["v_proj"].column_part(c.num_key_value_heads // w * d),
                lay["o_proj"],  # replicated: every rank gathers all heads and applies the whole o_proj
                lay["gate_proj"].column_part(rows), lay["up_proj"].column_part(rows), down_part]

    def fill(self, plan, settings, tokens, backend, itemsize, dtype, draft_b) -> None:
        desc, w = self.desc, self.world
        c = desc.config
        hkv = c.num_key_value_heads // w
        kv_layer = tokens * _kv_bytes_layer_token(c, hkv, dtype, settings.cache_type)
        vocab_local = -(-c.vocab_size // w)
        head = None if desc.head is None else desc.head.column_part(vocab_local)
        for rank, d in enumerate(plan.devices):
            parts = [p for i in range(c.num_hidden_layers) for p in self.layer_parts(i, rank)]
            inter = max(p.out_features for p in parts[4::7])
            dims = _Dims(c.num_attention_heads // w, hkv, inter, vocab_local if head else c.vocab_size)
            d.layers, d.embed, d.head = (0, c.num_hidden_layers), True, True
            d.weights = sum(p.device_bytes(backend, itemsize) for p in parts)
            d.weights += 2 * c.num_hidden_layers * desc.norm_bytes(itemsize) + desc.embed_bytes(itemsize)
            d.weights += desc.norm_bytes(itemsize) + (0 if head is None else head.device_bytes(backend, itemsize))
            d.kv_cache = kv_layer * c.num_hidden_layers
            d.draft = draft_b if rank == 0 else 0
            names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
            layers = [dict(zip(names, parts[i : i + 7])) for i in range(0, len(parts), 7)]
            d.scratch = _scratch(desc, dims, settings, backend, itemsize, last=True, layers=layers, head=head,
                                 device=d.device)
            d.scratch += 2 * settings.max_batch_size * c.vocab_size * 4  # gathered logits
            d.load_transient = _transient([p for p in desc.layers[0].values()] + ([desc.head] if desc.head else []),
                                          backend)


def _even(n: int, parts: int, rank: int) -> tuple[int, int]:
    """Rank's range of n items cut into `parts` near-equal contiguous pieces."""
    step = -(-n // parts)
    return min(n, rank * step), min(n, (rank + 1) * step)
