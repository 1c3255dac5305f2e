"""One decode step whose logits hold a NaN in the first sequence's row: that sequence must fail (finish "error",
pages returned) and the other decode on. Shared by the engine's CPU test and its GPU twin."""

from __future__ import annotations


def check_nan_row_fails_only_its_sequence(engine, monkeypatch, params, prompts: dict[str, list[int]],
                                          fault: float = float("nan")) -> None:
    """prompts: {"sick": [...], "well": [...]}; `params` with room for a few tokens; `fault` the bad logit (NaN, or
    +inf: an fp16 overflow)."""
    free = engine.pages.available
    for sid, ids in prompts.items():
        engine.add_sequence(sid, ids, params)
    engine.prefill(list(prompts))
    real_run = engine.runner.run

    def nan_in_row_0(*args, **kwargs):
        logits = real_run(*args, **kwargs).clone()  # [B, V]
        logits[0, 5] = fault
        return logits

    monkeypatch.setattr(engine.runner, "run", nan_in_row_0)
    sick, well = engine.decode(["sick", "well"])
    monkeypatch.setattr(engine.runner, "run", real_run)
    assert sick.finish_reason == "error" and "NaN logits" in sick.error and not sick.token_ids
    assert well.finish_reason is None and len(well.token_ids) == 1
    for _ in range(params.max_new_tokens):  # bounded: "well" finishes within its max_new_tokens
        if engine.decode(["well"])[0].finish_reason:
            break
    assert engine.seqs["well"].finished
    engine.release("sick")
    engine.release("well")
    engine.assert_no_leaks()
    assert engine.pages.available == free
