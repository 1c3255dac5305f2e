"""Fill in the middle (tokenizer/fim.py, the completions API's `suffix`): the prefix-suffix-middle prompt with the
model's own markers, through the hooks on a small random model whose vocabulary has Qwen-style FIM tokens (the
prompt's ids show the layout), and a clear refusal for a model without them (the default model, through the real
server: a 400 naming the prompt)."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from exl2_backend.errors import TokenizerError
from exl2_backend.format.random_model import write_byte_tokenizer
from exl2_backend.tokenizer import Tokenizer
from exl2_backend.tokenizer.fim import fim_marker_ids, infill_ids

MARKERS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
VOCAB = 300


def _with_fim_tokens(directory) -> None:
    """A byte-level tokenizer of VOCAB - 3 tokens plus the three markers: VOCAB in all, as the model's."""
    write_byte_tokenizer(directory, VOCAB - len(MARKERS))
    tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True) for m in MARKERS])
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    directory = tmp_path_factory.mktemp("fim") / "m"
    cfg = tiny_config_dict(vocab_size=VOCAB, bos_token_id=VOCAB - 5, eos_token_id=VOCAB - 4)
    write_tiny_exl2_model(directory, cfg, seed=3)
    _with_fim_tokens(directory)
    return directory


def test_infill_layout(fim_model):
    tok = Tokenizer.from_dir(fim_model)
    p, s, m = fim_marker_ids(tok)
    assert [tok.id_to_token(i) for i in (p, s, m)] == MARKERS and max(p, s, m) < VOCAB
    ids = infill_ids(tok, "def f(x):\n    return ", "\n\nprint(f(2))")
    head, tail = tok.encode("def f(x):\n    return ", add_special_tokens=False), tok.encode("\n\nprint(f(2))",
                                                                                         add_special_tokens=False)
    assert ids == [tok.bos_token_id, p, *head, s, *tail, m]


def test_a_model_without_markers_is_refused(default_model_dir):
    tok = Tokenizer.from_dir(default_model_dir)
    assert fim_marker_ids(tok) is None
    with pytest.raises(TokenizerError, match="fill-in-the-middle"):
        infill_ids(tok, "a", "b")


def test_suffix_through_the_hooks(fim_model):
    """The prompt the engine ran is the infill layout (its prompt logprobs' ids), and the middle is generated."""
    from exl2_backend.plugin.manager import new_plugin_manager
    from exl2_backend.plugin.types import SequenceRequest, StepBatch

    pm = new_plugin_manager(builtin_fallback=True)
    h = pm.hook.exl2_load(settings={"model_dir": str(fim_model), "device": "cpu", "max_seq_len": 128})
    try:
        req = SequenceRequest("f", prompt="x = ", suffix="\ny = x", max_new_tokens=3, temperature=0.0,
                              ignore_eos=True, prompt_logprobs=0)
        ev = pm.hook.exl2_prefill(handle=h, batch=StepBatch(new=[req]))[0]
        want = infill_ids(h.engine.tokenizer, "x = ", "\ny = x")
        assert [e["token_id"] for e in ev.prompt_logprobs] == want and len(ev.token_ids) == 1
        bad = SequenceRequest("g", prompt_ids=[1, 2], suffix="x")
        with pytest.raises(Exception, match="suffix"):
            bad.validate()
    finally:
        pm.hook.exl2_unload(handle=h)


def test_info_reports_how_requests_reach_the_model(fim_model, default_model_dir, capsys):
    """`info --json`: chat template, where tools go, and the fill-in-the-middle markers (None without them)."""
    import json

    from exl2_backend.cli.main import main

    for directory, markers in ((fim_model, MARKERS), (default_model_dir, None)):
        main(["info", str(directory), "--json", "--device", "cpu"])
        prompting = json.loads(capsys.readouterr().out)["prompting"]
        assert prompting == {"chat_template": True, "tools": "hermes", "tool_call_format": "hermes",
                             "reasoning": False, "fill_in_the_middle": markers}
