#!/usr/bin/env python3
"""Where each GEMV launch of a captured decode step spends its time, block by block.

Needs the measurement library built with -DEXL2_GEMV_TIMELINE:
    bash scripts/build_variant.sh EXL2_GEMV_TIMELINE .dev/libexl2_kernels_timeline.so.gz

The 8B shape (a random 4.0 bpw directory under --workdir) prefills --context tokens and decodes a step; the batch-1
decode graph is then captured again with the timeline armed, so each of its GEMV launches holds a slot, and replayed
once. Thread 0 of every block stamped %globaltimer at the kernel's start, after the PDL wait, with its input staged,
after its chunk loop and after the split-K finish (csrc/quant/exl2_gemv_tma.cu). Printed per role (q/k/v, o,
gate/up, down, head), as medians over the step's launches of that role, in us:
  gap     the previous GEMV's last block end -> this launch's first block start (negative: PDL overlap; the
          attention and its reduce sit in the gap before o_proj)
  wait    block start -> PDL wait returned (median block)
  stage   wait returned -> input staged (the gather, or the norm)
  stream  input staged -> chunk loop done (median block; the slowest block's figure beside it)
  finish  chunk loop done -> split-K finish done (the last block of each column block reduces)
  span    first block start -> last block end;  tail  median block's chunk loop done -> last block end
  paired / alone  streaming of blocks that shared their SM with another block of the launch / that had it alone
  step    the launch's last block end minus the previous launch's (its share of the step's critical path)
and, for the slowest tenth of each launch's blocks by streaming time (the blocks that set its end):
  late    when they began streaming, minus the launch's median block (us; positive: they started late)
  shared  the fraction of them that shared their SM;  index  their median block index / the launch's blocks
The sum of the spans and gaps is the step's GEMV critical path as the blocks saw it. --raw keeps the stamps and the
launch metadata (.npz) for analysis off the device.

    python scripts/gemv_timeline.py --json timeline.json --raw timeline.npz
    python scripts/gemv_timeline.py --from-raw timeline.npz      # the same tables from kept stamps, no GPU
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path

import numpy as np

SLOTS, BLOCKS, POINTS, META = 1024, 512, 6, 7  # exl2_gemv_tma.cu's kTimeline* and kTimelineMeta
ROLE_ORDER = ("q/k/v", "o", "gate/up", "down", "head", "other")


def role_of(meta: np.ndarray) -> str:
    """meta [7]: blocks, M, K, N of part 0, parts, feature bits (1 norm, 2 rope, 4 gated, 8 pre-gathered), tiles."""
    _, _, k, n, parts, feats, _ = (int(v) for v in meta)
    if feats & 2:
        return "q/k/v"
    if feats & 4:
        return "down"
    if feats & 1:
        return "head" if parts == 1 and n > 4 * k else "gate/up"
    if parts == 1 and n == k:
        return "o"
    return "other"


def launch_rows(stamps: np.ndarray, meta: np.ndarray) -> list[dict]:
    """stamps [L, BLOCKS, POINTS] uint64 globaltimer ns (0: not stamped) and meta [L, 7] of the stamped launches in
    launch order -> one dict per launch (us, relative to the first launch's first block start)."""
    rows = []
    t_origin = None
    prev_end = None
    for i in range(stamps.shape[0]):
        blocks = int(meta[i][0])
        raw = stamps[i, : min(blocks, BLOCKS)]
        ok = (raw[:, :5] > 0).all(axis=1)  # blocks that stamped every point
        s, sm = raw[ok, :5].astype(np.float64), raw[ok, 5].astype(np.int64)
        if not len(s):
            continue
        if t_origin is None:
            t_origin = s[:, 0].min()
        s = (s - t_origin) / 1e3  # us
        start, end = float(s[:, 0].min()), float(s[:, 4].max())
        row = {
            "role": role_of(meta[i]), "blocks": blocks, "stamped_blocks": len(s), "start_us": start,
            "end_us": end, "gap_us": None if prev_end is None else start - prev_end,
            "wait_us": float(np.median(s[:, 1] - s[:, 0])), "stage_us": float(np.median(s[:, 2] - s[:, 1])),
            "stream_us": float(np.median(s[:, 3] - s[:, 2])), "stream_max_us": float((s[:, 3] - s[:, 2]).max()),
            "finish_us": float(np.median(s[:, 4] - s[:, 3])), "span_us": end - start,
            "tail_us": end - float(np.median(s[:, 3])), "step_us": None if prev_end is None else end - prev_end,
            **shared_sm_split(s[:, 3] - s[:, 2], sm),
            **slowest_blocks(s, sm, np.flatnonzero(ok)),
        }
        rows.append(row)
        prev_end = end
    return rows


def blocks_on_sm(sm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sm [B], the SM of each of a launch's blocks -> (blocks on each SM that ran any, per SM; the same count per
    block, i.e. how many of the launch's blocks shared that block's SM, itself included)."""
    sms, counts = np.unique(sm, return_counts=True)
    return counts, counts[np.searchsorted(sms, sm)]


def shared_sm_split(stream_us: np.ndarray, sm: np.ndarray) -> dict:
    """Streaming of blocks that shared their SM with another block of the launch against blocks alone on theirs (a
    launch of 224 items on 132 SMs puts two on 92 SMs and one on 40; session 9 saw the pairs stream at ~2/3 the
    rate per block in the chain kernel): medians, us, and how many SMs held two or more blocks."""
    counts, per_block = blocks_on_sm(sm)
    shared, alone = stream_us[per_block >= 2], stream_us[per_block == 1]
    return {"sms_shared": int((counts >= 2).sum()), "sms_alone": int((counts == 1).sum()),
            "stream_shared_us": float(np.median(shared)) if len(shared) else None,
            "stream_alone_us": float(np.median(alone)) if len(alone) else None}


def slowest_blocks(s: np.ndarray, sm: np.ndarray, index: np.ndarray) -> dict:
    """s [B, 5] stamps (us) of one launch's blocks, sm [B], index [B] their block indices -> where the slowest tenth
    by streaming time (at least one block) began streaming against the median block, the fraction of them that
    shared their SM, and their median block index as a fraction of the launch's stamped blocks."""
    stream = s[:, 3] - s[:, 2]
    k = max(1, len(stream) // 10)
    slow = np.argsort(stream, kind="stable")[-k:]
    shared = blocks_on_sm(sm)[1] >= 2
    return {"slow_late_us": float(np.median(s[slow, 2]) - np.median(s[:, 2])),
            "slow_shared_frac": float(shared[slow].mean()),
            "slow_index_frac": float(np.median(index[slow]) / len(stream))}


def summarize(rows: list[dict]) -> dict:
    """Per role: the launch count and the median of each figure over its launches; 'step': the step's first start ->
    last end and the sums of spans and of positive gaps."""
    keys = ("gap_us", "wait_us", "stage_us", "stream_us", "stream_max_us", "finish_us", "span_us", "tail_us",
            "stream_shared_us", "stream_alone_us", "sms_shared", "sms_alone", "step_us", "slow_late_us",
            "slow_shared_frac", "slow_index_frac")
    out = {}
    for role in ROLE_ORDER:
        mine = [r for r in rows if r["role"] == role]
        if not mine:
            continue
        fig = {"launches": len(mine), "blocks": int(statistics.median(r["blocks"] for r in mine))}
        for k in keys:
            vals = [r[k] for r in mine if r[k] is not None]
            fig[k] = statistics.median(vals) if vals else None
        out[role] = fig
    if rows:
        out["step"] = {"first_start_to_last_end_us": rows[-1]["end_us"] - rows[0]["start_us"],
                       "sum_span_us": sum(r["span_us"] for r in rows),
                       "sum_gap_us": sum(r["gap_us"] for r in rows if r["gap_us"] is not None and r["gap_us"] > 0)}
    return out


def capture_timeline(engine) -> tuple[np.ndarray, np.ndarray]:
    """Re-capture the engine's batch-1 decode graph with the timeline armed, replay it (warm), clear the stamps,
    replay once more -> (stamps, meta) of its GEMV launches in launch order."""
    import torch

    from exl2_backend.ops import library

    lib = library.get()
    if not hasattr(lib, "exl2_gemv_timeline_arm"):
        raise SystemExit("this library has no timeline: build it with -DEXL2_GEMV_TIMELINE (see the docstring)")
    arm = library.declare("exl2_gemv_timeline_arm", library.I32)
    copy = library.declare("exl2_gemv_timeline_copy", library.PTR, library.PTR, library.I32,
                           ctypes.POINTER(ctypes.c_int))
    runner = engine.runner
    library.check(arm(0), "exl2_gemv_timeline_arm")  # slots from 0: the capture's warm-up, then the graph
    runner._capture(1)  # measurement only: the graph's launches take slots as they are captured
    graph = runner._graphs[1]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    library.check(arm(1), "exl2_gemv_timeline_arm")  # zero the stamps, keep the slots
    graph.replay()
    torch.cuda.synchronize()
    stamps = np.zeros((SLOTS, BLOCKS, POINTS), dtype=np.uint64)
    meta = np.zeros((SLOTS, META), dtype=np.int32)
    taken = ctypes.c_int(0)
    library.check(copy(stamps.ctypes.data, meta.ctypes.data, SLOTS, ctypes.byref(taken)), "exl2_gemv_timeline_copy")
    stamped = [i for i in range(min(taken.value, SLOTS)) if stamps[i, 0, 0] > 0]
    return stamps[stamped], meta[stamped]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/models")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--json", help="write the per-launch rows and the summary here")
    ap.add_argument("--raw", help="write the stamps [launches, blocks, 6] and metadata [launches, 7] here (.npz)")
    ap.add_argument("--from-raw", help="analyse stamps an earlier run kept with --raw instead of measuring")
    args = ap.parse_args()
    if args.from_raw:
        kept = np.load(args.from_raw)
        report(kept["stamps"], kept["meta"], args.json)
        return 0

    import torch

    from exl2_backend.bench.decode import load_engine, prefill_seconds
    from exl2_backend.format.random_model import write_random_exl2_model

    model_dir = Path(args.workdir) / args.shape
    if not (model_dir / "config.json").is_file():
        write_random_exl2_model(model_dir, args.shape, 4.0)
    engine, _, _ = load_engine(model_dir, "cuda", args.context + 256, use_graphs=True)
    ids = torch.randint(0, engine.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    prefill_seconds(engine, "seq", ids.tolist(), 16)
    for _ in range(2):
        engine.decode(["seq"])
    from profile_decode import upload_decode_step  # scripts/ is sys.path[0] when run as a script

    upload_decode_step(engine, "seq")  # the graph replays this sequence's next step, not an empty context
    stamps, meta = capture_timeline(engine)
    engine.release("seq")
    if args.raw:
        np.savez_compressed(args.raw, stamps=stamps, meta=meta)
    report(stamps, meta, args.json)
    return 0


def sm_bound_launches(rows: list[dict], ratio: float = 1.2, min_us: float = 1.0) -> list[tuple[int, dict]]:
    """(index, row) of the launches whose blocks sharing an SM stream at least `ratio` x and `min_us` longer than the
    blocks alone on theirs: bound by each SM's chunk rate, not by the bandwidth (session 49's BM4: the 8B's mostly
    3-bit gate/up 1.38x, its 4-bit gate/up 1.06x; o_proj's ~2 us streams differ by less than min_us)."""
    return [(i, r) for i, r in enumerate(rows) if r["stream_shared_us"] and r["stream_alone_us"]
            and r["stream_shared_us"] >= max(ratio * r["stream_alone_us"], r["stream_alone_us"] + min_us)]


def report(stamps: np.ndarray, meta: np.ndarray, json_path: str | None) -> None:
    """Print the per-role tables of stamped launches (and write rows and summary to json_path)."""
    rows = launch_rows(stamps, meta)
    summary = summarize(rows)
    print(f"{len(rows)} GEMV launches stamped; medians per role, us:")
    print(f"{'role':8s} {'n':>4s} {'blocks':>6s} {'gap':>7s} {'wait':>7s} {'stage':>7s} {'stream':>7s} {'max':>7s} "
          f"{'finish':>7s} {'span':>7s} {'tail':>7s} {'paired':>7s} {'alone':>7s} {'SMs 2/1':>8s}")
    for role in ROLE_ORDER:
        f = summary.get(role)
        if f:
            vals = [f[k] for k in ("gap_us", "wait_us", "stage_us", "stream_us", "stream_max_us", "finish_us",
                                   "span_us", "tail_us", "stream_shared_us", "stream_alone_us")]
            print(f"{role:8s} {f['launches']:4d} {f['blocks']:6d} "
                  + " ".join("      -" if v is None else f"{v:7.2f}" for v in vals)
                  + f" {f['sms_shared']:4.0f}/{f['sms_alone']:<3.0f}")
    print("the slowest tenth of each launch's blocks (medians over launches): step us, late us, shared, index")
    for role in ROLE_ORDER:
        f = summary.get(role)
        if f and f["step_us"] is not None:
            print(f"{role:8s} {f['step_us']:7.2f} {f['slow_late_us']:7.2f} {f['slow_shared_frac']:7.2f} "
                  f"{f['slow_index_frac']:7.2f}")
    bound = sm_bound_launches(rows)
    print(f"{len(bound)} launches bound by their SMs (blocks sharing an SM stream >= 1.2x and 1 us longer than those "
          "alone): launch, role, paired / alone us")
    for i, r in bound:
        print(f"  {i:4d} {r['role']:8s} {r['stream_shared_us']:6.2f} / {r['stream_alone_us']:6.2f}")
    st = summary.get("step", {})
    print(f"step: first start -> last end {st.get('first_start_to_last_end_us', 0):.1f} us; sum of spans "
          f"{st.get('sum_span_us', 0):.1f}, of positive gaps {st.get('sum_gap_us', 0):.1f}")
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
