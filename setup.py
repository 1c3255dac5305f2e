"""Build hook: compile csrc/ into one torch-independent CUDA shared library when nvcc is present.

The library has a plain C ABI and is loaded with ctypes (exl2_backend/ops/library.py), so one build works
with any torch version and can be built on a machine without a GPU. Without nvcc the package installs
anyway and runs on the pure-torch reference ops.

Environment:
  EXL2_BACKEND_CUDA_ARCHS   semicolon/comma list of archs, default "80;86;89;90a" (+ PTX of the newest);
                            e.g. "90a" for a quick CI or H200-only build
  EXL2_BACKEND_NO_CUDA=1    skip the CUDA build entirely
  EXL2_BACKEND_NVCC         path of nvcc (default: $CUDA_HOME/bin/nvcc, then PATH)
  EXL2_BACKEND_BUILD_JOBS   parallel nvcc processes (default: cpu count)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
LIB_NAME = "exl2_backend._lib.libexl2_kernels"


def find_nvcc() -> str | None:
    explicit = os.environ.get("EXL2_BACKEND_NVCC")
    if explicit:
        return explicit
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def gencode_flags(archs: str) -> list[str]:
    flags = []
    names = [a.strip() for a in archs.replace(",", ";").split(";") if a.strip()]
    for a in names:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    newest = names[-1].rstrip("a")
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]  # PTX for future GPUs
    return flags


class CudaLibraryBuild(build_ext):
    """Builds the single CUDA library with nvcc; skipped cleanly (with a message) when nvcc is absent."""

    def finalize_options(self) -> None:
        super().finalize_options()
        reason = self._skip_reason()
        if reason is not None:
            # Dropping the extension keeps setuptools from looking for a library that was never built.
            print(f"exl2_backend: {reason}; skipping the CUDA library (reference ops only)")
            self.extensions = []

    @staticmethod
    def _skip_reason() -> str | None:
        if os.environ.get("EXL2_BACKEND_NO_CUDA") == "1":
            return "EXL2_BACKEND_NO_CUDA=1"
        if find_nvcc() is None:
            return "nvcc not found"
        if not any((ROOT / "csrc").rglob("*.cu")):
            return "no CUDA sources in csrc/"
        return None

    def get_ext_filename(self, fullname: str) -> str:
        # A plain name, no Python ABI tag: the library does not depend on the interpreter.
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext: Extension) -> None:
        out = Path(self.get_ext_fullpath(ext.name))
        nvcc = find_nvcc()
        sources = sorted(str(p) for p in (ROOT / "csrc").rglob("*.cu"))
        archs = os.environ.get("EXL2_BACKEND_CUDA_ARCHS", "80;86;89;90a")
        build_dir = Path(self.build_temp) / "csrc"
        build_dir.mkdir(parents=True, exist_ok=True)
        common = [
            nvcc, "-O3", "-std=c++17", "--use_fast_math", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
            "-I", str(ROOT / "csrc"), "-lineinfo", "--expt-relaxed-constexpr", *gencode_flags(archs),
        ]
        objects = []

        def compile_one(src: str) -> str:
            obj = build_dir / (Path(src).relative_to(ROOT / "csrc").as_posix().replace("/", "_") + ".o")
            cmd = [*common, "-c", src, "-o", str(obj)]
            print(" ".join(cmd))
            subprocess.run(cmd, check=True)
            return str(obj)

        jobs = int(os.environ.get("EXL2_BACKEND_BUILD_JOBS", os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objects = list(pool.map(compile_one, sources))
        out.parent.mkdir(parents=True, exist_ok=True)
        link = [nvcc, "-shared", *gencode_flags(archs), "-cudart", "static", "-o", str(out), *objects]
        print(" ".join(link))
        subprocess.run(link, check=True)
        print(f"exl2_backend: built {out}", file=sys.stderr)


class BuildPyWithManifest(build_py):
    """Ships a copy of the root plugin_manifest.toml inside the package, so hosts find it in a wheel."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib) / "exl2_backend" / "plugin_manifest.toml"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / "plugin_manifest.toml", target)


setup(
    ext_modules=[Extension(LIB_NAME, sources=[])],
    cmdclass={"build_ext": CudaLibraryBuild, "build_py": BuildPyWithManifest},
)
