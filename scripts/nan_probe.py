"""Where a model's eager forward first produces a non-finite value, and how far its logits are from another run's.

Runs a 40-token prefill, two decode steps and a separate 8-token prefill (the GEMM, one-row GEMV and small-M GEMV
routes) on a fresh paged cache, recording per layer the largest |value| of the attention output, of the layer's
output and of the residual stream; prints the first non-finite one and saves the logits. Run it once on the
kernels and once with EXL2_BACKEND_DISABLE_CUDA=1 (the reference ops on the same GPU), then --compare:

    python3 scripts/nan_probe.py --shape llama3-70b --layers 4 --out /tmp/k.pt
    EXL2_BACKEND_DISABLE_CUDA=1 python3 scripts/nan_probe.py --shape llama3-70b --layers 4 --out /tmp/r.pt
    python3 scripts/nan_probe.py --compare /tmp/k.pt /tmp/r.pt

A random directory at a real shape with fewer layers (--layers) is written once under --work-dir.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model_dir_for(args) -> Path:
    """args.model, or a random EXL2 directory of args.shape with args.layers layers (written if missing)."""
    if args.model:
        return Path(args.model)
    from exl2_backend.format.random_model import shape_config_dict, write_random_exl2_model

    shape = shape_config_dict(args.shape)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    out = Path(args.work_dir) / f"{args.shape}_{shape['num_hidden_layers']}l_{args.bpw}"
    if not (out / "config.json").exists():
        write_random_exl2_model(out, shape, args.bpw, workers=args.workers)
    return out


class LayerStats:
    """Wraps DecoderLayer.attend / attention_out_mlp to record max |value| per layer (syncs: eager runs only)."""

    def __init__(self):
        self.rows: list[tuple[str, int, str, float]] = []  # (step, layer, what, max |x| or nan / inf)
        self.step = ""

    def record(self, layer: int, what: str, t) -> None:
        import torch

        if isinstance(t, torch.Tensor) and t.numel():
            finite = bool(torch.isfinite(t).all())
            v = float(t.float().abs().max()) if finite else float("nan")
            self.rows.append((self.step, layer, what, v))

    def install(self) -> None:
        from exl2_backend.model import layers

        attend, out_mlp = layers.DecoderLayer.attend, layers.DecoderLayer.attention_out_mlp
        stats = self

        def attend_wrapped(self, *a, **k):
            out = attend(self, *a, **k)
            stats.record(self.index, "attn", out)
            return out

        def out_mlp_wrapped(self, attn, residual, *a, **k):
            out, res, roped = out_mlp(self, attn, residual, *a, **k)
            stats.record(self.index, "out", out)
            stats.record(self.index, "residual", res)
            return out, res, roped

        layers.DecoderLayer.attend = attend_wrapped
        layers.DecoderLayer.attention_out_mlp = out_mlp_wrapped

    def first_nonfinite(self):
        return next((r for r in self.rows if math.isnan(r[3])), None)


def run(args) -> None:
    import torch

    from exl2_backend.model.layers import AttentionMetadata
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import dispatch

    model_dir = model_dir_for(args)
    stats = LayerStats()
    stats.install()
    model = LlamaModel.from_dir(model_dir, args.device)
    print(f"{model_dir}: {model.num_layers} layers, kernels {dispatch.cuda_enabled()}", flush=True)
    dev = model.device
    i32 = {"dtype": torch.int32, "device": dev}
    gen = torch.Generator().manual_seed(0)
    logits = {}

    def step(name, ids, pos0, cache, bt):
        t = ids.shape[1]
        meta = AttentionMetadata(bt, torch.tensor([pos0 + t], **i32), torch.arange(pos0, pos0 + t, device=dev))
        stats.step = name
        out = model.forward(ids.to(dev), torch.arange(pos0, pos0 + t, device=dev).view(1, t), cache, meta,
                            logits="all" if t > 1 else "last")
        logits[name] = out.float().cpu()
        finite = bool(torch.isfinite(out).all())
        print(f"  {name}: logits finite {finite}, max |logit| {float(out.abs().max()) if finite else 'n/a'}",
              flush=True)

    cache = model.make_cache(num_pages=8, page_size=16)
    bt = torch.arange(8, **i32).view(1, 8)
    ids = torch.randint(3, model.vocab_size, (1, 42), generator=gen)
    step("prefill40", ids[:, :40], 0, cache, bt)
    step("decode40", ids[:, 40:41], 40, cache, bt)
    step("decode41", ids[:, 41:42], 41, cache, bt)
    cache = model.make_cache(num_pages=8, page_size=16)
    step("prefill8", ids[:, :8], 0, cache, bt)
    bad = stats.first_nonfinite()
    print(f"first non-finite: {bad}" if bad else "every recorded value finite", flush=True)
    for name in ("prefill40", "decode40", "prefill8"):
        rows = [r for r in stats.rows if r[0] == name and r[2] == "residual"]
        picks = rows[:: max(1, len(rows) // 8)] + rows[-1:]
        print(f"  {name} max |residual| by layer: " + ", ".join(f"{r[1]}: {r[3]:.3g}" for r in picks), flush=True)
    if args.out:
        torch.save({"logits": logits, "stats": stats.rows}, args.out)


def compare(a: str, b: str) -> None:
    import torch

    x, y = torch.load(a), torch.load(b)
    for name, la in x["logits"].items():
        lb = y["logits"][name]
        ok = torch.isfinite(la) & torch.isfinite(lb)
        d = (la - lb)[ok]
        rel = float(d.norm() / lb[ok].norm()) if ok.any() else float("nan")
        same = bool((la.argmax(-1) == lb.argmax(-1)).all())
        print(f"{name}: non-finite {int((~torch.isfinite(la)).sum())} / {int((~torch.isfinite(lb)).sum())}, "
              f"rel L2 {rel:.3e}, max |diff| {float(d.abs().max()) if d.numel() else float('nan'):.3e}, "
              f"argmax equal {same}")
    sa = {(r[0], r[1], r[2]): r[3] for r in x["stats"]}
    for r in y["stats"]:
        v = sa.get((r[0], r[1], r[2]))
        if v is not None and math.isnan(v) != math.isnan(r[3]):
            print(f"first layer where only one run is non-finite: {r[:3]} ({v} / {r[3]})")
            break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: a random one of --shape)")
    ap.add_argument("--shape", default="llama3-70b")
    ap.add_argument("--layers", type=int, default=0, help="layers of the random model (0: the shape's)")
    ap.add_argument("--bpw", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--work-dir", default="/tmp/nan_probe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="save logits and per-layer maxima here (torch.save)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved runs and exit")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        run(args)


if __name__ == "__main__":
    main()
