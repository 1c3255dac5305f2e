"""Tokenizer, chat template and streaming decoder, checked against transformers' own reading of the GGUF."""

from __future__ import annotations

import json

import pytest

from exl2_backend.errors import TokenizerError
from exl2_backend.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "Hello world!",
    "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "a  b   c\t\td\n\n e    ",
    "  leading spaces and trailing  ",
    "emoji 😀🎉 family 👨\u200d👩\u200d👧 flag 🇫🇷 done",
    "café naïve Ærøskøbing, São Paulo, Ελληνικά, русский",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "mixed<|endoftext|>special <repo_name> tokens",
    "numbers 12345 3.14159 1,000,000 2024-11-29",
    "I'm sure they'll've done it's not",
    "\u00a0non-breaking\u200bzero width\r\nwindows line",
    "",
]

CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "What is the capital of France?"}],  # the template adds a default system turn
    [{"role": "user", "content": "Ünïcödé 😀 and\nnewlines"}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def ours(default_fp16_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_fp16_dir)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """transformers' tokenizer built straight from the GGUF: the independent oracle."""
    transformers = pytest.importorskip("transformers")
    from exl2_backend.default_model import find_gguf

    folder = tmp_path_factory.mktemp("gguf")
    (folder / "model.gguf").symlink_to(find_gguf())
    return transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="model.gguf")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round-trips exactly


def test_digits_split_one_by_one(ours):
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) put every digit in its own piece.
    ids = ours.encode("2024")
    assert [ours.id_to_token(i) for i in ids] == ["2", "0", "2", "4"]


def test_special_ids_and_sizes(ours, hf):
    assert ours.vocab_size == 49152 == len(hf)
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_ids == {hf.eos_token_id} == {2}
    assert ours.pad_token_id == 2
    assert ours.encode("<|im_start|>") == [1]
    assert ours.token_to_id("<|im_end|>") == 2
    assert ours.add_bos_token is False and ours.encode("hi")[0] != 1
    assert ours.encode("hi", add_bos=True)[0] == 1


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, messages, add_generation_prompt):
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = hf(expected, add_special_tokens=False)["input_ids"]
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected_ids


# --- config handling and errors ----------------------------------------------------------------------


