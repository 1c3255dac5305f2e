"""Where does a small random EXL2 model's engine spend its time on the GPU? Loads tests/helpers/gpu_engine's model
(vocabulary from --vocab), then prefills and decodes one sequence greedy and one sampled, printing each stage's
seconds; a stage still running after --stall seconds dumps every thread's stack (faulthandler) and exits, so a hang
shows where it waits. H200 calls AN1 / AP1 of 2026-12-05: the tiny-model engine tests did not finish their first
test in 90-100 s, while `bench` on the 8B shape ran the same engine in seconds.

    python3 scripts/tiny_engine_probe.py --vocab 5000 4096 40000
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stage(name: str, fn, stall: float):
    faulthandler.dump_traceback_later(stall, exit=True)
    t0 = time.perf_counter()
    out = fn()
    faulthandler.cancel_dump_traceback_later()
    print(f"  {name}: {time.perf_counter() - t0:.2f} s", flush=True)
    return out


def probe(vocab: int, stall: float, device: str) -> None:
    import torch

    from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
    from exl2_backend.sampling import SamplingParams
    from tests.helpers.gpu_engine import write_small_model

    print(f"vocab {vocab}, torch threads {torch.get_num_threads()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = stage("write (CPU)", lambda: write_small_model(Path(tmp) / "m", vocab, 5), stall)
        engine = stage(f"load ({device})", lambda: Engine.load(LoadSettings(
            model_dir=str(model_dir), device=device, max_seq_len=256, max_batch_size=4)), stall)
        print(f"    runner {type(engine.runner).__name__}", flush=True)
        prompt = torch.randint(3, vocab, (19,), generator=torch.Generator().manual_seed(1)).tolist()
        for label, sampling in (("greedy", SamplingParams.greedy()), ("sampled", SamplingParams(temperature=0.8,
                                                                                                 seed=7))):
            engine.add_sequence(label, prompt, GenerationParams(sampling=sampling, max_new_tokens=16, ignore_eos=True))
            ev = stage(f"{label} prefill", lambda sid=label: engine.prefill([sid])[0], stall)
            print(f"    tokens {ev.token_ids} finish {ev.finish_reason} {ev.error or ''}", flush=True)
            n = 0
            while not engine.seqs[label].finished and n < 32:  # bounded: 16 tokens expected
                ev = stage(f"{label} decode {n}", lambda sid=label: engine.decode([sid])[0], stall)
                n += 1
            engine.release(label)
        engine.assert_no_leaks()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[5000])
    ap.add_argument("--stall", type=float, default=45.0, help="seconds a stage may take before the stacks are dumped")
    ap.add_argument("--device", default="cuda", help="cuda (graphs captured) or cpu (the reference path)")
    args = ap.parse_args()
    for v in args.vocab:
        probe(v, args.stall, args.device)


if __name__ == "__main__":
    main()
