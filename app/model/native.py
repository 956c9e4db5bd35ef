"""This project's C++ kernel library for x86-64 CPUs (`csrc/`): where it comes from and how it loads.

One library holds the int8 products and the one-call step of the CPU drafts (`app.engine.drafting.int8`), the
batch-invariant attention of the decoders (`app.model.kernels.prefix_attention`) and an fp32 decoder's products
over fp16 weights (`app.model.halflinear`). It runs
AVX-512 code where the CPU has it and AVX2 + FMA code elsewhere (`kernel_isa()`). It comes from a
portable build made ahead of time (`python -m app kernels --install`, as the Docker image's build
stage does, for runtimes without a compiler), else it is compiled on first use by torch's C++
extension loader and cached (`TORCH_EXTENSIONS_DIR`). Where neither works, every caller has a
torch fallback.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from app.model.cpu import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "int8_linear.cpp"  # includes the other files of csrc/


def kernel_sources() -> list[Path]:
    """The files the kernel compiles from (the .cpp includes the rest); its build names hash them all."""
    return sorted(p for p in SOURCE.parent.iterdir() if p.suffix in (".cpp", ".h", ".inc"))


# Either build compiles the kernel's SIMD functions twice, for AVX2 + FMA (Intel since Haswell, AMD
# since Zen 1) and for AVX-512 F/BW/DQ/VL + VNNI (Intel since Cascade Lake, AMD since Zen 4), and picks
# one at load time. A portable build keeps everything else baseline x86-64, so it loads on any x86-64
# CPU; a native build lets the compiler use whatever the building CPU has elsewhere too.
PORTABLE_CFLAGS = ("-O3", "-fopenmp")
# -fopenmp compiles at::parallel_for's pragmas (without it they run on one thread); the OpenMP runtime is
# the one torch already loaded: the library links no other.
NATIVE_CFLAGS = ("-O3", "-march=native", "-fopenmp")
# The least the kernel runs on, as /proc/cpuinfo names them (every AVX2 CPU also has F16C, for fp16 weights).
CPU_FLAGS = ("avx2", "fma", "f16c")


def cpu_runs_kernel() -> bool:
    """True on an x86-64 Linux CPU with the instruction sets the kernel needs at the least (AVX2 + FMA)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return cpu_flags().issuperset(CPU_FLAGS)


def prebuilt_dir() -> Path:
    """Where `python -m app kernels --install` puts a portable build: `SPECWHISPER_KERNEL_DIR`, else the package.

    Read when the kernel is first needed, like torch's `TORCH_EXTENSIONS_DIR`.
    """
    configured = os.environ.get("SPECWHISPER_KERNEL_DIR")
    return Path(configured) if configured else SOURCE.parent / "prebuilt"


def _sources_digest(*extra: bytes) -> str:
    """A short hash of every kernel source, then of `extra` (what else a build depends on)."""
    parts = [*(p.read_bytes() for p in kernel_sources()), *extra]
    return hashlib.sha1(b"\0".join(parts)).hexdigest()[:12]


def portable_name() -> str:
    """Module name of a portable build: it changes with the source and with torch (whose ABI it links)."""
    digest = _sources_digest(torch.__version__.encode(), *(flag.encode() for flag in PORTABLE_CFLAGS))
    return f"specwhisper_int8_portable_{digest}"


def install_portable(dest: Path | None = None) -> Path:
    """Compile a portable build of the kernel into `dest` (default `prebuilt_dir()`); returns the library.

    For images and machines that run without a compiler: the build stage of the Dockerfile runs this, and
    `kernel_extension()` then loads the library instead of compiling one.
    """
    from torch.utils.cpp_extension import load

    dest = dest or prebuilt_dir()
    dest.mkdir(parents=True, exist_ok=True)
    name = portable_name()
    with tempfile.TemporaryDirectory(prefix="specwhisper-kernel-") as build:
        ext = load(name=name, sources=[str(SOURCE)], extra_cflags=list(PORTABLE_CFLAGS), build_directory=build)
        target = dest / f"{name}.so"
        shutil.copyfile(ext.__file__, target.with_suffix(".tmp"))
        target.with_suffix(".tmp").replace(target)  # a reader never sees half a library
    return target


def _load_prebuilt() -> Any | None:
    name = portable_name()
    path = prebuilt_dir() / f"{name}.so"
    if not path.is_file():
        return None
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        return None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build_directory(name: str) -> Path:
    """Where torch's extension loader builds and caches `name` (`TORCH_EXTENSIONS_DIR` or its default)."""
    from torch.utils import cpp_extension

    locate = getattr(cpp_extension, "_get_build_directory", None)  # private, kept for years
    if locate is not None:
        return Path(locate(name, False))
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name


def _compile_native() -> Any:
    from torch.utils.cpp_extension import load

    # One build folder per source version and checkout: ninja rebuilds when a source's path changes,
    # so two checkouts of one version (or a bench against an old worktree) rebuilt each other's (~30 s).
    name = f"specwhisper_int8_{_sources_digest(str(SOURCE).encode())}"
    build = build_directory(name)
    build.mkdir(parents=True, exist_ok=True)
    # torch guards a build with a lock file that stays behind when its process is killed mid-build
    # (a worker that missed its start deadline): every later load then waits for it forever. A lock
    # the kernel drops with its holder guards ours, so a lock file seen while holding it is stale.
    with open(build / "specwhisper.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (build / "lock").exists():
            log.warning("removing the lock file of a kernel build that did not finish: %s", build / "lock")
            (build / "lock").unlink(missing_ok=True)
        return load(name=name, sources=[str(SOURCE)], extra_cflags=list(NATIVE_CFLAGS), build_directory=str(build))


@functools.cache
def kernel_extension() -> Any | None:
    """The kernel module, or None (not an x86-64 CPU with AVX2 + FMA, or neither a build nor a compiler).

    A portable build in `prebuilt_dir()` is loaded as it is; otherwise the kernel is compiled for this
    CPU on first use and cached by torch's extension loader.
    """
    if not cpu_runs_kernel():
        log.info("this CPU has no AVX2 + FMA; drafts use torch's dynamic int8 linear, decoders torch's attention")
        return None
    try:
        ext = _load_prebuilt()
    except Exception as exc:  # a damaged file, a library for another torch: compile instead
        log.warning("the portable kernel library in %s does not load (%s)", prebuilt_dir(), exc)
        ext = None
    if ext is None:
        try:
            ext = _compile_native()
        except Exception as exc:  # no compiler, no headers, a failed build: torch's int8 linear serves
            log.warning("kernel library unavailable (%s); using torch's int8 linear and attention", exc)
            return None
    if not ext.available():
        return None
    log.info("kernel library (%s): %s", ext.isa(), ext.__file__)
    return ext


def kernel_isa() -> str | None:
    """The instruction set the kernel runs here ('avx512_vnni' or 'avx2'), or None where it does not run."""
    ext = kernel_extension()
    return None if ext is None else str(ext.isa())
