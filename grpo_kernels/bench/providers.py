"""Every implementation the suite measures, in one registry: adding a provider is one entry.

A provider maps each op it implements to a setup factory `(inputs, settings) -> Forward`. The
factory does everything that is not part of a training step (building modules, configs, padded
layouts, compiling wrappers); `Forward.fn()` is the step's forward and returns
  logprobs / logprobs_grad: (logprobs [N] fp32, entropy [N] or None)
  fused_grpo / loss_head:   the loss, a 0-d tensor
The runner adds the backward (loss.backward() or the fixed cotangents) for the backward ops, so
speed, memory and the parity gate all run the very same call (Liger's one-setup-factory rule).

Peers are imported only inside their factories; `unavailable()` answers without importing them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import types
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata

import torch

from ..testing.peers import AcceleratorStandIn

from . import oracle
from .ops import BenchInputs
from .timing import synchronize

# The peer versions this suite's adapters were written against (pyproject extras `parity`).
PINS = {"trl": "1.16.0", "verl": "0.9.1", "liger-kernel": "0.8.5", "cut-cross-entropy": "25.1.1"}
TRL_CHUNK_SIZE = 32768  # trl/trainer/utils.py:1506 _CHUNKED_LOGPROB_CHUNK_SIZE (trl 1.16.0)
VERL_TORCH_CHUNK_SIZE = (
    512  # verl FusedLinearForPPO default (verl/utils/experimental/torch_functional.py:221)
)


class ProviderSkip(Exception):
    """The provider cannot run this op at this shape here; the message says why."""


@dataclass
class RunSettings:
    dtype: torch.dtype
    device: torch.device
    warmup: int
    iters: int
    compile_backend: str = "inductor"
    explicit: frozenset = frozenset()  # provider names the user asked for by name
    seed: int = 0
    interleave: bool = False  # time the providers of a shape in turns (runner.run_interleaved)
    # time.time() by which a provider's setup should be done (run_interleaved sets it from the part's deadline):
    # a setup that tries several variants (liger-chunked-tuned) stops trying when the next would pass it
    deadline: float | None = None


@dataclass
class Forward:
    fn: Callable
    impl: str = ""  # which implementation ran, when the provider dispatches (shown in the report)


@dataclass
class Provider:
    name: str
    summary: str
    setups: dict[str, Callable[[BenchInputs, RunSettings], Forward]]
    outputs: tuple[str, ...] = ("logprobs", "entropy")  # per-token outputs of the LM-head ops
    dist: str | None = None  # the pip distribution it comes from (None: torch / grpo_kernels)
    # the modules its setups import: the GPU session's preflight imports them (not just the lazy top-level
    # package), so a missing dependency skips the provider with its reason before any row is attempted
    imports: tuple[str, ...] = ()
    needs_cuda: str | None = None  # why it needs a CUDA device, if it does
    cuda_ops: tuple[str, ...] | None = None  # the ops needs_cuda applies to (None: all)
    extra_check: Callable[[RunSettings], str | None] | None = None
    # timed even when its parity gate fails (the row keeps the failed gate and says so): a baseline whose
    # error is known and is the point of the comparison (TRL's materialised bf16 path), never grpo_kernels
    timed_despite_parity: str | None = None

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(self.setups)

    def version(self) -> str | None:
        return installed_version(self.dist) if self.dist else None

    def unavailable(self, settings: RunSettings, op: str) -> str | None:
        """Why this provider cannot run `op` on this machine at all (None if it can)."""
        if self.dist is not None and self.version() is None:
            pin = f"=={PINS[self.dist]}" if self.dist in PINS else ""
            return f"{self.dist} is not installed (pip install {self.dist}{pin})"
        cuda_op = self.cuda_ops is None or op in self.cuda_ops
        if self.needs_cuda and cuda_op and settings.device.type != "cuda":
            return f"needs a CUDA device: {self.needs_cuda}"
        if self.extra_check is not None:
            return self.extra_check(settings)
        return None

    def version_note(self) -> str | None:
        version = self.version()
        if self.dist is None or version is None or version == PINS.get(self.dist, version):
            return None
        return f"{self.dist} {version} installed; the adapter is written against {PINS[self.dist]}"


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _bt(inp: BenchInputs):
    return inp.shape.batch, inp.shape.seq_len


# ------------------------------------------------------------------------------------------------
# grpo_kernels
# ------------------------------------------------------------------------------------------------
def _resolved_backend(backend: str, device: torch.device) -> str:
    from .._backend import triton_available

    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" and triton_available()[0] else "torch"


def _in_forward_kernel(fn, forward_kernel: str):
    """fn run with kernel A `forward_kernel` (grpo_kernels.ops.lm_head.triton.use_forward_kernel)."""
    if forward_kernel == "cp.async":
        return fn

    def wrapped():
        from ..ops.lm_head import triton as tri

        with tri.use_forward_kernel(forward_kernel):
            return fn()

    return wrapped


def _ours(backend: str, schedule: str = "auto", batch_invariant: bool = False, forward_kernel: str = "cp.async") -> dict:
    import grpo_kernels as gk

    def logprobs(inp, s):
        @functools.partial(_in_forward_kernel, forward_kernel=forward_kernel)
        def fn():
            out = gk.fused_linear_logprobs(inp.hidden, inp.weight, inp.targets, backend=backend,
                                           batch_invariant=batch_invariant)  # fmt: skip
            return out.logprobs, out.entropy

        return Forward(fn, f"backend={backend} -> {_resolved_backend(backend, inp.device)}")

    def fused(inp, s):
        b, t = _bt(inp)

        @functools.partial(_in_forward_kernel, forward_kernel=forward_kernel)
        def fn():
            hidden = inp.hidden.view(b, t, -1)
            targets = inp.targets.view(b, t)
            return gk.fused_linear_grpo_loss(
                hidden, inp.weight, targets, inp.advantages, inp.mask, inp.old_logprobs, inp.ref_logprobs,
                config=inp.config, backend=backend, schedule=schedule, batch_invariant=batch_invariant,
            ).loss  # fmt: skip

        return Forward(fn, f"backend={backend} -> {_resolved_backend(backend, inp.device)}, schedule={schedule}")

    def head(inp, s):
        def fn():
            return gk.grpo_loss(
                inp.logprobs, inp.advantages, inp.mask, inp.old_logprobs, inp.ref_logprobs, config=inp.config,
                backend=backend,
            ).loss  # fmt: skip

        return Forward(fn, f"backend={backend}")

    return {"logprobs": logprobs, "logprobs_grad": logprobs, "fused_grpo": fused, "loss_head": head}


def _ours_csrc(schedule: str = "auto") -> dict:
    """grpo_kernels with csrc/'s CUTLASS kernels (GRPO_KERNELS_CSRC=1 around each call). fused_linear_logprobs:
    log-probs and entropy from kernel A's epilogue partials, no logits written; with grad, Triton's backward.
    fused_linear_grpo_loss at `schedule`: the kernel-A one-pass schedules' forward stores the chunk's fp16 logits
    from the same epilogue (csrc ABI 2); with "one_pass_dz" the backward's two GEMMs are csrc's kernel C, dz
    formed in their operand load from that store (ABI 3), and with "one_pass_dz_inplace" its grad_weight GEMM sums
    into the 16-bit gradient buffer (ABI 4; the first chunk's written over it, ABI 5); the rest is Triton's / cuBLAS's. A library that does
    not load, or a call it does not apply to, is a skipped row with the reason (never Triton's time under
    csrc's name)."""
    import grpo_kernels as gk
    from ..ops.lm_head import cutlass

    def switched(call):
        def fn():
            before = os.environ.get(cutlass.ENV_SWITCH)
            os.environ[cutlass.ENV_SWITCH] = "1"
            try:
                return call()
            finally:
                if before is None:
                    del os.environ[cutlass.ENV_SWITCH]
                else:
                    os.environ[cutlass.ENV_SWITCH] = before

        return fn

    def available(inp):
        if not cutlass.applies(inp.hidden, inp.weight, None):
            raise ProviderSkip("csrc's kernel A does not apply here (sm_90, bf16 / fp16, 16-byte aligned rows)")
        if cutlass.load() is None:
            raise ProviderSkip(f"csrc library: {cutlass.why_not()}")

    def logprobs(inp, s):
        available(inp)

        def call():
            out = gk.fused_linear_logprobs(inp.hidden, inp.weight, inp.targets, backend="triton")
            return out.logprobs, out.entropy

        return Forward(switched(call), f"csrc kernel A ({cutlass.library_path().name}), Triton backward")

    def fused(inp, s):
        available(inp)
        b, t = _bt(inp)

        def call():  # the gradients are computed inside this forward: the switch covers all csrc can run
            return gk.fused_linear_grpo_loss(
                inp.hidden.view(b, t, -1), inp.weight, inp.targets.view(b, t), inp.advantages, inp.mask,
                inp.old_logprobs, inp.ref_logprobs, config=inp.config, backend="triton", schedule=schedule,
            ).loss  # fmt: skip

        backward = "csrc kernel C (dz in the GEMMs' operand load)" if schedule.startswith("one_pass_dz") else (
            "Triton / cuBLAS backward")  # fmt: skip
        return Forward(switched(call), f"csrc kernel A with the fp16 logits store ({cutlass.library_path().name}), "
                                       f"schedule={schedule}, {backward}")  # fmt: skip

    return {"logprobs": logprobs, "logprobs_grad": logprobs, "fused_grpo": fused}


def _tp_group(device: torch.device):
    """(the process group the benchmark runs in, its size, this rank): torchrun's world, or a 1-rank group
    made here on a local file store."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: its world, one GPU per rank
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        else:  # one process: a 1-rank group on a file store (no socket, no port: GPU machines have no network)
            import tempfile

            store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="grpo_kernels_tp_"), "store"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return dist.group.WORLD, dist.get_world_size(), dist.get_rank()


def _ours_tp(check_agreement: bool = True) -> dict:
    """The vocabulary-parallel path: each rank holds its block of the head's rows (tp_group). Under
    torchrun with K ranks the weight gradient's blocks are summed over ranks (a hook), so the parity
    gate sees the whole gradient; on one process it is TP = 1 (the report says so). check_agreement=False:
    the ranks' fingerprints off (GRPO_KERNELS_CHECK_AGREEMENT=0 around each call), to measure their cost."""
    import grpo_kernels as gk
    from .. import _agreement

    def switched(call):
        if check_agreement:
            return call

        def fn():
            before = os.environ.get(_agreement.ENV_SWITCH)
            os.environ[_agreement.ENV_SWITCH] = "0"
            try:
                return call()
            finally:
                if before is None:
                    del os.environ[_agreement.ENV_SWITCH]
                else:
                    os.environ[_agreement.ENV_SWITCH] = before

        return fn

    def setup(inp):
        group, world, rank = _tp_group(inp.device)
        vocab = inp.weight.shape[0]
        base, extra = divmod(vocab, world)
        start = rank * base + min(rank, extra)
        stop = start + base + (1 if rank < extra else 0)
        if world > 1 and not getattr(inp.weight, "_gk_tp_hook", False):
            import torch.distributed as dist

            def all_blocks(grad):  # each rank's gradient is non-zero on its block only
                grad = grad.clone()
                dist.all_reduce(grad, group=group)
                return grad

            inp.weight.register_hook(all_blocks)
            inp.weight._gk_tp_hook = True
        impl = f"tp_group of {world} rank(s)" + (" (TP = 1: one process; torchrun for K > 1)" if world == 1 else "")
        impl += "" if check_agreement else f", {_agreement.ENV_SWITCH}=0"
        return group, slice(start, stop), impl

    def logprobs(inp, s):
        group, block, impl = setup(inp)

        def fn():
            out = gk.fused_linear_logprobs(inp.hidden, inp.weight[block], inp.targets, tp_group=group)
            return out.logprobs, out.entropy

        return Forward(switched(fn), impl)

    def fused(inp, s):
        group, block, impl = setup(inp)
        b, t = _bt(inp)

        def fn():
            return gk.fused_linear_grpo_loss(
                inp.hidden.view(b, t, -1), inp.weight[block], inp.targets.view(b, t), inp.advantages, inp.mask,
                inp.old_logprobs, inp.ref_logprobs, config=inp.config, tp_group=group,
            ).loss  # fmt: skip

        return Forward(switched(fn), impl)

    return {"logprobs": logprobs, "logprobs_grad": logprobs, "fused_grpo": fused}


def _schedule_needs_triton(why: str):
    """A provider check: skipped (with `why` and the device) where 'auto' resolves to the PyTorch backend,
    which always takes two passes whatever the schedule asked."""

    def check(settings: RunSettings) -> str | None:
        if _resolved_backend("auto", settings.device) == "torch":
            return f"{why} ('auto' runs the PyTorch backend on {settings.device.type})"
        return None

    return check


def _needs_several_ranks(settings: RunSettings) -> str | None:
    """A provider check: skipped on one process, where a 1-rank tp_group makes no collective to check in."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return ("the ranks' agreement check runs with K > 1 ranks only (torchrun --nproc_per_node=K); on one "
                "process grpo_kernels-tp is the same call")  # fmt: skip
    return None


def _same_as_auto(settings: RunSettings) -> str | None:
    if _resolved_backend("auto", settings.device) == "torch":
        return (
            f"same code path as grpo_kernels on {settings.device.type} (backend='auto' resolves to 'torch')"
        )
    return None


# ------------------------------------------------------------------------------------------------
# PyTorch eager and torch.compile of the same composition (oracle.eager_lm_head + the fp32 loss head)
# ------------------------------------------------------------------------------------------------
def _eager_fused_loss(hidden, weight, targets, inp: BenchInputs):
    # log-probs only: this loss has no entropy term
    logprobs, _ = oracle.eager_lm_head(hidden, weight, targets, with_entropy=False)
    return oracle.loss_head(logprobs, inp).loss


def _torch_setups(compile_it: bool) -> dict:
    def wrap(fn, s: RunSettings):
        if not compile_it:
            return fn
        import torch._dynamo.config as dynamo_config

        # one static graph per shape: the sweep needs more entries than the default recompile limit
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
        return torch.compile(fn, backend=s.compile_backend, dynamic=False)

    def impl(s):
        return f"torch.compile(backend={s.compile_backend!r})" if compile_it else ""

    def logprobs(inp, s):
        lm_head = wrap(oracle.eager_lm_head, s)
        return Forward(lambda: lm_head(inp.hidden, inp.weight, inp.targets), impl(s))

    def fused(inp, s):
        loss = wrap(functools.partial(_eager_fused_loss, inp=inp), s)
        return Forward(lambda: loss(inp.hidden, inp.weight, inp.targets), impl(s))

    def head(inp, s):
        loss = wrap(lambda lp: oracle.loss_head(lp.view(-1), inp).loss, s)
        return Forward(lambda: loss(inp.logprobs), impl(s))

    return {"logprobs": logprobs, "logprobs_grad": logprobs, "fused_grpo": fused, "loss_head": head}


def _compile_check(settings: RunSettings) -> str | None:
    slow = settings.device.type == "cpu" and settings.compile_backend == "inductor"
    if slow and "torch-compile" not in settings.explicit:
        return (
            "torch.compile on CPU: inductor spends 15-75 s per graph generating C++; "
            "name it in --providers to run it anyway"
        )
    return None


# ------------------------------------------------------------------------------------------------
# TRL 1.16: ChunkedLogProbFunction as add_fused_lm_head calls it, GRPOTrainer._compute_loss unbound
# ------------------------------------------------------------------------------------------------
def _trl_lm_head(hidden, weight, targets, mask):
    """trl/trainer/utils.py:1638-1659 (add_fused_lm_head's fused forward, trl 1.16.0): only the valid
    positions are scored on Triton devices, every position elsewhere; results scattered to `mask`."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction, _use_triton

    compact = _use_triton(hidden.device)
    flat_mask = mask.reshape(-1)
    per_token = ChunkedLogProbFunction.apply(
        hidden[flat_mask] if compact else hidden, weight, None,
        targets[flat_mask] if compact else targets.clamp(min=0), 1.0, TRL_CHUNK_SIZE, None, 1.0,
        ("log_probs", "entropy"),  # what GRPOTrainer installs (grpo_trainer.py:1066-1077)
    )  # fmt: skip
    if compact:
        per_token = [
            None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token
        ]
    else:
        per_token = [None if x is None else x.view(mask.shape).masked_fill(~mask, 0) for x in per_token]
    return per_token[0], per_token[1]


def _trl_loss(inp: BenchInputs, per_token_logps_and_entropies: Callable):
    """GRPOTrainer._compute_loss (trl/trainer/grpo_trainer.py:3020-3292, trl 1.16.0) called unbound on
    a stand-in `self` with exactly the attributes it reads. loss_type "dapo" with num_items_in_batch =
    the valid tokens of this micro-batch (one process, no accumulation): the token mean."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    b, t = _bt(inp)
    cfg = inp.config
    args = types.SimpleNamespace(
        delta=None, use_bias_correction_kl=False, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
        steps_per_generation=1, entropy_target=0.2,
    )  # fmt: skip
    trainer = types.SimpleNamespace(
        args=args, loss_type="dapo", beta=cfg.kl_coef, epsilon_low=cfg.clip_low, epsilon_high=cfg.clip_high,
        importance_sampling_level="token", top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, max_completion_length=t,
        current_gradient_accumulation_steps=1, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        entropy_coef=0.0, use_adaptive_entropy=False, model=types.SimpleNamespace(training=True),
        accelerator=AcceleratorStandIn(), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (*per_token_logps_and_entropies(), None),
    )  # fmt: skip
    ones = torch.ones(b, 1, dtype=torch.long, device=inp.device)
    inputs = {
        "prompt_ids": ones,
        "prompt_mask": ones,
        "completion_ids": torch.zeros(b, t, dtype=torch.long, device=inp.device),
        "completion_mask": inp.mask.long(),
        "advantages": inp.advantages,
        "num_items_in_batch": inp.mask.sum(),
        "old_per_token_logps": inp.old_logprobs,
        "ref_per_token_logps": inp.ref_logprobs,
    }

    def fn():
        trainer._metrics["train"].clear()  # TRL appends one float per metric per call
        return GRPOTrainer._compute_loss(trainer, None, inputs)

    return fn


def _trl_setups() -> dict:
    def logprobs(inp, s):
        mask = torch.ones(inp.shape.tokens, dtype=torch.bool, device=inp.device)
        return Forward(lambda: _trl_lm_head(inp.hidden, inp.weight, inp.targets, mask), _trl_impl(inp.device))

    def fused(inp, s):
        def per_token():
            return _trl_lm_head(inp.hidden, inp.weight, inp.targets, inp.mask)

        return Forward(_trl_loss(inp, per_token), _trl_impl(inp.device))

    def head(inp, s):
        return Forward(_trl_loss(inp, lambda: (inp.logprobs, inp.entropy)), "_compute_loss")

    return {"logprobs": logprobs, "logprobs_grad": logprobs, "fused_grpo": fused, "loss_head": head}


def _trl_materialised_lm_head(hidden, weight, targets, entropy_grad):
    """TRL's path without the fused head (trl 1.16.0): the model's lm_head gives [B, T, V] logits in the input
    dtype (F.linear, as transformers runs it), then trl.trainer.utils.selective_log_softmax_and_entropy
    (utils.py:672-712: a log-softmax per row in the logits' dtype). GRPOTrainer logs the entropy without a
    gradient (entropy_grad=False); the logprobs_grad op differentiates it too (True). On CUDA TRL's Triton loss
    kernel takes the logits instead."""
    from trl.trainer.utils import selective_log_softmax_and_entropy

    logits = torch.nn.functional.linear(hidden, weight)
    return selective_log_softmax_and_entropy(logits, targets, entropy_requires_grad=entropy_grad)


def _trl_materialised_setups() -> dict:
    def logprobs(inp, s):
        def fn():
            lp, ent = _trl_materialised_lm_head(inp.hidden[None], inp.weight, inp.targets[None], True)
            return lp[0], ent[0]

        return Forward(fn, "[B, T, V] logits in the input dtype, selective_log_softmax_and_entropy")

    def fused(inp, s):
        b, t = _bt(inp)

        def per_token():
            return _trl_materialised_lm_head(inp.hidden.view(b, t, -1), inp.weight, inp.targets.view(b, t), False)

        return Forward(_trl_loss(inp, per_token),
                       "[B, T, V] logits in the input dtype, selective_log_softmax_and_entropy")  # fmt: skip

    return {"logprobs": logprobs, "logprobs_grad": logprobs, "fused_grpo": fused}


def _trl_impl(device: torch.device) -> str:
    from trl.kernels.chunked_logprob import _use_triton

    return "cuBLAS tiles + Triton fold" if _use_triton(device) else "torch tiles (no Triton on this device)"


# ------------------------------------------------------------------------------------------------
# Liger 0.8.5
# ------------------------------------------------------------------------------------------------
def _liger_grpo_fn(inp, chunk_size: int = 1, matmul_precision: str | None = None):
    """One call of Liger's LigerFusedLinearGRPOLoss on the op's tensors (compiled on CUDA; `chunk_size`:
    sequences per chunk, Liger's default 1; `matmul_precision`: torch's fp32 matmul precision inside the call)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    cfg = inp.config
    b, t = _bt(inp)
    compiled = inp.device.type == "cuda"
    loss_module = LigerFusedLinearGRPOLoss(
        beta=cfg.kl_coef, compiled=compiled, use_ref_model=True, epsilon_low=cfg.clip_low,
        epsilon_high=cfg.clip_high, loss_type="dapo", temperature=cfg.temperature, chunk_size=chunk_size,
    )  # fmt: skip
    mask = inp.mask.long()
    count = inp.mask.sum()
    precision = _Float32MatmulPrecision(matmul_precision) if matmul_precision else contextlib.nullcontext()

    def fn():
        with precision:
            loss, _ = loss_module(
                inp.hidden.view(b, t, -1), inp.weight, inp.targets.view(b, t), mask, inp.advantages,
                ref_per_token_logps=inp.ref_logprobs, old_per_token_logps=inp.old_logprobs,
                num_items_in_batch=count,
            )  # fmt: skip
        return loss

    return fn


def _liger_chunked(inp, s):
    compiled = inp.device.type == "cuda"
    return Forward(_liger_grpo_fn(inp), f"compiled={compiled}" + ("" if compiled else " (no torch.compile off CUDA)"))


# The sequences per chunk LigerFusedLinearGRPOLoss may take (its `chunk_size`; its default is 1): the tuned
# row tries each that divides the batch and keeps the fastest
LIGER_CHUNK_SIZES = (1, 2, 4, 8)


class _Float32MatmulPrecision:
    """torch.set_float32_matmul_precision for the calls inside (restored after): "high" lets fp32 GEMMs run
    on TF32 tensor cores, what a Liger user who asks for speed sets."""

    def __init__(self, precision: str):
        self.precision = precision

    def __enter__(self):
        self.before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.precision)

    def __exit__(self, *exc):
        torch.set_float32_matmul_precision(self.before)


def _liger_chunked_tuned(inp, s):
    """Liger's chunked GRPO loss as its fastest user would run it: TF32 allowed for its fp32 GEMMs, and the
    chunk size (sequences per chunk) that is fastest here, chosen by one timed call of each candidate after
    one untimed (compiling) call; a candidate that runs out of memory is dropped."""
    b = inp.shape.batch
    compiled = inp.device.type == "cuda"

    def timed(fn) -> float:
        for leaf in inp.leaves:
            leaf.grad = None
        synchronize(inp.device)
        t0 = time.perf_counter()
        fn().backward()
        synchronize(inp.device)
        return (time.perf_counter() - t0) * 1e3

    tried: dict[int, float | str] = {}
    cost = 0.0  # seconds the last candidate took (its compile and two calls): what the next one may take
    for chunk_size in (c for c in LIGER_CHUNK_SIZES if b % c == 0):
        if tried and s.deadline is not None and time.time() + cost > s.deadline:
            tried[chunk_size] = "not tried (the part's time)"
            continue
        fn = _liger_grpo_fn(inp, chunk_size, "high")
        t0 = time.time()
        try:
            timed(fn)  # compiles for this chunk shape
            tried[chunk_size] = timed(fn)
        except torch.cuda.OutOfMemoryError:
            tried[chunk_size] = "out of memory"
            torch.cuda.empty_cache()
        cost = time.time() - t0
    for leaf in inp.leaves:
        leaf.grad = None
    times = {c: ms for c, ms in tried.items() if isinstance(ms, float)}
    if not times:
        raise ProviderSkip(f"every chunk size ran out of memory: {tried}")
    best = min(times, key=times.get)
    shown = ", ".join(f"{c}: {ms:.0f} ms" if isinstance(ms, float) else f"{c}: {ms}" for c, ms in tried.items())
    return Forward(_liger_grpo_fn(inp, best, "high"),
                   f"compiled={compiled}, TF32 allowed, chunk_size={best} (one call each: {shown})")  # fmt: skip


def _liger_triton(inp, s):
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    cfg = inp.config
    b, t = _bt(inp)
    # The kernel reads logits [B, T + 1, V] and drops the last position, as the model emits it.
    last_position = torch.zeros(b, 1, inp.shape.hidden, dtype=inp.dtype, device=inp.device)
    mask = inp.mask.int()
    count = inp.mask.sum()

    def fn():
        hidden = torch.cat([inp.hidden.view(b, t, -1), last_position], dim=1)  # [B, T + 1, H]
        logits = hidden @ inp.weight.t()  # [B, T + 1, V] in the input dtype
        loss, _ = triton_grpo_loss(
            logits, inp.old_logprobs, inp.ref_logprobs, inp.targets.view(b, t), inp.advantages, mask,
            temperature=cfg.temperature, beta=cfg.kl_coef, eps_low=cfg.clip_low, eps_high=cfg.clip_high,
            inplace=True, loss_type="dapo", reduce=True, num_items_in_batch=count,
        )  # fmt: skip
        return loss

    return Forward(fn, "materialised logits + Triton loss kernel (inplace dlogits)")


def _liger_flsce(inp, s):
    from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import _resolve_implementation

    impl = getattr(_resolve_implementation(inp.device), "__name__", "?")

    def fn():
        nll, entropy = LigerFusedLinearScaledCrossEntropyFunction.apply(
            inp.hidden, inp.weight, inp.targets, 1.0, -100, 1, True
        )
        return -nll, entropy

    return Forward(fn, impl)


# ------------------------------------------------------------------------------------------------
# verl 0.9.1
# ------------------------------------------------------------------------------------------------
def _verl_loss(inp: BenchInputs):
    """verl/workers/utils/losses.py:57-144 (ppo_loss, verl 0.9.1) on padded [B, T] tensors: the policy
    loss from the registry, the entropy term, the KL loss; the engine's no-padding -> padded
    conversion is left out (it is layout plumbing, not loss math)."""
    from verl.trainer.ppo import core_algos
    from verl.workers.config.actor import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig

    cfg = inp.config
    b, t = _bt(inp)
    # what ppo_loss writes into global_batch_info for one rank with local counts (losses.py:62-66)
    local_batch_info = {
        "dp_size": 1,
        "batch_num_tokens": None,
        "global_batch_size": None,
        "loss_scale_factor": None,
    }
    actor = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode="token-mean",
        policy_loss=VerlPolicyLossConfig(loss_mode="vanilla"), clip_ratio_low=cfg.clip_low,
        clip_ratio_high=cfg.clip_high, use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=cfg.kl_coef,
        entropy_coeff=0.0, global_batch_info=local_batch_info,
    )  # fmt: skip
    policy_loss_fn = core_algos.get_policy_loss_fn("vanilla")
    advantages = inp.advantages[:, None].expand(b, t).contiguous()  # verl's data holds [B, T] advantages
    mask = inp.mask

    def loss(log_prob, entropy):
        pg_loss, _ = policy_loss_fn(
            old_log_prob=inp.old_logprobs, log_prob=log_prob, advantages=advantages, response_mask=mask,
            loss_agg_mode=actor.loss_agg_mode, config=actor, rollout_is_weights=None,
        )  # fmt: skip
        policy_loss = pg_loss
        if entropy is not None:
            entropy_loss = core_algos.agg_loss(
                loss_mat=entropy, loss_mask=mask, loss_agg_mode=actor.loss_agg_mode, **actor.global_batch_info
            )
            policy_loss -= actor.entropy_coeff * entropy_loss
        kld = core_algos.kl_penalty(
            logprob=log_prob, ref_logprob=inp.ref_logprobs, kl_penalty=actor.kl_loss_type
        )
        kl_loss = core_algos.agg_loss(
            loss_mat=kld, loss_mask=mask, loss_agg_mode=actor.loss_agg_mode, **actor.global_batch_info
        )
        return policy_loss + kl_loss * actor.kl_loss_coef

    return loss


def _verl_lm_head(kind: str, inp: BenchInputs):
    if kind == "triton":
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        if inp.shape.hidden % 128:
            raise ProviderSkip(f"verl's kernel needs H % 128 == 0, H = {inp.shape.hidden}")
        return lambda: linear_cross_entropy(inp.hidden, inp.weight, inp.targets, 1.0, "none")
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    module = FusedLinearForPPO(chunk_size=VERL_TORCH_CHUNK_SIZE, impl_backend="torch")
    return lambda: module(inp.hidden, inp.weight, inp.targets, 1.0)


def _verl_kernel_setups() -> dict:
    """verl's Triton kernel alone, loaded without verl's package where it does not import (verl_kernel.py):
    log-probs and entropy, as verl's actor calls it (reduction="none", temperature 1)."""

    def logprobs(inp, s):
        from . import verl_kernel

        if inp.shape.hidden % 128:
            raise ProviderSkip(f"verl's kernel needs H % 128 == 0, H = {inp.shape.hidden}")
        return Forward(lambda: verl_kernel.linear_cross_entropy(inp.hidden, inp.weight, inp.targets, 1.0, "none"),
                       f"linear_cross_entropy (Triton): {verl_kernel.HOW}")  # fmt: skip

    return {"logprobs": logprobs, "logprobs_grad": logprobs}


def _verl_setups(kind: str) -> dict:
    impl = "linear_cross_entropy (Triton)" if kind == "triton" else "FusedLinearForPPO(impl_backend='torch')"

    def logprobs(inp, s):
        return Forward(_verl_lm_head(kind, inp), impl)

    def fused(inp, s):
        b, t = _bt(inp)
        lm_head, loss = _verl_lm_head(kind, inp), _verl_loss(inp)

        def fn():
            logprobs, entropy = lm_head()
            return loss(logprobs.view(b, t), entropy.view(b, t))

        return Forward(fn, impl)

    setups = {"logprobs": logprobs, "logprobs_grad": logprobs, "fused_grpo": fused}
    if kind == "triton":  # the loss head alone is the same code for both LM heads: listed once
        setups["loss_head"] = lambda inp, s: Forward(
            functools.partial(_verl_loss(inp), inp.logprobs, None),
            "core_algos (vanilla + low_var_kl + agg_loss)",
        )
    return setups


# ------------------------------------------------------------------------------------------------
# cut-cross-entropy
# ------------------------------------------------------------------------------------------------
def _cce(inp, s):
    from cut_cross_entropy import linear_cross_entropy

    def fn():
        nll = linear_cross_entropy(
            inp.hidden, inp.weight, inp.targets, reduction="none"
        )  # -log p, no entropy
        return -nll.float(), None

    return Forward(fn, "impl='cce', filter_eps default (approximate gradient filtering)")


# ------------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------------
@dataclass
class Registry:
    providers: dict[str, Provider] = field(default_factory=dict)

    def add(self, provider: Provider) -> None:
        self.providers[provider.name] = provider

    def for_op(self, op: str) -> list[Provider]:
        return [p for p in self.providers.values() if op in p.setups]


REGISTRY = Registry()
REGISTRY.add(
    Provider(
        "grpo_kernels", "grpo_kernels, backend='auto' (Triton on CUDA, PyTorch elsewhere)", _ours("auto")
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-torch",
        "grpo_kernels, backend='torch' (chunked PyTorch)",
        _ours("torch"),
        extra_check=_same_as_auto,
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-two-pass",
        "grpo_kernels fused loss with schedule='two_pass' (4 GEMM units, no stored logits): the other schedule",
        {"fused_grpo": _ours("auto", "two_pass")["fused_grpo"]},
        extra_check=_schedule_needs_triton("the PyTorch backend always takes two passes"),
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-csrc",
        "grpo_kernels with csrc/'s CUTLASS sm_90a kernel A (GRPO_KERNELS_CSRC=1; opt-in, not in auto): log-probs, and "
        "the fused loss whose one-pass forward stores fp16 logits from the GEMM's epilogue",
        _ours_csrc(),
        needs_cuda="csrc/'s sm_90a library",
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-csrc-one-pass-dz-inplace",
        "grpo_kernels fused loss with schedule='one_pass_dz_inplace' and csrc/ (GRPO_KERNELS_CSRC=1): kernels A and C "
        "as grpo_kernels-csrc-one-pass-dz, grad_weight summed into the gradient buffer in the weight's dtype by kernel "
        "C's epilogue (no fp32 [V, H] accumulator; chunks sized to the 1.5 GiB goal; opt-in)",
        {"fused_grpo": _ours_csrc("one_pass_dz_inplace")["fused_grpo"]},
        needs_cuda="csrc/'s sm_90a library",
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-csrc-one-pass-dz",
        "grpo_kernels fused loss with schedule='one_pass_dz' and csrc/ (GRPO_KERNELS_CSRC=1): kernel A's epilogue "
        "stores fp16 logits, kernel C forms dz from them inside the two backward GEMMs (no dz slab; opt-in)",
        {"fused_grpo": _ours_csrc("one_pass_dz")["fused_grpo"]},
        needs_cuda="csrc/'s sm_90a library",
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-tma",
        "grpo_kernels with the TMA kernel A (use_forward_kernel('tma'): operands and stored logits by TMA, "
        "two CTAs per SM); the default cp.async kernel A is the grpo_kernels row",
        {op: f for op, f in _ours("auto", forward_kernel="tma").items() if op != "loss_head"},
        extra_check=_schedule_needs_triton("the TMA kernel A runs on the Triton backend"),
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-one-pass",
        "grpo_kernels fused loss with schedule='one_pass' (3 GEMM units, stored logits, fp32 [V, H] accumulator)",
        {"fused_grpo": _ours("auto", "one_pass")["fused_grpo"]},
        extra_check=_schedule_needs_triton("the one-pass schedules run on the Triton backend"),
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-one-pass-dz",
        "grpo_kernels fused loss with schedule='one_pass_dz' (dz formed inside the backward GEMMs, no dz slab)",
        {"fused_grpo": _ours("auto", "one_pass_dz")["fused_grpo"]},
        extra_check=_schedule_needs_triton("the one-pass schedules run on the Triton backend"),
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-one-pass-inplace",
        "grpo_kernels fused loss with schedule='one_pass_inplace' (3 GEMM units, kernel A storing fp16 logits, "
        "grad_weight summed in the weight's dtype in the gradient buffer, chunks sized to the memory goal: auto's "
        "pick at the Qwen3-8B head by the time model)",
        {"fused_grpo": _ours("auto", "one_pass_inplace")["fused_grpo"]},
        extra_check=_schedule_needs_triton("the one-pass schedules run on the Triton backend"),
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-one-pass-cublas",
        "grpo_kernels fused loss with schedule='one_pass_cublas' (forward GEMM by cuBLAS into the chunk's fp32 "
        "logits, statistics streamed over them; fp32 [V, H] accumulator)",
        {"fused_grpo": _ours("auto", "one_pass_cublas")["fused_grpo"]},
        extra_check=_schedule_needs_triton("the one-pass schedules run on the Triton backend"),
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-one-pass-cublas-inplace",
        "grpo_kernels fused loss with schedule='one_pass_cublas_inplace' (cuBLAS forward + streamed statistics, "
        "grad_weight summed in place in the weight's dtype: auto's pick at the Qwen3-8B head before kernel A stored "
        "fp16 logits, 1 % behind one_pass_inplace by the time model)",
        {"fused_grpo": _ours("auto", "one_pass_cublas_inplace")["fused_grpo"]},
        extra_check=_schedule_needs_triton("the one-pass schedules run on the Triton backend"),
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-low-memory",
        "grpo_kernels fused loss with schedule='low_memory' (vocabulary-outer backward, no fp32 [V, H] accumulator)",
        {"fused_grpo": _ours("auto", "low_memory")["fused_grpo"]},
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-tp",
        "grpo_kernels vocabulary-parallel (tp_group): each rank 1/K of the head; TP = 1 on one process",
        _ours_tp(),
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-tp-no-check",
        "grpo_kernels-tp with the ranks' agreement fingerprints off (GRPO_KERNELS_CHECK_AGREEMENT=0): the "
        "difference to grpo_kernels-tp is the check's cost (on one process TP = 1: no check either way)",
        _ours_tp(check_agreement=False),
        extra_check=_needs_several_ranks,
    )
)
REGISTRY.add(
    Provider(
        "grpo_kernels-batch-invariant",
        "grpo_kernels with batch_invariant=True (fixed reduction orders: each token's log-prob independent of the batch)",
        {op: f for op, f in _ours("auto", batch_invariant=True).items() if op != "loss_head"},
    )
)
REGISTRY.add(
    Provider(
        "torch-eager",
        "PyTorch eager: [N, V] logits in the input dtype, fp32 log-softmax, fp32 reference loss head",
        _torch_setups(compile_it=False),
    )
)
REGISTRY.add(
    Provider(
        "torch-compile",
        "torch.compile of the torch-eager composition",
        _torch_setups(compile_it=True),
        extra_check=_compile_check,
    )
)
REGISTRY.add(
    Provider(
        "trl",
        "TRL 1.16: ChunkedLogProbFunction (as add_fused_lm_head calls it) + GRPOTrainer._compute_loss",
        _trl_setups(),
        dist="trl",
        imports=("trl.kernels.chunked_logprob", "trl.trainer.grpo_trainer"),
    )
)
REGISTRY.add(
    Provider(
        "trl-materialised",
        "TRL 1.16 without the fused head: lm_head logits [B, T, V] in the input dtype, "
        "selective_log_softmax_and_entropy + GRPOTrainer._compute_loss",
        _trl_materialised_setups(),
        dist="trl",
        timed_despite_parity=("TRL's log-softmax runs in the logits' dtype (bf16: ~10x PyTorch's own error): timed "
                              "anyway, as the baseline the CPU table compares with, its error shown beside"),
    )
)
REGISTRY.add(
    Provider(
        "liger-chunked",
        "Liger 0.8.5 LigerFusedLinearGRPOLoss (chunked, grads in forward)",
        {"fused_grpo": _liger_chunked},
        dist="liger-kernel",
        imports=("liger_kernel.chunked_loss",),
    )
)
REGISTRY.add(
    Provider(
        "liger-chunked-tuned",
        "Liger 0.8.5 LigerFusedLinearGRPOLoss with TF32 allowed and its fastest chunk_size here",
        {"fused_grpo": _liger_chunked_tuned},
        dist="liger-kernel",
        imports=("liger_kernel.chunked_loss",),
    )
)
REGISTRY.add(
    Provider(
        "liger-triton",
        "Liger 0.8.5 triton_grpo_loss on materialised logits",
        {"fused_grpo": _liger_triton},
        dist="liger-kernel",
        imports=("liger_kernel.transformers.grpo_loss",),
        needs_cuda="Triton kernel",
    )
)
REGISTRY.add(
    Provider(
        "liger-flsce",
        "Liger 0.8.5 LigerFusedLinearScaledCrossEntropyFunction: NLL + entropy (CuTe on sm90, else PyTorch)",
        {"logprobs": _liger_flsce, "logprobs_grad": _liger_flsce},
        dist="liger-kernel",
        imports=("liger_kernel.ops.fused_linear_scaled_cross_entropy",),
    )
)
REGISTRY.add(
    Provider(
        "verl",
        "verl 0.9.1 linear_cross_entropy (Triton) + core_algos loss (ppo_loss's lines)",
        _verl_setups("triton"),
        dist="verl",
        imports=("verl.trainer.ppo.core_algos", "verl.utils.kernel.linear_cross_entropy"),
        needs_cuda="Triton kernel (asserts CUDA tensors)",
        cuda_ops=("logprobs", "logprobs_grad", "fused_grpo"),
    )
)
REGISTRY.add(
    Provider(
        "verl-kernel",
        "verl 0.9.1 linear_cross_entropy (Triton) alone: log-probs and entropy, loaded without verl's package "
        "where it does not import",
        _verl_kernel_setups(),
        dist="verl",
        imports=("grpo_kernels.bench.verl_kernel",),
        needs_cuda="Triton kernel (asserts CUDA tensors)",
    )
)
REGISTRY.add(
    Provider(
        "verl-torch",
        "verl 0.9.1 FusedLinearForPPO(impl_backend='torch'), verl's default fused backend, + core_algos loss",
        _verl_setups("torch"),
        dist="verl",
        imports=("verl.trainer.ppo.core_algos", "verl.utils.experimental.torch_functional"),
    )
)
REGISTRY.add(
    Provider(
        "cce",
        "cut-cross-entropy linear_cross_entropy(reduction='none'): log-probs only",
        {"logprobs": _cce, "logprobs_grad": _cce},
        outputs=("logprobs",),
        dist="cut-cross-entropy",
        imports=("cut_cross_entropy",),
        needs_cuda="Triton kernels (Ampere or newer)",
    )
)
