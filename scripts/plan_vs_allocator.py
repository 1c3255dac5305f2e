"""Where the device bytes of a freshly built model go that the load plan does not count.

Builds the model of tests/multigpu/test_multigpu_cuda.py (Llama-3 proportions, 8 layers, hidden 2048, 4.0 bpw)
with the allocator's history recorded, then prints the plan's weight bytes, the allocator's, and every live
allocation made during the build that no attribute of the model reaches, by size, with the frames that made it.

    python3 scripts/plan_vs_allocator.py
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exl2_backend.model import LlamaModel
from exl2_backend.plan import describe_random, plan_load
from tests.multigpu.test_multigpu_cuda import SETTINGS, SHAPE, _cuda_bytes_by_attribute, _weights


def reachable_storages(root) -> set[int]:
    seen, stack, visited = set(), [root], set()
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda:
                seen.add(obj.untyped_storage().data_ptr())
            continue
        if id(obj) in visited or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        visited.add(id(obj))
        if isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
        elif hasattr(obj, "__dict__"):
            stack += list(vars(obj).values())
    return seen


def live_blocks() -> dict[int, dict]:
    out = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        addr = seg["address"]
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                out[addr] = blk
            addr += blk["size"]
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 1
    from exl2_backend.ops import cuda_quant

    plan = plan_load(SETTINGS, desc=describe_random(SHAPE, 4.0),
                     free_memory={"cuda:0": int(torch.cuda.mem_get_info(0)[0])})
    torch.cuda.memory._record_memory_history(max_entries=200000)
    before_blocks = set(live_blocks())
    before = torch.cuda.memory_allocated(0)
    config, w = _weights()
    model = LlamaModel(config, w, "cuda:0")
    del w
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated(0)
    wsp = cuda_quant._WORKSPACES.get(torch.device("cuda:0"))
    ws_bytes = 0 if wsp is None else sum(t.untyped_storage().nbytes() for t in (wsp.ws, wsp.counters, *wsp._old))
    print(f"plan weights {plan.devices[0].weights:,} B; allocator {after - before:,} B, of which kernel workspace "
          f"{ws_bytes:,} B -> weights {after - before - ws_bytes:,} B")
    print("reachable by attribute:", _cuda_bytes_by_attribute(model))
    reach = reachable_storages(model)
    if wsp is not None:
        reach |= {t.untyped_storage().data_ptr() for t in (wsp.ws, wsp.counters, *wsp._old)}
    stray = defaultdict(lambda: [0, 0])
    reached_block_bytes = 0
    for addr, blk in live_blocks().items():
        if addr in before_blocks:
            continue
        if addr in reach:
            reached_block_bytes += blk["size"]
            continue
        frames = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in blk.get("frames", [])
                  if "exl2_backend" in f["filename"] or "tests" in f["filename"]][:4]
        key = " <- ".join(frames) or "(no python frame)"
        stray[key][0] += blk["size"]
        stray[key][1] += 1
    print(f"allocator blocks the model reaches: {reached_block_bytes:,} B (rounding over storage bytes included)")
    total = sum(v[0] for v in stray.values())
    print(f"live allocations of the build that the model does not reach: {total:,} B")
    for key, (size, n) in sorted(stray.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {size:>12,} B in {n:>4} blocks  {key}")
    torch.cuda.memory._record_memory_history(enabled=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
