"""Every shared-memory ring slot is released only after the warp's reads of it are done, checked in the built SASS.

A consumer warp releases a slot with a plain mbarrier arrive (SASS `SYNCS.ARRIVE.TRANS64.A1T0`); the producer then
refills the slot with a bulk copy, an async-proxy write. If the arrive is issued while the warp's shared loads of the
slot are still in flight (their registers not yet read by any instruction) and no `fence.proxy.async` (SASS
`FENCE.VIEW.ASYNC.S`) stands between them, the copy may land first: the TMA GEMV did this until session 38 and
returned wrong warp tiles in up to 27% of launches (tests/kernels/test_gemv_repeat_identical.py, H100). This test reads
the library's SASS (cuobjdump from the nvidia-cuda-cuobjdump wheel; runs where the library was built, CI included,
no GPU needed) and finds every such release; it also checks that it saw the TMA GEMV's releases (not vacuous).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

_LIB = Path(__file__).resolve().parents[2] / "exl2_backend" / "_lib" / "libexl2_kernels.so"
_INS = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_LOAD = re.compile(r"^(?:@!?P\w+\s+)?(LDS(?:M)?(?:\.[\w]+)*)\s+R(\d+),")
_RELEASE = "SYNCS.ARRIVE.TRANS64.A1T0"


def _tool_dirs() -> list[str]:
    """PATH, then the bin folders of the nvidia-cuda-cuobjdump / -nvdisasm wheels."""
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    try:
        import nvidia

        for root in nvidia.__path__:
            dirs += [str(p) for p in Path(root).glob("*/bin")]
    except ImportError:
        pass
    return dirs


def _sass() -> str:
    if not _LIB.is_file():
        pytest.skip("the CUDA library is not built here")
    path = os.pathsep.join(_tool_dirs())
    cuobjdump = shutil.which("cuobjdump", path=path)
    if cuobjdump is None or shutil.which("nvdisasm", path=path) is None:
        pytest.skip("cuobjdump / nvdisasm not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    done = subprocess.run([cuobjdump, "-sass", str(_LIB)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": path}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _load_registers(mnemonic: str, first: int) -> set[str]:
    """The registers a shared load writes: LDS.128 / LDSM .4 four, LDS.64 / LDSM .2 two, else one."""
    parts = mnemonic.split(".")
    if "128" in parts or (parts[0] == "LDSM" and parts[-1] == "4"):
        n = 4
    elif "64" in parts or (parts[0] == "LDSM" and parts[-1] == "2"):
        n = 2
    else:
        n = 1
    return {f"R{first + k}" for k in range(n)}


def _reads(instruction: str, registers: set[str]) -> bool:
    """Whether the instruction reads one of `registers` (any operand after its first, the destination)."""
    operands = instruction.split(None, 1)[1] if " " in instruction else ""
    sources = operands.split(",", 1)[1] if "," in operands else ""
    return any(re.search(rf"\b{r}\b", sources) for r in registers)


def unsafe_releases(sass: str) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Per function: the slot releases seen, and those issued while a shared load since the function's last
    mbarrier wait or block barrier is unread and unfenced."""
    seen: dict[str, int] = {}
    unsafe: dict[str, list[str]] = {}
    func, window = "", []
    for line in sass.splitlines():
        if "Function : " in line:
            func, window = line.split("Function : ", 1)[1].strip(), []
            continue
        m = _INS.match(line)
        if not m:
            continue
        ins = m.group(1)
        if "SYNCS.PHASECHK" in ins or ins.startswith("BAR.") or "FENCE.VIEW.ASYNC" in ins:
            window = []  # a wait or barrier starts a new window; a proxy fence orders every load before it
            continue
        if _RELEASE in ins:
            seen[func] = seen.get(func, 0) + 1
            for j, (load, regs) in enumerate(window):
                if regs and not any(_reads(later, regs) for later, _ in window[j + 1:]):
                    unsafe.setdefault(func, []).append(load)
            continue
        load = _LOAD.match(ins)
        window.append((ins, _load_registers(load.group(1), int(load.group(2))) if load else set()))
    return seen, unsafe


def test_no_ring_slot_is_released_before_its_shared_loads_complete():
    seen, unsafe = unsafe_releases(_sass())
    gemv = {f: n for f, n in seen.items() if "gemv_tma_kernel" in f}
    assert gemv and all(n >= 6 for n in gemv.values()), f"the TMA GEMV's slot releases were not found: {gemv}"
    assert not unsafe, "slot released while its shared loads may be in flight: " + "; ".join(
        f"{f[-60:]}: {len(loads)} x {loads[0]}" for f, loads in unsafe.items())


def test_the_check_finds_an_unfenced_release():
    """The parser on hand-written SASS: a load whose registers are read before the release passes, one that is not
    fails, and a proxy fence between them passes."""
    def fn(body: str) -> str:
        lines = [f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate(body.split("\n"))]
        return "\t\tFunction : k\n" + "\n".join(lines)

    ok = fn("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R10+URZ], R9\nLDS.128 R12, [R8+0x220]\n"
            "LOP3.LUT R20, R12, 0xf, R1, 0xea, !PT\n@!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R10+URZ+0x100], RZ")
    bad = fn("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R10+URZ], R9\nLDS.128 R12, [R8+0x220]\nLDS.128 R16, [R8+0x420]\n"
             "@!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R10+URZ+0x100], RZ")
    fenced = fn("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R10+URZ], R9\nLDS.128 R12, [R8+0x220]\nFENCE.VIEW.ASYNC.S\n"
                "@!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R10+URZ+0x100], RZ")
    assert unsafe_releases(ok) == ({"k": 1}, {})
    assert unsafe_releases(bad)[1] == {"k": ["LDS.128 R12, [R8+0x220]", "LDS.128 R16, [R8+0x420]"]}
    assert unsafe_releases(fenced) == ({"k": 1}, {})
