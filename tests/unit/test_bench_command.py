"""`exl2-backend bench` end to end on the CPU: a small random EXL2 directory, two cache types, the JSON and the plot
(the GPU figures come from the same code on the device; this checks the command's wiring and its output)."""

from __future__ import annotations

import json

import pytest

from exl2_backend.format.random_model import write_random_exl2_model
from tests.helpers.shapes import SMALL


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return write_random_exl2_model(tmp_path_factory.mktemp("bench") / "m", SMALL, bpw=4.0, seed=3)


def test_bench_writes_json_and_plot(small_dir, tmp_path, capsys, monkeypatch):
    from exl2_backend.bench.decode import PREFILL_RUNS
    from exl2_backend.cli.main import main

    monkeypatch.setenv("EXL2_BACKEND_GRAPH_IO", "1")  # recorded with the results (a CPU run takes no graphs)

    out, png = tmp_path / "out.json", tmp_path / "out.png"
    rc = main(["bench", str(small_dir), "--device", "cpu", "--contexts", "32,64", "--decode-tokens", "4",
               "--prefill-tokens", "48", "--cache-type", "fp16,q4", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["cache_type"] for r in result["runs"]] == ["fp16", "q4"]
    assert all(r["switches"]["EXL2_BACKEND_GRAPH_IO"] == "1" for r in result["runs"])
    for run in result["runs"]:
        assert [row["context"] for row in run["decode"]] == [32, 64]
        for row in run["decode"]:
            assert row["decode_tokens_per_s"] > 0 and row["bytes_per_token"] > run["weight_bytes_per_token"]
        prefill = run["prefill"]
        assert prefill["tokens"] == 48 and len(prefill["runs_tokens_per_s"]) == PREFILL_RUNS
        assert sorted(prefill["runs_tokens_per_s"])[PREFILL_RUNS // 2] == pytest.approx(prefill["tokens_per_s"])
    q4, fp16 = result["runs"][1], result["runs"][0]
    assert q4["kv_bytes_per_token"] < 0.3 * fp16["kv_bytes_per_token"]  # codes + scales, ~28% of fp16
    assert {row["cache_type"] for row in result["kv_cache_types"]["types"]} >= {"fp16", "q8", "q4"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "prefill 48 tokens" in text and "median of" in text


def test_bench_rejects_an_unknown_cache_type(small_dir, capsys):
    from exl2_backend.cli.main import main

    assert main(["bench", str(small_dir), "--device", "cpu", "--cache-type", "q5"]) == 2  # as every typed error
    assert "--cache-type takes" in capsys.readouterr().err


def test_generate_exits_nonzero_when_the_sequence_fails(small_dir, monkeypatch, capsys):
    """`generate` printed the error of a failed sequence and still exited 0; a failed generation is a failed
    command (exit 2). The failure is a NaN logit row, which the engine turns into finish "error"."""
    from exl2_backend.cli.main import main
    from exl2_backend.runtime.model_runner import ModelRunner

    real_run = ModelRunner.run

    def nan_logits(self, *args, **kwargs):
        return real_run(self, *args, **kwargs) * float("nan")

    assert main(["generate", str(small_dir), "--device", "cpu", "--prompt", "hello", "--max-new-tokens", "3"]) == 0
    monkeypatch.setattr(ModelRunner, "run", nan_logits)
    assert main(["generate", str(small_dir), "--device", "cpu", "--prompt", "hello", "--max-new-tokens", "3"]) == 2
    assert "NaN logits" in capsys.readouterr().err


def test_bench_says_why_its_sequence_failed(small_dir, monkeypatch, capsys):
    """A model whose logits are NaN (the random 70B before center_codes): bench's error names the cause, not only
    "sequence 'warmup' has finished (error)"."""
    from exl2_backend.cli.main import main
    from exl2_backend.runtime.model_runner import ModelRunner

    real_run = ModelRunner.run
    monkeypatch.setattr(ModelRunner, "run", lambda self, *a, **k: real_run(self, *a, **k) * float("nan"))
    assert main(["bench", str(small_dir), "--device", "cpu", "--contexts", "32", "--decode-tokens", "2",
                 "--prefill-tokens", "16"]) == 2
    err = capsys.readouterr().err
    assert "has finished (error: numerical fault" in err and "NaN logits" in err, err


def test_default_contexts_stop_at_the_models_positions(tmp_path, capsys):
    """`bench` with its default contexts (up to 32768) on a model of fewer positions (SmolLM2, the default model,
    has 8192) failed with a max_seq_len error; it now measures the contexts that fit and says which it skipped. An
    explicit context past them is a ConfigError naming --contexts."""
    from exl2_backend.cli.main import main

    d = write_random_exl2_model(tmp_path / "m", {**SMALL, "max_position_embeddings": 1024}, bpw=4.0, seed=3)
    out = tmp_path / "out.json"
    assert main(["bench", str(d), "--device", "cpu", "--decode-tokens", "2", "--prefill-tokens", "16",
                 "--json", str(out)]) == 0
    assert [row["context"] for row in json.loads(out.read_text())["decode"]] == [512]
    assert "contexts past the model's 1024 positions skipped: 2048, 8192, 32768" in capsys.readouterr().err
    assert main(["bench", str(d), "--device", "cpu", "--contexts", "512,2048", "--decode-tokens", "2",
                 "--prefill-tokens", "16"]) == 2
    assert "--contexts 2048 needs 2304 positions" in capsys.readouterr().err


def test_generate_checks_its_request_before_loading(tmp_path, capsys):
    """Bad sampling values or max_new_tokens fail before the model loads (a directory that is not there is never
    read) and nothing is echoed to stdout: `generate --top-p 2` printed the prompt, then the error after it."""
    from exl2_backend.cli.main import main

    for flags, message in ((["--top-p", "2"], "SamplingParamsError: top_p"),
                           (["--temperature", "-1"], "SamplingParamsError: temperature"),
                           (["--max-new-tokens", "0"], "InvalidRequestError: max_new_tokens")):
        assert main(["generate", str(tmp_path / "absent"), "--device", "cpu", "--prompt", "hi", *flags]) == 2
        out = capsys.readouterr()
        assert message in out.err and out.out == "", (flags, out)


def test_generate_takes_max_tokens_for_max_new_tokens(small_dir, capsys):
    """--max-tokens (the OpenAI API's name) is --max-new-tokens: the summary line counts that many tokens."""
    from exl2_backend.cli.main import main

    assert main(["generate", str(small_dir), "--device", "cpu", "--prompt", "hello", "--max-tokens", "4",
                 "--ignore-eos"]) == 0
    assert "[4 tokens, finish=length" in capsys.readouterr().err


def test_bench_json_to_stdout_is_json_alone(small_dir, capsys):
    """`--json -`: the tables go to stderr, so stdout parses as the JSON document."""
    from exl2_backend.cli.main import main

    rc = main(["bench", str(small_dir), "--device", "cpu", "--contexts", "32", "--decode-tokens", "2",
               "--prefill-tokens", "16", "--json", "-"])
    assert rc == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["decode"][0]["context"] == 32
    assert "decode" in captured.err  # the table


@pytest.mark.parametrize("argv, says", [
    (["--contexts", "abc"], "--contexts"), (["--contexts", "-5"], "--contexts"),
    (["--decode-tokens", "0"], "--decode-tokens"),
    (["--shape", "bogus"], "--shape must be one of"), (["--shape", "llama3-1b", "--bpw", "nan"], "--bpw"),
    (["--shape", "llama3-1b", "--head-bits", "7"], "--head-bits"),
    (["--json", "/no/such/dir/out.json"], "--json"), (["--plot", "/no/such/dir/p.png"], "--plot"),
])
def test_bench_arguments_are_checked_first(small_dir, capsys, argv, says):
    """Each of these ran, or crashed with a traceback, or reported a speed of nothing (--decode-tokens 0)."""
    from exl2_backend.cli.main import main

    model = [] if "--shape" in argv else [str(small_dir)]
    assert main(["bench", *model, "--device", "cpu", *argv]) == 2
    assert says in capsys.readouterr().err


def test_bench_shape_refuses_a_model_out_of_another_shape(small_dir, capsys):
    """--shape X --model-out DIR measured whatever DIR held (a tiny model as "llama3-8b")."""
    from exl2_backend.cli.main import main

    assert main(["bench", "--shape", "llama3-8b", "--model-out", str(small_dir), "--device", "cpu"]) == 2
    assert "is not llama3-8b" in capsys.readouterr().err


def test_cli_settings_errors_and_bad_messages_file(small_dir, tmp_path, capsys):
    """A settings value pydantic refuses (LoadSettings built from the arguments) and a --messages file that is
    missing or not JSON: `error:` lines and exit 2, not tracebacks."""
    from exl2_backend.cli.main import main

    assert main(["generate", str(small_dir), "--device", "cpu", "--max-seq-len", "0", "--prompt", "hi"]) == 2
    assert "max_seq_len" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    for path in (tmp_path / "missing.json", tmp_path / "bad.json"):
        assert main(["generate", str(small_dir), "--device", "cpu", "--messages", str(path)]) == 2
        assert "--messages" in capsys.readouterr().err


def test_eval_refuses_a_negative_token_count_and_a_window_past_the_context(small_dir, capsys):
    """--max-tokens -250 silently dropped the text's last 250 tokens; a window past max_position_embeddings
    ran past the trained positions (and 1e8 tried to allocate a 25 GB cache)."""
    import json as json_

    from exl2_backend.cli.main import main

    assert main(["eval", str(small_dir), "--reference", str(small_dir), "--max-tokens", "-250"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
    limit = json_.loads((small_dir / "config.json").read_text())["max_position_embeddings"]
    assert main(["eval", str(small_dir), "--reference", str(small_dir), "--device", "cpu",
                 "--window", str(limit + 1)]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err



def test_decode_graph_is_the_one_that_ran_the_step():
    """The graph the bench and the pytest-benchmark suite replay: the last greedy graph launched where graph I/O ran
    (the plain graph's inputs were never written then: its replay timed an empty context), else the plain batch-1
    graph, else none (a CPU engine)."""
    from types import SimpleNamespace

    from exl2_backend.bench.decode import decode_graph

    plain, greedy = object(), object()
    runner = SimpleNamespace(_graphs={1: plain})
    assert decode_graph(SimpleNamespace(runner=runner, lookahead=SimpleNamespace(graphs=SimpleNamespace(
        last=greedy)))) is greedy
    assert decode_graph(SimpleNamespace(runner=runner, lookahead=SimpleNamespace(graphs=SimpleNamespace(
        last=None)))) is plain
    assert decode_graph(SimpleNamespace(runner=runner, lookahead=None)) is plain
    assert decode_graph(SimpleNamespace(runner=SimpleNamespace(), lookahead=None)) is None
