"""ShardIndex: globbing shards, header validation, lazy reads, and the streaming writer's files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl2_backend.errors import CorruptFileError, MissingTensorError, ModelDirectoryError, ModelFormatError
from exl2_backend.format.safetensors_io import ShardIndex, read_header
from exl2_backend.format.writer import plan_shards, shard_file_names, write_safetensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.q_weight": torch.randint(-(2**31), 2**31, (12, 64), dtype=torch.int32, generator=g),
        "a.q_groups": torch.tensor([4, 0, 4, 4], dtype=torch.int16),
        "b.weight": torch.randn(16, 8, generator=g).half(),
        "c.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "d.weight": torch.randn(7, generator=g),
    }


def _write_raw(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_streaming_writer_output_reads_back_everywhere(tmp_path):
    t = _tensors()
    path = tmp_path / "x.safetensors"
    write_safetensors(path, [(n, v.dtype, tuple(v.shape)) for n, v in t.items()], t.__getitem__)
    back = load_file(str(path))  # the safetensors library accepts our files
    assert all(torch.equal(back[n], v) for n, v in t.items())
    idx = ShardIndex(tmp_path)
    assert idx.keys() == list(t) and idx.has("b.weight") and not idx.has("zz")
    assert all(torch.equal(idx.get(n), v) for n, v in t.items())
    assert idx.file_of("a.q_groups") == path
    assert idx.info("c.weight").dtype == "BF16" and idx.info("c.weight").shape == (5, 3)


def test_index_globs_shards_and_ignores_index_json(tmp_path):
    t = _tensors()
    save_file({k: t[k] for k in ("a.q_weight", "a.q_groups")}, str(tmp_path / "one.safetensors"))
    save_file({k: t[k] for k in ("b.weight", "c.weight")}, str(tmp_path / "two.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"zzz": "gone.safetensors"}}))
    idx = ShardIndex(tmp_path)
    assert sorted(idx.keys()) == ["a.q_groups", "a.q_weight", "b.weight", "c.weight"]
    assert idx.file_of("c.weight").name == "two.safetensors"
    with pytest.raises(MissingTensorError) as e:
        idx.get("zzz")
    assert e.value.tensor == "zzz" and str(tmp_path) in str(e.value)


def test_duplicate_key_across_shards(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ModelFormatError) as e:
        ShardIndex(tmp_path)
    assert e.value.tensor == "w" and "a.safetensors" in str(e.value) and "b.safetensors" in str(e.value)


@pytest.mark.parametrize("entry,what", [
    ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}, "dtype"),
    ({"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}, "do not match"),
    ({"dtype": "F16", "shape": [-1], "data_offsets": [0, 4]}, "shape"),
    ({"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}, "data_offsets"),
    ({"dtype": "F16", "shape": [2], "data_offsets": [0, 4, 5]}, "data_offsets"),
    ({"dtype": "F16", "shape": [8], "data_offsets": [0, 16]}, "truncated"),
    ({"dtype": "F16", "shape": [1], "data_offsets": [2, 4]}, "gap"),
    ("nope", "not an object"),
])
def test_header_entry_validation(tmp_path, entry, what):
    path = tmp_path / "m.safetensors"
    _write_raw(path, {"bad.tensor": entry}, b"\0" * 4)
    with pytest.raises(CorruptFileError) as e:
        read_header(path)
    assert what in str(e.value) and e.value.tensor == "bad.tensor" and e.value.path == str(path)


@pytest.mark.parametrize("content,what", [
    (b"\x01\x02", "shorter"),
    (struct.pack("<Q", 1000) + b"{}", "exceeds"),
    (struct.pack("<Q", 4) + b"\xff\xfe{]", "JSON"),
    (struct.pack("<Q", 2) + b"[]", "object"),
])
def test_whole_header_validation(tmp_path, content, what):
    path = tmp_path / "m.safetensors"
    path.write_bytes(content)
    with pytest.raises(CorruptFileError) as e:
        ShardIndex(tmp_path)
    assert what in str(e.value) and e.value.path == str(path)


def test_metadata_entry_is_skipped(tmp_path):
    save_file({"w": torch.arange(4, dtype=torch.int32)}, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    assert ShardIndex(tmp_path).keys() == ["w"]


def test_directory_errors(tmp_path):
    with pytest.raises(ModelDirectoryError):
        ShardIndex(tmp_path / "missing")
    with pytest.raises(ModelDirectoryError) as e:
        ShardIndex(tmp_path)
    assert "safetensors" in str(e.value)


def test_shard_planning_and_names():
    specs = [(f"t{i}", torch.float16, (512 * 1024,)) for i in range(5)]  # 1 MiB each
    assert [len(s) for s in plan_shards(specs, 2.5)] == [2, 2, 1]
    assert [len(s) for s in plan_shards(specs, 0.1)] == [1] * 5  # an oversize tensor still gets its own shard
    assert [len(s) for s in plan_shards(specs, 8192)] == [5]
    assert shard_file_names(1) == ["output.safetensors"]
    assert shard_file_names(3) == [f"output-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
