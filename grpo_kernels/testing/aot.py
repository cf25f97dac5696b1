"""Ahead-of-time compilation of Triton launches for a CUDA target on a machine without a GPU.

Tier 3 of docs/design.md §6. A host launcher runs on `meta` tensors (no memory, any size) while its launches are
recorded instead of executed; each recorded launch is then specialised exactly as Triton's JIT would do
for real tensors (same binder: dtypes, 16-byte alignment, divisibility-by-16 of integer arguments,
`do_not_specialize`) and compiled for sm_90 / sm_80 with the whole toolchain (TTIR -> TTGIR -> LLVM ->
PTX -> cubin). The cuobjdump bundled with the Triton wheel then reports registers, stack and local
memory (spills) per kernel, and the PTX is searched for the instructions a kernel must hold (MMAs,
global stores: a kernel can compile to an empty body).

Usage:
    # module: has a `_launch(kernel, grid, args, num_warps, num_stages)` that every launch goes through
    with record_launches(module) as launches:
        module.some_host_function(meta_tensors...)
    results = [compile_launch(launch, arch=90) for launch in launches]

Triton's on-disk cache and what a compile returns. `triton.compile` looks its result up under a key made of
the kernel's source text and first line number (and its callees'), the signature, constants, options,
Triton's own version and some environment variables, but NOT the path of the file the source came from;
the PTX it returns carries that path in its line information (`.file 1 "/path/to/ops/lm_head/triton.py"`,
and again in the `.debug_info` section). So an entry compiled by another copy of the same kernel (another
checkout, a site-packages install, an older version whose kernel text is unchanged) is reused, and its PTX
names the other path. That is why `ptx_sha256` digests the code only, without `.file` / `.loc` lines and
`.debug_*` sections (`ptx_code`), and why the compile tools and the test session compile into a Triton
cache of their own (`own_triton_cache`, tests/conftest.py): nothing another program left in
~/.triton/cache can change a report or a test's outcome (tests/test_aot_cache.py pre-populates a cache
that way and checks it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import triton


TRITON_CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR")


@contextlib.contextmanager
def own_triton_cache():
    """Within the block, Triton compiles into (and reads from) a fresh temporary cache, removed afterwards;
    child processes inherit it. Triton reads these variables at each compile, so this works after import."""
    saved = {name: os.environ.get(name) for name in TRITON_CACHE_VARIABLES}
    with tempfile.TemporaryDirectory(prefix="grpo_kernels_triton_") as folder:
        for name in TRITON_CACHE_VARIABLES:
            os.environ[name] = os.path.join(folder, name.removeprefix("TRITON_").removesuffix("_DIR").lower())
        try:
            yield folder
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def ptx_code(ptx: str) -> str:
    """The PTX without its debug information: no `.file` / `.loc` lines and no `.section .debug_*` blocks
    (they name the source file's path, which Triton's cache key ignores: see the module docstring)."""
    kept, in_debug_section = [], False
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith(".section") and ".debug_" in stripped:
            in_debug_section = not stripped.endswith("}")  # `.section .debug_macinfo { }` is one line
            continue
        if in_debug_section:
            in_debug_section = stripped != "}"
            continue
        if stripped.startswith((".file", ".loc")):
            continue
        kept.append(line)
    return "\n".join(kept)


@dataclass
class RecordedLaunch:
    kernel: object  # a triton JITFunction
    grid: tuple
    args: dict
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # the launch's maxnreg, if it sets one

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def constexprs(self) -> dict:
        names = {p.name for p in self.kernel.params if p.is_constexpr}
        return {k: v for k, v in self.args.items() if k in names}


@contextlib.contextmanager
def record_launches(module):
    """Within the block, module._launch records its launches (returned list) instead of running them."""
    launches: list[RecordedLaunch] = []
    original = module._launch

    def recorder(kernel, grid, args, num_warps, num_stages, max_registers=None):
        launches.append(RecordedLaunch(kernel, tuple(grid), dict(args), num_warps, num_stages, max_registers))

    module._launch = recorder
    try:
        yield launches
    finally:
        module._launch = original


@dataclass
class CompileResult:
    kernel: str
    arch: int
    num_warps: int
    num_stages: int
    constexprs: dict
    registers: int  # per thread, from cuobjdump
    stack: int  # bytes per thread; > 0 with REG at the cap means spills
    local: int  # bytes per thread of local memory
    static_shared: int  # bytes, from cuobjdump
    shared: int  # bytes of (dynamic) shared memory Triton allocates for the kernel
    mma: str  # tensor-core instruction family found in the PTX: "wgmma", "mma.sync" or "none"
    global_stores: int  # st.global instructions in the PTX: 0 means the kernel writes nothing (compiled to
    # an empty body, as a persistent warp-specialised loop can with triton 3.6 / 3.9)
    tma: bool  # operands or results moved by the tensor memory accelerator (cp.async.bulk.tensor)
    tma_store: bool  # a TMA store (cp.async.bulk.tensor ... global.shared): results leave through TMA
    ptx_sha256: str  # of the PTX's code (ptx_code: without line information, which names the source file's
    # path): two launches that compile to the same code have the same digest, wherever the source lives
    seconds: float
    signature: dict = field(default_factory=dict)
    ttir: str = field(default="", repr=False)  # Triton IR before any lowering (not in as_dict)

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.local > 0

    def ctas_per_sm(self) -> int:
        """Blocks of this kernel one SM holds at once: 64 Ki registers (allocated per warp in units of 256,
        i.e. per thread rounded up to 8) and 228 KiB of shared memory on sm_90 (164 KiB on an A100), each
        block reserving 1 KiB more."""
        sm_registers, sm_shared = 65536, (228 if self.arch >= 90 else 164) * 1024
        per_block_regs = -(-self.registers // 8) * 8 * 32 * self.num_warps
        by_regs = sm_registers // max(per_block_regs, 1)
        by_shared = sm_shared // (self.shared + self.static_shared + 1024)
        return min(by_regs, by_shared)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("ttir")
        d["kernel_name"] = d.pop("kernel")
        d["constexprs"] = {
            k: (v if isinstance(v, (int, float, bool, str)) or v is None else str(v))
            for k, v in self.constexprs.items()
        }
        d["spills"] = self.spills
        d["ctas_per_sm"] = self.ctas_per_sm()
        return d


def _cuobjdump() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


_RESOURCE_RE = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the kernel in `cubin` (`cuobjdump --dump-resource-usage`)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run(
            [str(_cuobjdump()), "--dump-resource-usage", path], check=True, capture_output=True, text=True
        ).stdout
    usage = {k: int(v) for k, v in _RESOURCE_RE.findall(out)}
    missing = {"REG", "STACK", "SHARED", "LOCAL"} - usage.keys()
    if missing:
        raise RuntimeError(f"cuobjdump output lacks {sorted(missing)}:\n{out}")
    return usage


def _specialise(kernel, args: dict, num_warps: int, num_stages: int, target, max_registers: int | None = None):
    """(signature, constexprs, attrs, options) exactly as the JIT derives them from these arguments."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    # the options every _launch passes (enable_fp_fusion: see ops/*/triton.py _launch)
    kwargs = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}
    if max_registers is not None:
        kwargs["maxnreg"] = max_registers
    bound_args, specialization, options = binder(**args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound_args, specialization, options)


def compile_launch(launch: RecordedLaunch, arch: int) -> CompileResult:
    """Compile one recorded launch for sm_<arch>; raises whatever the Triton compiler raises."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    options, signature, constexprs, attrs = _specialise(
        launch.kernel, launch.args, launch.num_warps, launch.num_stages, target, launch.max_registers
    )
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(launch.kernel, signature, constexprs, attrs), target=target, options=options.__dict__
    )
    seconds = time.perf_counter() - start
    usage = resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    return CompileResult(
        kernel=launch.name,
        arch=arch,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        constexprs=launch.constexprs(),
        registers=usage["REG"],
        stack=usage["STACK"],
        local=usage["LOCAL"],
        static_shared=usage["SHARED"],
        shared=int(compiled.metadata.shared),
        mma=mma,
        global_stores=ptx.count("st.global"),
        tma="cp.async.bulk.tensor" in ptx,
        tma_store=any(".global.shared" in line for line in ptx.splitlines() if "cp.async.bulk.tensor" in line),
        ptx_sha256=hashlib.sha256(ptx_code(ptx).encode()).hexdigest(),
        seconds=seconds,
        signature={k: v for k, v in signature.items() if v != "constexpr"},
        ttir=compiled.asm["ttir"],
    )
