"""int8 twins of linear layers for the CPU drafts.

Two implementations of the same idea (int8 weights, activations quantized on the fly):
- `Int8Linear`: this project's kernel (`csrc/int8_linear.cpp`) for x86-64 CPUs with AVX2 + FMA, which
  runs AVX-512 VNNI code where the CPU has it (`kernel_isa()`): a portable build made ahead of time
  (`python -m app kernels --install`, as the Docker image's build stage does, for runtimes without a
  compiler), else compiled on first use by torch's C++ extension loader and cached
  (`TORCH_EXTENSIONS_DIR`). A draft step runs ~37 small products one row at a time; torch's dynamic
  int8 linear spends 15-30 us on each whatever its size, this kernel 3-10 us (docs/performance.md).
- `Int8DraftStack`: the same kernel running all layers of such a draft in one call, for draft
  steps (every row feeds one token): ~150 small torch ops per step become one.
- `dynamic_int8`: torch's dynamic int8 linear (fbgemm), wherever the kernel cannot be built or run.

Only drafts use them: the main model, which decides every token, keeps its own weights, so the
choice changes the speed of speculative decoding, never its output.
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
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from app.engine.kernels import PackedLinear

if TYPE_CHECKING:
    from app.engine.decoder import CrossKV, KVCache, TextDecoder

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
CPU_FLAGS = ("avx2", "fma")  # the least the kernel runs on, as /proc/cpuinfo names them


def cpu_runs_kernel() -> bool:
    """True on an x86-64 Linux CPU with the instruction sets the kernel needs at the least (AVX2 + FMA)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(flag in flags for flag in CPU_FLAGS)


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


