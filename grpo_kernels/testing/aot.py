"""Ahead-of-time compilation of Triton launches for a CUDA target on a machine without a GPU.

Tier 3 of docs/design.md §6. A host launcher runs on `meta` tensors (no memory, any size) while its launches are
recorded instead of executed; each recorded launch is then specialised exactly as Triton's JIT would do
for real tensors (same binder: dtypes, 16-byte alignment, divisibility-by-16 of integer arguments,
`do_not_specialize`) and compiled for every architecture of TARGETS (sm_90, sm_80, sm_100a, sm_120) with
the whole toolchain (TTIR -> TTGIR -> LLVM -> PTX -> cubin). The cuobjdump bundled with the Triton wheel
then reports registers, stack and local memory (spills) per kernel, and the PTX is searched for the
instructions a kernel must hold (MMAs, global stores: a kernel can compile to an empty body).

TARGETS is the one list of architectures: the compile matrices (lm_head_compile.py, loss_head_compile.py)
iterate over ARCHS, so a kernel added to a matrix is compiled for each of them.

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
import functools
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


_SCOPE_LABEL_RE = re.compile(r"^\s*(\$L__tmp\d+):\s*$")


def ptx_code(ptx: str) -> str:
    """The PTX without its debug information: no `.file` / `.loc` lines and no `.section .debug_*` blocks
    (they name the source file's path, which Triton's cache key ignores: see the module docstring), and no
    `$L__tmpN:` label that only the debug sections refer to (LLVM marks the scope of each inlined call with
    one: moving a `@triton.jit` helper into another function or file adds or renumbers them, the code
    unchanged). A label the code itself branches to is kept."""
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
    labels = {m.group(1) for m in map(_SCOPE_LABEL_RE.match, kept) if m}
    if labels:
        used = {name for line in kept if not _SCOPE_LABEL_RE.match(line) for name in re.findall(r"\$L__tmp\d+", line)}
        kept = [line for line in kept if not ((m := _SCOPE_LABEL_RE.match(line)) and m.group(1) not in used)]
    return "\n".join(kept)


@dataclass(frozen=True)
class Target:
    """One CUDA architecture the compile tier targets, with the limits its checks use (CUDA C++
    Programming Guide, "Technical Specifications per Compute Capability")."""

    arch: int  # compute capability x 10, as triton's GPUTarget takes it
    parts: str  # the GPUs it stands for
    mma: str  # the tensor-core instruction family Triton emits for tl.dot there (CompileResult.mma)
    sm_shared_kib: int  # shared memory per SM
    block_shared_kib: int  # the most one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    tensor_memory_columns: int = 0  # tcgen05 tensor memory per SM (128 lanes x 32-bit columns); 0 = none
    # the first Triton that targets it (and whose bundled ptxas assembles it), None = every supported one
    min_triton: tuple[int, int] | None = None
    min_ptxas: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        """The ptxas architecture name Triton compiles for (the "a" suffix from sm_90 on)."""
        return f"sm_{self.arch}{'a' if self.arch >= 90 else ''}"


# Order: the report's (sm_90 and sm_80 first, as before Blackwell was added).
TARGETS: dict[int, Target] = {
    t.arch: t
    for t in (
        Target(90, "H100 / H200 / GH200", "wgmma", sm_shared_kib=228, block_shared_kib=227),
        Target(80, "A100", "mma.sync", sm_shared_kib=164, block_shared_kib=163),
        # data-centre Blackwell: the accumulator lives in tensor memory, tcgen05.mma issued by one thread
        Target(100, "B200 / GB200", "tcgen05.mma", sm_shared_kib=228, block_shared_kib=227,
               tensor_memory_columns=512, min_triton=(3, 3), min_ptxas=(12, 8)),
        # consumer / workstation Blackwell (RTX 50xx, RTX PRO 6000): no wgmma, no tcgen05, no tensor memory;
        # Triton lowers tl.dot to the sm_80-style warp-level mma.sync (m16n8k16), checked by the compile tier
        Target(120, "RTX 50xx / RTX PRO 6000 Blackwell", "mma.sync", sm_shared_kib=100, block_shared_kib=99,
               min_triton=(3, 3), min_ptxas=(12, 8)),
    )
}  # fmt: skip
ARCHS: tuple[int, ...] = tuple(TARGETS)


def _version_tuple(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def _ptxas_release(arch: int) -> tuple[str, tuple[int, int]] | None:
    """(path, CUDA release) of the ptxas Triton runs for sm_<arch>; None where this Triton cannot say."""
    try:
        from triton.backends.nvidia import compiler as nvidia

        path = nvidia.get_ptxas(arch).path if hasattr(nvidia, "get_ptxas") else nvidia._path_to_binary("ptxas")[0]
        out = subprocess.run([path, "--version"], check=True, capture_output=True, text=True).stdout
    except Exception:
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return (path, _version_tuple(m.group(1))) if m else None


def target_blocker(arch: int, triton_version: str | None = None, ptxas: tuple[str, tuple[int, int]] | None = None,
                   ) -> str | None:  # fmt: skip
    """Why this Triton cannot compile for sm_<arch> (a skip reason naming the version), or None when it can.
    Defaults: the installed triton and the ptxas it runs for that architecture."""
    target = TARGETS[arch]
    triton_version = triton_version or triton.__version__
    if target.min_triton and _version_tuple(triton_version) < target.min_triton:
        first = ".".join(map(str, target.min_triton))
        return f"triton {triton_version} cannot target {target.name} ({target.parts}): that starts with triton {first}"
    if target.min_ptxas:
        ptxas = ptxas or _ptxas_release(arch)
        if ptxas is None:
            return f"triton {triton_version}: cannot find the version of the ptxas it runs for {target.name}"
        path, release = ptxas
        if release < target.min_ptxas:
            return (f"triton {triton_version}'s ptxas ({path}, CUDA {release[0]}.{release[1]}) cannot assemble "
                    f"{target.name}: that needs CUDA {target.min_ptxas[0]}.{target.min_ptxas[1]}")  # fmt: skip
    return None


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
    stack: int  # bytes per thread of stack frame (spilled registers live there)
    local: int  # bytes per thread of local memory
    static_shared: int  # bytes, from cuobjdump
    shared: int  # bytes of (dynamic) shared memory Triton allocates for the kernel
    mma: str  # tensor-core instruction family found in the PTX: "tcgen05.mma", "wgmma", "mma.sync" or "none"
    global_stores: int  # st.global instructions in the PTX: 0 means the kernel writes nothing (compiled to
    # an empty body, as a persistent warp-specialised loop can with triton 3.6 / 3.9)
    tma: bool  # operands or results moved by the tensor memory accelerator (cp.async.bulk.tensor)
    tma_store: bool  # a TMA store (cp.async.bulk.tensor ... global.shared): results leave through TMA
    ptx_sha256: str  # of the PTX's code (ptx_code: without line information, which names the source file's
    # path): two launches that compile to the same code have the same digest, wherever the source lives
    seconds: float
    # the distinct MMA opcodes in the PTX, e.g. "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" or
    # "tcgen05.mma.cta_group::1.kind::f16": which operand types and shapes the tensor cores see
    mma_instructions: list = field(default_factory=list)
    tensor_memory_columns: int = 0  # tcgen05.alloc'd tensor-memory columns (sm_100a), 0 where none
    local_memory_ops: int = 0  # STL / LDL instructions in the SASS (local_memory_instructions)
    signature: dict = field(default_factory=dict)
    ttir: str = field(default="", repr=False)  # Triton IR before any lowering (not in as_dict)

    @property
    def spills(self) -> bool:
        """Registers spilled to local memory: the SASS loads or stores local memory. (STACK alone is not
        enough: a frame ptxas reserves but never touches costs nothing.)"""
        return self.local_memory_ops > 0

    @property
    def shared_fits(self) -> bool:
        """The block's dynamic shared memory is within its architecture's per-block limit (what Triton's
        launcher checks before it raises OutOfResources: shared memory)."""
        return self.shared <= TARGETS[self.arch].block_shared_kib * 1024

    def ctas_per_sm(self) -> int:
        """Blocks of this kernel one SM holds at once: 64 Ki registers (allocated per warp in units of 256,
        i.e. per thread rounded up to 8), the architecture's shared memory per SM (TARGETS: 228 KiB on
        sm_90 / sm_100, 164 KiB on an A100, 100 KiB on sm_120), each block reserving 1 KiB more, and on
        sm_100a its 512 tensor-memory columns."""
        target = TARGETS[self.arch]
        per_block_regs = -(-self.registers // 8) * 8 * 32 * self.num_warps
        by_regs = 65536 // max(per_block_regs, 1)
        by_shared = target.sm_shared_kib * 1024 // (self.shared + self.static_shared + 1024)
        by_tmem = target.tensor_memory_columns // self.tensor_memory_columns if self.tensor_memory_columns else by_regs
        return min(by_regs, by_shared, by_tmem)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("ttir")
        d["kernel_name"] = d.pop("kernel")
        d["constexprs"] = {
            k: (v if isinstance(v, (int, float, bool, str)) or v is None else str(v))
            for k, v in self.constexprs.items()
        }
        d["spills"] = self.spills
        d["shared_fits"] = self.shared_fits
        d["ctas_per_sm"] = self.ctas_per_sm()
        return d


def _cuobjdump() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


_RESOURCE_RE = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")
# MMA opcodes, most specific family first (an sm_100a kernel may keep an mma.sync for a small dot)
_MMA_FAMILIES = ("tcgen05.mma", "wgmma.mma_async", "mma.sync")
_MMA_OPCODE_RE = re.compile(r"^\s*(?:@!?%\w+\s+)?((?:tcgen05\.mma|wgmma\.mma_async|mma\.sync)[\w:.]*)", re.M)
_TMEM_ALLOC_RE = re.compile(r"tcgen05\.alloc\.[\w:.]+\s+\[[^\]]+\],\s*(\d+);")


def mma_family(ptx: str) -> str:
    """The tensor-core instruction family of a kernel's PTX: "tcgen05.mma", "wgmma", "mma.sync" or "none"."""
    for family in _MMA_FAMILIES:
        if family in ptx:
            return "wgmma" if family == "wgmma.mma_async" else family
    return "none"