def _copy_tokenizer(src, dst, **config_overrides):
    dst.mkdir(exist_ok=True)
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(config_overrides)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_invalid_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="invalid tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_invalid_tokenizer_config(default_fp16_dir, tmp_path):
    _copy_tokenizer(default_fp16_dir, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("decoder, says", [([1], "must be an object"), ({"5": "zzqq_new"}, "no AddedToken fields")])
def test_malformed_added_tokens_decoder(default_fp16_dir, tmp_path, decoder, says):
    """added_tokens_decoder as a list, or an entry that is a bare unknown string: TokenizerError naming the
    file, not AttributeError."""
    _copy_tokenizer(default_fp16_dir, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = decoder
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match=says):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_file_that_is_not_utf8(default_fp16_dir, tmp_path):
    _copy_tokenizer(default_fp16_dir, tmp_path)
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(TokenizerError, match="chat_template.jinja"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json", "generation_config.json"])
def test_companion_file_that_is_a_directory(default_fp16_dir, tmp_path, name):
    """A directory where an optional companion file belongs is an error naming it, not a silently absent chat
    template or EOS id."""
    _copy_tokenizer(default_fp16_dir, tmp_path)
    (tmp_path / name).unlink(missing_ok=True)
    (tmp_path / name).mkdir()
    with pytest.raises(TokenizerError, match=f"{name} is not a regular file"):
        Tokenizer.from_dir(tmp_path)


def test_eos_ids_from_generation_config(default_fp16_dir, tmp_path):
    _copy_tokenizer(default_fp16_dir, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {0, 2, 5}


def test_template_features_and_errors(default_fp16_dir, tmp_path):
    templates = [
        {"name": "tool_use", "template": "TOOLS {{ tools | tojson }}"},
        {"name": "default", "template": (
            "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
            "{{ bos_token }}{{ m.content | tojson }}{% endfor %}{{ strftime_now('%Y')[:2] }}")},
    ]
    tok = Tokenizer.from_dir(_copy_tokenizer(default_fp16_dir, tmp_path, chat_template=templates))
    assert tok.apply_chat_template([{"role": "user", "content": "é<&>"}]) == '<|im_start|>"é<&>"20'
    assert tok.apply_chat_template([], template_name="tool_use", tools=[{"b": 1, "a": 2}]) == 'TOOLS [{"b": 1, "a": 2}]'
    assert tok.encode_chat([{"role": "user", "content": "x"}])[0] == 1  # BOS written by the template, once
    with pytest.raises(TokenizerError, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])


def test_template_syntax_error_and_missing_template(default_fp16_dir, tmp_path):
    tok = Tokenizer.from_dir(_copy_tokenizer(default_fp16_dir, tmp_path, chat_template="{% for %}"))
    with pytest.raises(TokenizerError, match="does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok = Tokenizer.from_dir(_copy_tokenizer(default_fp16_dir, tmp_path / "b", chat_template=None))
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    # a list that is not {name, template} objects is malformed, not "no chat template"
    tok = Tokenizer.from_dir(_copy_tokenizer(default_fp16_dir, tmp_path / "c", chat_template=[1, "x"]))
    with pytest.raises(TokenizerError, match="must hold {name, template} objects"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sandbox_blocks_python_internals(default_fp16_dir, tmp_path):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_dir(_copy_tokenizer(default_fp16_dir, tmp_path, chat_template=evil))
    with pytest.raises(TokenizerError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# --- incremental decoding ----------------------------------------------------------------------------


def _stream(decoder: IncrementalDecoder, ids: list[int]) -> list[str]:
    deltas = [decoder.push(i) for i in ids]
    deltas.append(decoder.flush())
    return deltas


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_incremental_concatenation_equals_decode(ours, text):
    ids = ours.encode(text)
    for skip in (True, False):
        deltas = _stream(ours.incremental_decoder(skip_special_tokens=skip), ids)
        assert "".join(deltas) == ours.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_holds_back_partial_characters(ours):
    ids = ours.encode("😀日本")
    # The emoji's four UTF-8 bytes span several byte-level tokens: the first ones must emit nothing.
    decoder = ours.incremental_decoder()
    deltas = [decoder.push(i) for i in ids]
    assert len(ids) > 3 and "" in deltas[:-1]
    assert "".join(deltas) + decoder.flush() == "😀日本"


def test_incremental_flush_releases_an_unfinished_character(ours):
    ids = ours.encode("ok 😀")[:-1]  # cut inside the emoji
    decoder = ours.incremental_decoder()
    streamed = "".join(decoder.push(i) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + decoder.flush() == ours.decode(ids)


def _sentencepiece_like():
    """A Llama-2-style vocab: Metaspace spaces, byte fallback, and a decoder that strips the first space."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "▁Hello": 2, "▁world": 3, "<0xE2>": 4, "<0x82>": 5, "<0xAC>": 6, "!": 7,
             "▁": 8}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>"])
    return tok


@pytest.mark.parametrize("ids", [[2, 3, 7], [1, 2, 3, 4, 5, 6, 7], [8, 2, 4, 5, 6, 3], [1, 3, 1, 3, 4, 5]])
def test_incremental_sentencepiece_spacing(ids):
    tok = _sentencepiece_like()
    assert tok.decode([3]) == "world"  # why per-token decoding would lose spaces
    for skip in (True, False):
        decoder = IncrementalDecoder(tok, skip_special_tokens=skip, special_ids={1})
        deltas = _stream(decoder, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas[:-1])


def test_text_that_is_not_unicode_is_a_tokenizer_error(ours):
    """A str holding a lone surrogate cannot be encoded: a TokenizerError naming the character, not the
    tokenizers library's bare TypeError (which a host would not treat as the request's fault)."""

    with pytest.raises(TokenizerError, match=r"character 3 is a lone surrogate \(U\+D83D\)"):
        ours.encode("Hi \ud83d")
    with pytest.raises(TokenizerError, match="lone surrogate"):
        ours.encode_chat([{"role": "user", "content": "\udfff"}])


@pytest.mark.parametrize("text", ["", "hello world", " " * 5000, "-" * 3000, "\n\n\t" * 900, "ab" * 4000,
                                  "日本語のテキスト" * 300, "😀" * 1000, "<|im_start|>" * 400, "x" * 20000])
def test_min_tokens_is_a_lower_bound(ours, text):
    """min_tokens (a byte count over the longest token's bytes) never exceeds the real count; encode with a
    limit below that bound refuses the text without tokenizing it."""
    from exl2_backend.errors import PromptTooLongError

    n = len(ours.encode(text))
    least = ours.min_tokens(text)
    assert least <= n
    if least > 0:
        with pytest.raises(PromptTooLongError, match=f"at least {least} tokens"):
            ours.encode(text, limit=least - 1)
    assert ours.encode(text, limit=n) == ours.encode(text)


def test_normalizers_that_remove_text_give_no_bound():
    """Stripping normalizers can shrink a text without limit (BertNormalizer drops control characters): no
    bound; compositions (NFC and kin) shrink at most 3:1; none or Prepend / Replace with text: 1."""
    from exl2_backend.tokenizer.tokenizer import _normalizer_shrink

    assert _normalizer_shrink(None) == 1
    assert _normalizer_shrink({"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "content": "\u2581"}]}) == 1
    assert _normalizer_shrink({"type": "NFKC"}) == 3
    for spec in ({"type": "BertNormalizer"}, {"type": "Strip"}, {"type": "Replace", "content": ""},
                 {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "StripAccents"}]}):
        assert _normalizer_shrink(spec) == 0