def _build_directory(name: str) -> Path:
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
    build = _build_directory(name)
    build.mkdir(parents=True, exist_ok=True)
    # torch guards a build with a lock file that stays behind when its process is killed mid-build
    # (a worker that missed its start deadline): every later load then waits for it forever. A lock
    # the kernel drops with its holder guards ours, so a lock file seen while holding it is stale.
    with open(build / "specwhisper.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (build / "lock").exists():
            log.warning("removing the lock file of an int8 kernel build that did not finish: %s", build / "lock")
            (build / "lock").unlink(missing_ok=True)
        return load(name=name, sources=[str(SOURCE)], extra_cflags=list(NATIVE_CFLAGS), build_directory=str(build))


@functools.cache
def kernel_extension() -> Any | None:
    """The kernel module, or None (not an x86-64 CPU with AVX2 + FMA, or neither a build nor a compiler).

    A portable build in `prebuilt_dir()` is loaded as it is; otherwise the kernel is compiled for this
    CPU on first use and cached by torch's extension loader.
    """
    if not cpu_runs_kernel():
        log.info("this CPU has no AVX2 + FMA; the drafts use torch's dynamic int8 linear")
        return None
    try:
        ext = _load_prebuilt()
    except Exception as exc:  # a damaged file, a library for another torch: compile instead
        log.warning("the portable int8 draft kernel in %s does not load (%s)", prebuilt_dir(), exc)
        ext = None
    if ext is None:
        try:
            ext = _compile_native()
        except Exception as exc:  # no compiler, no headers, a failed build: torch's int8 linear serves
            log.warning("int8 draft kernel unavailable (%s); using torch's dynamic int8 linear", exc)
            return None
    if not ext.available():
        return None
    log.info("int8 draft kernel (%s): %s", ext.isa(), ext.__file__)
    return ext


def kernel_isa() -> str | None:
    """The instruction set the kernel runs here ('avx512_vnni' or 'avx2'), or None where it does not run."""
    ext = kernel_extension()
    return None if ext is None else str(ext.isa())


class Int8Linear(nn.Module):
    """int8 twin of a linear: weights int8 per output row (symmetric), run by this project's kernel.

    Input [..., in] fp32 -> output [..., out] fp32. Each input row is quantized to uint8 over its
    own range, as torch's dynamic int8 linear does for a whole input.
    """

    def __init__(self, linear: nn.Linear | PackedLinear, ext: Any) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._ext = ext
        packed, scale, row_sum = ext.quantize(linear.weight.detach().float())
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("row_sum", row_sum, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self._ext.linear(x.float(), self.packed, self.scale, self.row_sum, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 ({self._ext.isa()} kernel)"


def dynamic_int8(linear: nn.Linear | PackedLinear) -> nn.Module:
    """torch's dynamically quantized twin of `linear` (int8 weights, fp32 activations)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
    from torch.ao.quantization import default_dynamic_qconfig

    source = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    source.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)  # no copy when fp32
    if linear.bias is not None:
        source.bias = nn.Parameter(linear.bias.detach().float(), requires_grad=False)
    source.qconfig = default_dynamic_qconfig  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        return DynamicInt8Linear.from_float(source)


def int8_twin(linear: nn.Linear | PackedLinear, kernel: bool = True) -> nn.Module:
    """An int8 twin of `linear` (which is left as it is): this project's kernel where it runs, else torch's."""
    ext = kernel_extension() if kernel and linear.in_features % 4 == 0 else None
    return Int8Linear(linear, ext) if ext is not None else dynamic_int8(linear)


class Int8DraftStack:
    """The layers of an int8 draft decoder whose products all run on this project's kernel, as one call.

    For rows feeding one token each: x [B, D] (token + position embeddings) -> the last layer's
    output [B, D], with those positions' keys/values written into `cache` as the module path
    writes them.
    """

    def __init__(self, decoder: TextDecoder, ext: Any) -> None:
        params = []
        layers: list[Any] = list(decoder.layers)
        for layer in layers:
            linears = [layer.qkv, layer.self_out, layer.cross_q, layer.cross_out, layer.fc1, layer.fc2]
            parts: list[list[Tensor]] = [[lin.packed, lin.scale, lin.row_sum, _or_empty(lin.bias)] for lin in linears]
            norms: list[list[Tensor]] = [
                [n.weight.detach().float(), n.bias.detach().float()]
                for n in (layer.self_norm, layer.cross_norm, layer.ffn_norm)
            ]
            params.append(
                norms[0] + parts[0] + parts[1] + norms[1] + parts[2] + parts[3] + norms[2] + parts[4] + parts[5]
            )
        first = layers[0]
        self._stack = ext.DraftStack(params, first.n_heads, float(first.self_norm.eps))
        self._bf16_of: weakref.ref[CrossKV] | None = None
        self._bf16_copy: tuple[list[Tensor], list[Tensor]] = ([], [])

    @classmethod
    def build(cls, decoder: TextDecoder) -> Int8DraftStack | None:
        """The stack of `decoder`, or None unless every product of every layer runs on the kernel."""
        ext = kernel_extension()
        names = ("qkv", "self_out", "cross_q", "cross_out", "fc1", "fc2")
        if ext is None or not all(isinstance(getattr(layer, n), Int8Linear) for layer in decoder.layers for n in names):
            return None
        return cls(decoder, ext)

    def __call__(self, x: Tensor, positions: list[int], writes: list[int], cache: KVCache, cross: CrossKV) -> Tensor:
        """x [B, D] -> [B, D]; row b sits at positions[b] and writes its keys/values at slot writes[b]."""
        keys, values = self._bf16(cross) if x.shape[0] == 1 else (cross.keys, cross.values)
        return self._stack.step(x, positions, writes, cache.keys, cache.values, keys, values)  # type: ignore[no-any-return]

    def _bf16(self, cross: CrossKV) -> tuple[list[Tensor], list[Tensor]]:
        """bfloat16 copies of one row's audio-frame keys/values, made once per request (the last kept).

        A draft step reads them all from memory (the weights push them out of the cache between
        steps): half the bytes of fp32 saved ~0.3 ms per step at 600 frames. Batches read the fp32
        views instead, which costs no memory. Drafts only: the main model keeps its fp32 keys/values.
        """
        if self._bf16_of is None or self._bf16_of() is not cross:
            self._bf16_copy = (
                [k.to(torch.bfloat16, memory_format=torch.contiguous_format) for k in cross.keys],
                [v.to(torch.bfloat16, memory_format=torch.contiguous_format) for v in cross.values],
            )
            self._bf16_of = weakref.ref(cross)  # not a reference: the request's tensors go when it ends
        return self._bf16_copy


def _or_empty(t: Tensor | None) -> Tensor:
    return torch.empty(0) if t is None else t
