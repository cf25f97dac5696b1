"""Host side of the Triton LM-head backend, no kernel launched: input contract, dispatcher, planning.

The launchers check shapes, dtypes and devices before any launch (they guard memory safety, so they raise
ValueError rather than assert). `meta` tensors stand in for CUDA tensors: they pass the device check,
allocate nothing, and any launch is recorded instead of run (grpo_kernels.testing.aot.record_launches).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

pytest.importorskip("triton")

from grpo_kernels.ops.lm_head import triton as tri  # noqa: E402
from grpo_kernels.testing.aot import record_launches  # noqa: E402

CFG = tri.CONFIGS[("sm90", "16bit")]


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _forward(x, w, b=None, y=None, t=1.0):
    y = meta(x.shape[0], dtype=torch.int64) if y is None else y
    with record_launches(tri) as launches:
        tri.lm_head_forward(x, w, b, y, t, config=CFG)
    return launches


_DEFAULT = object()


def _backward(x, w, b=None, y=None, lse=None, ez=None, g_lp=_DEFAULT, g_h=None, **kw):
    n = x.shape[0]
    y = meta(n, dtype=torch.int64) if y is None else y
    lse = meta(n, dtype=torch.float32) if lse is None else lse
    ez = meta(n, dtype=torch.float32) if ez is None else ez
    g_lp = meta(n, dtype=torch.float32) if g_lp is _DEFAULT else g_lp
    with record_launches(tri) as launches:
        out = tri.lm_head_backward(x, w, b, y, 1.0, lse, ez, g_lp, g_h, config=CFG, **kw)
    return launches, out


BAD_FORWARD = [
    pytest.param(dict(x=meta(8, 64), w=meta(100, 48)), "disagree on H", id="H-mismatch"),
    pytest.param(dict(x=meta(8, 64, 2), w=meta(100, 64)), "hidden must be [N, H]", id="hidden-3d"),
    pytest.param(
        dict(x=meta(8, 64), w=meta(100, 64, dtype=torch.float16)), "weight dtype", id="dtype-mismatch"
    ),
    pytest.param(
        dict(x=meta(8, 64, dtype=torch.int32), w=meta(100, 64, dtype=torch.int32)),
        "fp16/bf16/fp32",
        id="int-hidden",
    ),
    pytest.param(
        dict(x=meta(8, 64), w=meta(100, 64), y=meta(7, dtype=torch.int64)),
        "targets must be [N]",
        id="targets-shape",
    ),
    pytest.param(
        dict(x=meta(8, 64), w=meta(100, 64), y=meta(8, dtype=torch.float32)),
        "int64 or int32",
        id="targets-dtype",
    ),
    pytest.param(dict(x=meta(8, 64), w=meta(100, 64), b=meta(99)), "bias must be [V]", id="bias-shape"),
    pytest.param(dict(x=meta(8, 64), w=meta(100, 64), t=0.0), "temperature", id="temperature-0"),
    pytest.param(dict(x=meta(8, 64), w=meta(100, 64), t=float("nan")), "temperature", id="temperature-nan"),
    pytest.param(
        dict(x=torch.zeros(8, 64), w=torch.zeros(100, 64)), "CUDA device", id="cpu-without-interpreter"
    ),
    pytest.param(
        dict(x=meta(8, 64), w=torch.zeros(100, 64, dtype=torch.bfloat16)),
        "weight is on cpu",
        id="device-mismatch",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD_FORWARD)
def test_lm_head_forward_rejects_bad_input(args, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        _forward(**args)


BAD_BACKWARD = [
    pytest.param(dict(lse=meta(7, dtype=torch.float32)), "lse must be [N]", id="lse-shape"),
    pytest.param(dict(lse=meta(8, dtype=torch.bfloat16)), "lse must be fp32", id="lse-dtype"),
    pytest.param(dict(g_lp=meta(9, dtype=torch.float32)), "grad_logprobs must be [N]", id="grad-shape"),
    pytest.param(dict(g_h=meta(8, dtype=torch.int64)), "grad_entropy must be floating", id="grad-dtype"),
    # fp32, or the weight's own dtype (the in-place schedules' gradient buffer); anything else is refused
    pytest.param(dict(grad_weight_acc=meta(100, 64, dtype=torch.float16)), "grad_weight_acc must be fp32 or",
                 id="acc-dtype"),
    pytest.param(
        dict(grad_weight_acc=meta(100, 63, dtype=torch.float32)),
        "grad_weight_acc must be fp32",
        id="acc-shape",
    ),
    pytest.param(dict(workspace_bytes=0), "workspace_bytes", id="workspace-0"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_BACKWARD)
def test_lm_head_backward_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _backward(meta(8, 64), meta(100, 64), **kwargs)


def test_lm_head_backward_launches_only_what_is_needed():
    x, w, b = meta(300, 64), meta(1000, 64), meta(1000)
    # no upstream gradient: no launch, grad_hidden zero-filled, accumulators untouched
    launches, (gx, gw, gb) = _backward(x, w, b, g_lp=None, g_h=None)
    assert launches == [] and gx is not None and gw is not None and gb is not None
    # nothing requested: no launch, nothing returned
    launches, out = _backward(
        x, w, None, need_grad_hidden=False, need_grad_weight=False, need_grad_bias=False
    )
    assert launches == [] and out == (None, None, None)
    # bias gradient only: the kernel stores no dL/dlogit slab, just the fp32 column sums
    launches, (gx, gw, gb) = _backward(x, w, b, need_grad_hidden=False, need_grad_weight=False)
    assert gx is None and gw is None and gb is not None
    assert [la.args["STORE_DLOGITS"] for la in launches] == [False]
    assert [la.args["STORE_BIAS_GRAD"] for la in launches] == [True]
    assert launches[0].args["dlogits_ptr"] is None
    # both upstream gradients present / one absent select the kernel's code paths
    launches, _ = _backward(x, w, None, g_h=meta(300, dtype=torch.float32))
    assert (launches[0].args["HAS_GRAD_LOGPROBS"], launches[0].args["HAS_GRAD_ENTROPY"]) == (True, True)
    launches, _ = _backward(x, w, None, g_lp=None, g_h=meta(300, dtype=torch.float32))
    assert (launches[0].args["HAS_GRAD_LOGPROBS"], launches[0].args["HAS_GRAD_ENTROPY"]) == (False, True)


def test_lm_head_backward_chunks_tokens_within_the_workspace_budget():
    n, v, h = 1000, 50000, 64
    row_stride = math.ceil(v / tri.WORKSPACE_ROW_ALIGN) * tri.WORKSPACE_ROW_ALIGN
    # README "Workspace": per row, the bf16 dL/dlogit slab and the fp32 grad_hidden chunk; per 128 rows, the
    # fp32 grad_bias column sums. A budget of 2.5 tile-rows holds 2 of them: 256-row chunks.
    per_tile = 128 * (row_stride * 2 + h * 4) + v * 4
    launches, _ = _backward(meta(n, h), meta(v, h), meta(v), workspace_bytes=int(2.5 * per_tile))
    assert [la.args["n_rows"] for la in launches] == [256, 256, 256, 232]
    for la in launches:
        assert la.args["dlogits_ptr"].shape == (256, row_stride)
        assert la.args["bias_grad_part_ptr"].shape == (2, v)
    plan = tri.plan_backward(
        n, v, h, 2, 128, int(2.5 * per_tile), store_dlogits=True, need_bias_grad=True, need_hidden_grad=True
    )
    assert plan.workspace_bytes == 2 * per_tile <= 2.5 * per_tile
    # a budget below one tile row still makes progress, one BLOCK_M-row chunk at a time
    launches, _ = _backward(meta(n, h), meta(v, h), workspace_bytes=1)
    assert [la.args["n_rows"] for la in launches] == [128] * 7 + [104]
    # bias gradient alone: only the column sums count against the budget
    plan = tri.plan_backward(
        65536, v, h, 2, 128, 10 * v * 4, store_dlogits=False, need_bias_grad=True, need_hidden_grad=False
    )
    assert plan.rows_per_chunk == 1280 and plan.workspace_bytes == 10 * v * 4


def test_lm_head_inputs_are_copied_only_when_needed():
    x_wide = meta(8, 80)[:, :64]  # row stride 80, unit inner stride: used in place
    launches = _forward(x_wide, meta(100, 64))
    assert launches[0].args["stride_hidden"] == 80 and launches[0].args["hidden_ptr"].shape == (8, 64)
    w_t = meta(64, 100).T  # [V, H] with unit stride along V: copied to unit stride along H
    launches = _forward(meta(8, 64), w_t)
    assert launches[0].args["weight_ptr"].stride() == (64, 1)


def test_lm_head_runtime_values_are_not_compile_time_constants():
    """Temperature, sizes and strides are kernel arguments; only block sizes and code paths are constexpr."""
    for kernel in (
        tri.lm_head_fwd_kernel_partial,
        tri.lm_head_fwd_kernel_merge,
        tri.lm_head_bwd_kernel_dlogits,
    ):
        constexpr = {p.name for p in kernel.params if p.is_constexpr}
        runtime = {p.name for p in kernel.params if not p.is_constexpr}
        assert all(name.isupper() for name in constexpr), constexpr
        assert not ({"inv_temperature", "n_tokens", "n_rows", "vocab", "hidden_size"} & constexpr)
        assert runtime
    # token counts change every call: no divisibility specialisation on them (no recompiles per N % 16)
    assert "n_tokens" in tri.lm_head_fwd_kernel_partial.do_not_specialize
    assert "n_rows" in tri.lm_head_bwd_kernel_dlogits.do_not_specialize


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        ((9, 0), "sm90"),
        ((10, 0), "sm100"),
        ((10, 3), "sm100"),
        ((8, 0), "sm80"),
        ((8, 6), "sm80"),
        ((8, 9), "sm80"),
        ((12, 0), "sm120"),
        ((12, 1), "sm120"),
    ],
)
def test_lm_head_arch_class(capability, expected):
    assert tri.arch_class(capability) == expected


def test_lm_head_arch_class_rejects_pre_ampere():
    with pytest.raises(RuntimeError, match="sm_80"):
        tri.arch_class((7, 5))


def test_lm_head_pick_config(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert tri.pick_config(cuda, torch.bfloat16).name == "sm90-16bit"
    assert tri.pick_config(cuda, torch.float16).name == "sm90-16bit"
    assert tri.pick_config(cuda, torch.float32).name == "sm90-fp32"
    assert tri.pick_config(cuda, torch.bfloat16, aligned=False).name == "unaligned-16bit"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert tri.pick_config(cuda, torch.bfloat16).name == "sm80-16bit"
    for capability, arch in (((10, 0), "sm100"), ((12, 0), "sm120")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert tri.pick_config(cuda, torch.bfloat16).name == f"{arch}-16bit"
        assert tri.pick_config(cuda, torch.float32).name == f"{arch}-fp32"
        assert tri.pick_config(cuda, torch.bfloat16, aligned=False).name == "unaligned-16bit"
    assert tri.pick_config(torch.device("cpu"), torch.float32).name == "interpreter"


def test_lm_head_is_aligned():
    assert tri.is_aligned(meta(8, 4096), meta(100, 4096))
    assert not tri.is_aligned(meta(8, 4100))  # H % 16 != 0
    assert not tri.is_aligned(meta(8, 72)[:, :64])  # row stride 72
    assert tri.is_aligned(meta(8, 80)[:, :64])


@pytest.mark.parametrize("n_tokens", [1, 37, 1000, 16384, 65536])
@pytest.mark.parametrize("vocab", [1001, 32000, 151936, 256000])
def test_lm_head_plan_forward(n_tokens, vocab):
    t = CFG.forward
    plan = tri.plan_forward(n_tokens, vocab, t.block_m, t.block_n, 132, t.group_m)
    # the splits tile the vocabulary exactly: the last one is non-empty
    assert plan.num_splits * plan.tiles_per_split >= plan.num_vocab_tiles
    assert (plan.num_splits - 1) * plan.tiles_per_split < plan.num_vocab_tiles
    # enough splits that the programs running at once span several of them (L2 reuse of hidden tiles)
    assert plan.num_splits >= min(plan.num_vocab_tiles, math.ceil(132 / t.group_m))
    # near-full waves once there is enough work
    total = plan.num_m_tiles * plan.num_vocab_tiles
    makespan = math.ceil(plan.num_programs / 132) * plan.tiles_per_split
    if total >= 8 * 132:
        assert total / (132 * makespan) > 0.9, plan
    assert plan.num_programs < 2**31
    assert plan.partial_bytes(n_tokens) <= 4 * n_tokens * (3 * plan.num_vocab_tiles + 1)


# ---- which kernel A: the cp.async default and the opt-in TMA one ----------------------------------


def test_forward_kernel_switch(monkeypatch):
    monkeypatch.delenv("GRPO_KERNELS_FORWARD_KERNEL", raising=False)
    assert tri.forward_kernel() == "cp.async"
    monkeypatch.setenv("GRPO_KERNELS_FORWARD_KERNEL", "tma")
    assert tri.forward_kernel() == "tma"
    with tri.use_forward_kernel("cp.async"):  # the block wins over the environment, and is undone
        assert tri.forward_kernel() == "cp.async"
        with tri.use_forward_kernel("tma"):
            assert tri.forward_kernel() == "tma"
        assert tri.forward_kernel() == "cp.async"
    assert tri.forward_kernel() == "tma"
    monkeypatch.setenv("GRPO_KERNELS_FORWARD_KERNEL", "wgmma")
    with pytest.raises(ValueError, match="GRPO_KERNELS_FORWARD_KERNEL must be one of"):
        tri.forward_kernel()
    with pytest.raises(ValueError, match="forward kernel must be one of"):
        with tri.use_forward_kernel("TMA"):
            pass


@pytest.mark.parametrize("softcap", [None, (1 / 30, 30.0)], ids=["plain", "softcap"])
@pytest.mark.parametrize("stored", [False, True], ids=["stats", "stored"])
def test_tma_kernel_a_launch(stored, softcap):
    """The recorded launch: TMA descriptors with the TMA tile's block shapes, the logits descriptor only when
    logits are stored (bounded by [N, V], the buffer's padded row stride), the register cap of two CTAs per
    SM except under the soft-cap."""
    n, h, v = 300, 64, 1001
    logits = meta(n, 1004, dtype=torch.float32)[:, :v] if stored else None
    with tri.use_forward_kernel("tma"), record_launches(tri) as launches:
        tri.lm_head_forward(meta(n, h), meta(v, h), None, meta(n, dtype=torch.int64), 1.0, config=CFG,
                            logits_out=logits, softcap=softcap)  # fmt: skip
    (launch,) = [la for la in launches if la.name.startswith("lm_head_fwd_kernel_partial")]
    assert launch.name == "lm_head_fwd_kernel_partial_tma"
    tile = CFG.forward_tma_stored if stored else CFG.forward_tma
    a = launch.args
    assert a["hidden_desc"].block_shape == [tile.block_m, tile.block_k] and a["hidden_desc"].shape == [n, h]
    assert a["weight_desc"].block_shape == [tile.block_n, tile.block_k] and a["weight_desc"].shape == [v, h]
    if stored:
        assert a["logits_desc"].shape == [n, v] and a["logits_desc"].strides == [1004, 1]
        assert a["logits_desc"].block_shape == [tile.block_m, tile.block_n]
    else:
        assert a["logits_desc"] is None
    assert (launch.num_warps, launch.num_stages) == (tile.num_warps, tile.num_stages)
    assert launch.max_registers == (None if softcap else tile.max_registers)
    assert a["WARP_SPECIALIZE"] is False


def test_tma_kernel_a_falls_back_with_a_warning():
    """A configuration without TMA entries (fp32 operands on sm_90) runs the cp.async kernel and says why."""
    tri._tma_fallbacks_warned.clear()
    x, w = meta(64, 64, dtype=torch.float32), meta(100, 64, dtype=torch.float32)
    with tri.use_forward_kernel("tma"), record_launches(tri) as launches:
        with pytest.warns(tri.TMAFallbackWarning, match="sm90-fp32 tile configuration has no TMA entry"):
            tri.lm_head_forward(x, w, None, meta(64, dtype=torch.int64), 1.0, config=tri.CONFIGS[("sm90", "fp32")])
    assert launches[0].name == "lm_head_fwd_kernel_partial"
