"""`exl2-backend generate` with a constrained output (--json, --json-schema, --regex, --choice, --lark) on the
default model (CPU): the printed answer conforms; a schema file that is missing or a regex that does not compile
is a typed error and exit 2."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.slow

ASK = ["--device", "cpu", "--chat", "Return a JSON object with the name and age of Ann, who is 31.",
       "--temperature", "0", "--max-new-tokens", "60"]


def _answer(capsys) -> str:
    return capsys.readouterr().out.strip()


def test_each_constraint_shapes_the_printed_answer(default_model_dir, tmp_path, capsys):
    from exl2_backend.cli.main import main

    schema = tmp_path / "person.json"
    properties = {"name": {"type": "string"}, "age": {"type": "integer"}}
    schema.write_text(json.dumps({"type": "object", "properties": properties, "required": ["name", "age"],
                                  "additionalProperties": False}))
    lark = tmp_path / "g.lark"
    lark.write_text('start: "Age: " /[0-9]{1,3}/')
    assert main(["generate", str(default_model_dir), *ASK, "--json-schema", str(schema)]) == 0
    assert set(json.loads(_answer(capsys))) == {"name", "age"}
    assert main(["generate", str(default_model_dir), *ASK, "--json"]) == 0
    assert isinstance(json.loads(_answer(capsys)), dict)
    assert main(["generate", str(default_model_dir), *ASK, "--choice", "young", "--choice", "old"]) == 0
    assert _answer(capsys) in ("young", "old")
    assert main(["generate", str(default_model_dir), *ASK, "--regex", "[0-9]{2} years"]) == 0
    assert re.fullmatch("[0-9]{2} years", _answer(capsys))
    assert main(["generate", str(default_model_dir), *ASK, "--lark", str(lark)]) == 0
    assert re.fullmatch("Age: [0-9]{1,3}", _answer(capsys))


@pytest.mark.parametrize("extra, says", [
    (["--json-schema", "/no/such/schema.json"], "--json-schema"),
    (["--regex", "(unclosed"], "regex"),
])
def test_bad_constraints_exit_2(default_model_dir, capsys, extra, says):
    from exl2_backend.cli.main import main

    assert main(["generate", str(default_model_dir), *ASK, *extra]) == 2
    assert says in capsys.readouterr().err