def mma_instructions(ptx: str) -> list[str]:
    """The distinct MMA opcodes (with their shape / type qualifiers) in a kernel's PTX."""
    return sorted(set(_MMA_OPCODE_RE.findall(ptx)))


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


_LOCAL_MEMORY_OP_RE = re.compile(r"\b(?:STL|LDL)(?:\.\w+)*\s")


def local_memory_instructions(cubin: bytes) -> int:
    """Local-memory loads and stores (SASS STL / LDL) in the kernel of `cubin`: register spills (or a local
    array) that cost memory traffic. A STACK > 0 with none of them is a frame ptxas reserved and never
    touches (triton 3.9 leaves a dead 2-byte local in some sm_120 kernels)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([str(_cuobjdump()), "-sass", path], check=True, capture_output=True, text=True).stdout
    return len(_LOCAL_MEMORY_OP_RE.findall(sass))


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
    """Compile one recorded launch for sm_<arch> (an architecture of TARGETS); raises whatever the Triton
    compiler raises."""
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
        mma=mma_family(ptx),
        global_stores=ptx.count("st.global"),
        tma="cp.async.bulk.tensor" in ptx,
        tma_store=any(".global.shared" in line for line in ptx.splitlines() if "cp.async.bulk.tensor" in line),
        ptx_sha256=hashlib.sha256(ptx_code(ptx).encode()).hexdigest(),
        seconds=seconds,
        mma_instructions=mma_instructions(ptx),
        tensor_memory_columns=sum(int(c) for c in _TMEM_ALLOC_RE.findall(ptx)),
        local_memory_ops=local_memory_instructions(compiled.asm["cubin"]),
        signature={k: v for k, v in signature.items() if v != "constexpr"},
        ttir=compiled.asm["ttir"],
    )


_MMA_QUALIFIER_RE = re.compile(r"\.(m\d+n\d+k\d+|kind::\w+)")


def mma_cell(row: dict) -> str:
    """A report row's MMA: the family with the shapes / kinds of its instructions ("mma.sync m16n8k16",
    "tcgen05.mma kind::f16", "wgmma m64n256k16"); "none" where the kernel has no tensor-core instruction."""
    qualifiers = sorted({q for i in row.get("mma_instructions", []) for q in _MMA_QUALIFIER_RE.findall(i)})
    return " ".join([row["mma"], *qualifiers])


def targets_sentence() -> str:
    """The targets and the limits the compile tier checks against, for a report's header."""
    parts = []
    for t in TARGETS.values():
        limits = f"{t.block_shared_kib} KiB shared memory per block, {t.sm_shared_kib} per SM"
        if t.tensor_memory_columns:
            limits += f", {t.tensor_memory_columns} tensor-memory columns per SM"
        parts.append(f"sm_{t.arch} = {t.name} ({t.parts}; {t.mma}; {limits})")
    return "Targets: " + "; ".join(parts) + "."


def skip_or_error_cells(row: dict) -> str:
    """The message of a row that did not compile: "SKIPPED: why" (this Triton cannot target the
    architecture) or "ERROR: what the compiler raised"."""
    if "skipped" in row:
        return f"SKIPPED: {row['skipped'][:160]}".replace("|", "/")
    return f"ERROR: {row['error'][:120]}".replace("|", "/")
