"""Tier 1: fused_linear_grpo_loss (hidden states -> loss, gradients inside the forward) equals the
composition fused_linear_logprobs -> grpo_loss, whose pieces are tested against the references."""

import itertools

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import PolicyLossConfig as C
from grpo_kernels.testing import assert_close

from test_loss_head import CONFIGS


def inputs(b=4, t=7, h=24, v=301, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5 * 3).to(dtype)
    bias_ = (torch.randn(v, generator=g) * 0.3).to(dtype) if bias else None
    targets = torch.randint(0, v, (b, t), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 2, 7][:b])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    targets[~mask] = -100  # padding ids are never read
    with torch.no_grad():
        lp = gk.fused_linear_logprobs(hidden, weight, targets.clamp(min=0), bias_, backend="torch").logprobs
    old = lp + torch.randn(b, t, generator=g) * 0.3
    ref = lp + torch.randn(b, t, generator=g) * 0.2
    rollout = old + torch.randn(b, t, generator=g) * 0.2
    adv = torch.randn(b, generator=g)
    return dict(hidden=hidden, weight=weight, bias=bias_, targets=targets, mask=mask, old=old, ref=ref,
                rollout=rollout, adv=adv)  # fmt: skip


def optional_inputs(cfg, d):
    return dict(
        old_logprobs=d["old"],
        ref_logprobs=d["ref"] if cfg.needs_reference else None,
        rollout_logprobs=d["rollout"] if cfg.uses_rollout_logprobs else None,
    )


def fused_and_composed(cfg, d, **kw):
    leaves = [x.clone().requires_grad_() if x is not None else None for x in (d["hidden"], d["weight"], d["bias"])]
    torch.manual_seed(1)
    out = gk.fused_linear_grpo_loss(leaves[0], leaves[1], d["targets"], d["adv"], d["mask"], bias=leaves[2],
                                    config=cfg, backend="torch", **optional_inputs(cfg, d), **kw)  # fmt: skip
    out.loss.backward()
    ref_leaves = [x.clone().requires_grad_() if x is not None else None for x in (d["hidden"], d["weight"], d["bias"])]
    lp = gk.fused_linear_logprobs(ref_leaves[0], ref_leaves[1], d["targets"], ref_leaves[2], cfg.temperature,
                                  mask=d["mask"], backend="torch")  # fmt: skip
    torch.manual_seed(1)
    ref_out = gk.grpo_loss(lp.logprobs, d["adv"], d["mask"], entropy=lp.entropy, config=cfg, backend="torch",
                           **optional_inputs(cfg, d), **kw)  # fmt: skip
    ref_out.loss.backward()
    return out, leaves, ref_out, ref_leaves


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_equals_composition(name):
    cfg = CONFIGS[name].replace(temperature=0.8)
    if cfg.loss_type == "group_dpo":
        cfg = cfg.replace(group_size=2)  # 4 sequences here: two groups of two
    d = inputs()
    out, leaves, ref_out, ref_leaves = fused_and_composed(cfg, d)
    assert_close("loss", out.loss, ref_out.loss, atol=1e-6, rtol=1e-5)
    for key in ref_out.metrics:
        assert_close(f"metric {key}", out.metrics[key], ref_out.metrics[key], atol=1e-6, rtol=1e-5)
    for label, a, b in zip(("hidden", "weight", "bias"), leaves, ref_leaves):
        scale = b.grad.abs().max().item() + 1e-12
        assert_close(f"grad_{label}", a.grad, b.grad, atol=1e-5 * scale, rtol=1e-4)
    assert bool((leaves[0].grad[~d["mask"]] == 0).all()), "masked rows must get exactly zero gradient"
    assert_close("logprobs", out.logprobs, ref_out.logprobs, atol=1e-6, rtol=1e-6)


def test_fused_packed_layout_equals_padded():
    cfg = C.grpo(entropy_coef=0.01)
    d = inputs()
    out, leaves, _, _ = fused_and_composed(cfg, d)
    m = d["mask"]
    lengths = m.sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    hidden = d["hidden"][m].clone().requires_grad_()
    weight = d["weight"].clone().requires_grad_()
    packed = gk.fused_linear_grpo_loss(
        hidden, weight, d["targets"][m], d["adv"], torch.ones(int(lengths.sum()), dtype=torch.bool),
        d["old"][m], d["ref"][m], bias=d["bias"], config=cfg, cu_seqlens=cu, backend="torch",
    )  # fmt: skip
    packed.loss.backward()
    assert_close("loss", packed.loss, out.loss, atol=1e-6, rtol=1e-5)
    assert_close("grad_hidden", hidden.grad, leaves[0].grad[m], atol=1e-6, rtol=1e-4)
    assert_close("grad_weight", weight.grad, leaves[1].grad, atol=1e-6, rtol=1e-4)


def test_fused_real_vocabulary():
    d = inputs(b=2, t=5, h=16, v=151936, bias=False)
    out, leaves, ref_out, ref_leaves = fused_and_composed(C.dapo(), d)
    assert_close("loss", out.loss, ref_out.loss, atol=1e-6, rtol=1e-5)
    assert_close("grad_weight", leaves[1].grad, ref_leaves[1].grad, atol=1e-7, rtol=1e-4)


def test_no_grad_and_frozen_weight():
    d = inputs()
    with torch.no_grad():
        out = gk.fused_linear_grpo_loss(d["hidden"], d["weight"], d["targets"], d["adv"], d["mask"], d["old"],
                                        config=C.dapo(), backend="torch")  # fmt: skip
    assert not out.loss.requires_grad
    hidden = d["hidden"].clone().requires_grad_()
    out = gk.fused_linear_grpo_loss(hidden, d["weight"], d["targets"], d["adv"], d["mask"], d["old"],
                                    config=C.dapo(), backend="torch")  # fmt: skip
    out.loss.backward()
    assert d["weight"].grad is None and hidden.grad is not None


def test_grad_output_scales_gradients():
    d = inputs()
    w1 = d["weight"].clone().requires_grad_()
    gk.fused_linear_grpo_loss(d["hidden"], w1, d["targets"], d["adv"], d["mask"], d["old"], config=C.dapo(),
                              backend="torch").loss.backward()  # fmt: skip
    w2 = d["weight"].clone().requires_grad_()
    out = gk.fused_linear_grpo_loss(d["hidden"], w2, d["targets"], d["adv"], d["mask"], d["old"], config=C.dapo(),
                                    backend="torch")  # fmt: skip
    (out.loss * 0.25).backward()
    assert_close("0.25 x grad", w2.grad, 0.25 * w1.grad, atol=1e-9, rtol=1e-6)


def test_fused_bad_input():
    d = inputs()
    with pytest.raises(ValueError, match=r"targets has 1 id\(s\) outside \[0, 301\)"):
        t = d["targets"].clone()
        t[0, 0] = 301
        gk.fused_linear_grpo_loss(d["hidden"], d["weight"], t, d["adv"], d["mask"], backend="torch")
    with pytest.raises(ValueError, match="hidden must be"):
        gk.fused_linear_grpo_loss(d["hidden"][..., :5], d["weight"], d["targets"], d["adv"], d["mask"])
    with pytest.raises(ValueError, match="hidden has .* non-finite"):
        h = d["hidden"].clone()
        h[0, 0, 0] = float("inf")
        gk.fused_linear_grpo_loss(h, d["weight"], d["targets"], d["adv"], d["mask"], backend="torch")


def test_schedule_choice_is_logged_and_validated(caplog):
    d = inputs()
    with caplog.at_level("DEBUG", logger="grpo_kernels"):
        gk.fused_linear_grpo_loss(d["hidden"], d["weight"], d["targets"], d["adv"], d["mask"], d["old"],
                                  config=C.dapo(), backend="torch")  # fmt: skip
    assert any("two_pass schedule (the PyTorch backend" in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(ValueError, match="schedule='one_pass' is not valid here: the PyTorch backend"):
        gk.fused_linear_grpo_loss(d["hidden"], d["weight"], d["targets"], d["adv"], d["mask"], d["old"],
                                  config=C.dapo(), backend="torch", schedule="one_pass")  # fmt: skip
    with pytest.raises(ValueError, match="schedule must be one of"):
        gk.fused_linear_grpo_loss(d["hidden"], d["weight"], d["targets"], d["adv"], d["mask"], d["old"],
                                  config=C.dapo(), backend="torch", schedule="fast")  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_extra_memory=-1), "max_extra_memory must be None or a number of bytes"),
        (dict(max_extra_memory=1.5), "max_extra_memory must be None or a number of bytes"),
        (dict(max_extra_memory=True), "max_extra_memory must be None or a number of bytes"),
        (dict(max_extra_memory=2**30, schedule="one_pass"), "schedule='one_pass' does not use it"),
        (dict(batch_invariant=True, schedule="one_pass_cublas_inplace"), "not available with batch_invariant=True"),
    ],
)
def test_max_extra_memory_and_schedule_options_are_validated(kwargs, match):
    d = inputs()
    with pytest.raises(ValueError, match=match):
        gk.fused_linear_grpo_loss(d["hidden"], d["weight"], d["targets"], d["adv"], d["mask"], backend="torch",
                                  **kwargs)  # fmt: skip


def test_finite_checks_hold_no_weight_sized_temporary():
    """The weight is checked by its minimum and maximum (O(1) extra), the hidden states per row; a bad value
    is still found and reported with its count and first position (grpo_kernels/_checks.py)."""
    from grpo_kernels._checks import check_finite
    from grpo_kernels.testing.memory import peak_allocated_bytes

    w = torch.randn(1000, 64)
    _, peak, _ = peak_allocated_bytes(lambda: check_finite("weight", w))
    assert peak < 1024, peak  # two 0-d values and their flags, not 2 x 64000 bools
    w[700, 3] = float("nan")
    w[900, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"weight has 2 non-finite value\(s\) .* first at index \(700, 3\): nan"):
        check_finite("weight", w)
    check_finite("bias", torch.tensor([0.0, float("-inf")]), allow_neg_inf=True)
    with pytest.raises(ValueError, match=r"bias has 1 non-finite"):
        check_finite("bias", torch.tensor([0.0, float("inf")]), allow_neg_inf=True)


def test_plan_chunks_keeps_sequences_whole():
    from grpo_kernels.ops.fused.function import plan_chunks

    cu = torch.tensor([0, 4, 6, 13, 14])  # sequences of 4, 2, 7, 1 tokens
    valid = torch.ones(14, dtype=torch.bool)
    valid[5] = False  # the second sequence has 1 valid token
    assert plan_chunks(cu, valid, 7) == [(0, 2, 0, 6), (2, 3, 6, 13), (3, 4, 13, 14)]
    assert plan_chunks(cu, valid, 6) is None  # the 7-token sequence does not fit


def test_active_autocast_does_not_lower_the_precision():
    """Under an active bf16 autocast the LM-head tiles still accumulate in fp32 (TRL trains under
    autocast): the results equal those without autocast."""
    d = inputs()
    plain = gk.fused_linear_grpo_loss(d["hidden"], d["weight"], d["targets"], d["adv"], d["mask"], d["old"],
                                      config=C.dapo(), backend="torch")  # fmt: skip
    plain_lp = gk.fused_linear_logprobs(d["hidden"], d["weight"], d["targets"].clamp(min=0), backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = gk.fused_linear_grpo_loss(d["hidden"], d["weight"], d["targets"], d["adv"], d["mask"], d["old"],
                                         config=C.dapo(), backend="torch")  # fmt: skip
        auto_lp = gk.fused_linear_logprobs(d["hidden"], d["weight"], d["targets"].clamp(min=0), backend="torch")
    assert_close("loss under autocast", auto.loss, plain.loss, atol=0, rtol=0)
    assert_close("logprobs under autocast", auto_lp.logprobs, plain_lp.logprobs, atol=0, rtol=0)


def test_gradients_are_handed_to_autograd_without_a_copy(monkeypatch):
    """The weight gradient computed in the forward becomes the parameter's .grad itself: autograd would
    clone it (another V x H tensor at the memory peak) if the function still held a reference."""
    from grpo_kernels.ops.fused import function as fused

    made = {}
    forward = fused.FusedLinearGRPOLossFunction.forward

    def recording_forward(ctx, hidden_rows, weight, bias, loss, saved):
        made["weight"] = saved.grad_weight.data_ptr()
        made["hidden"] = saved.grad_hidden.data_ptr()
        return forward(ctx, hidden_rows, weight, bias, loss, saved)

    monkeypatch.setattr(fused.FusedLinearGRPOLossFunction, "forward", staticmethod(recording_forward))
    d = inputs(bias=False)
    w = d["weight"].clone().requires_grad_()
    x = d["hidden"].clone().requires_grad_()
    out = gk.fused_linear_grpo_loss(x, w, d["targets"], d["adv"], d["mask"], d["old"], config=C.dapo(),
                                    backend="torch")  # fmt: skip
    out.loss.backward()
    assert w.grad.data_ptr() == made["weight"], "grad_weight was copied on its way to weight.grad"


def test_second_backward_through_one_call_says_why():
    d = inputs(bias=False)
    w = d["weight"].clone().requires_grad_()
    out = gk.fused_linear_grpo_loss(d["hidden"], w, d["targets"], d["adv"], d["mask"], d["old"], config=C.dapo(),
                                    backend="torch")  # fmt: skip
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice through one call"):
        out.loss.backward()


def test_plan_token_chunks_fills_every_chunk_and_cuts_sequences():
    """Token-local objectives: chunks of at most `chunk_tokens` valid tokens (here 5 + 5 + 3: 3 chunks of 13
    tokens cannot have a smaller largest one), a sequence cut where a chunk ends; each chunk names the
    sequences it holds pieces of."""
    from grpo_kernels.ops.fused.function import plan_token_chunks

    cu = torch.tensor([0, 4, 6, 13, 14])  # sequences of 4, 2 (1 valid), 7, 1 tokens: 13 valid
    valid = torch.ones(14, dtype=torch.bool)
    valid[5] = False
    chunks = plan_token_chunks(cu, valid, 5)
    assert chunks == [(0, 2, 0, 6), (2, 3, 6, 11), (2, 4, 11, 14)]  # sequence 2 is cut at token 11
    assert [int(valid[t0:t1].sum()) for _, _, t0, t1 in chunks] == [5, 5, 3]
    assert plan_token_chunks(cu, valid, 100) == [(0, 4, 0, 14)]
    assert len(plan_token_chunks(cu, valid, 1)) == 13  # one valid token each
    assert plan_token_chunks(cu, torch.zeros(14, dtype=torch.bool), 5) == [(0, 4, 0, 14)]  # all masked


def _greedy_chunk_sizes(counts: list, budget: int) -> list:
    """The planners' former packing, written out: whole sequences in order, a new chunk where the next would
    overflow `budget` (valid tokens per chunk)."""
    sizes, filled = [], 0
    for k, count in enumerate(counts):
        if filled + count > budget and k > 0:
            sizes.append(filled)
            filled = 0
        filled += count
    return sizes + [filled]


def _min_largest_chunk(counts: list, n_chunks: int) -> int:
    """The smallest possible largest chunk over every split of `counts` into at most `n_chunks` consecutive
    runs (dynamic programming: best[k][i] = the answer for the first i sequences in k runs)."""
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (len(counts) + 1) for _ in range(n_chunks + 1)]
    best[0][0] = 0
    for k in range(1, n_chunks + 1):
        for i in range(len(counts) + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(i + 1))
    return best[n_chunks][len(counts)]


def _layout(lengths: list, valid_counts: list):
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)))
    valid = torch.zeros(int(cu[-1]), dtype=torch.bool)
    for start, n in zip(cu[:-1].tolist(), valid_counts):
        valid[start:start + n] = True
    return cu, valid


def test_balanced_chunk_tokens_keeps_the_count_and_evens_the_chunks():
    """Over every total up to 3,000 valid tokens and caps below and above one tile: never above the cap, as
    many chunks as chunks of the cap take, and the chunk the smallest whole 128-token tile multiple that
    covers the total in that many chunks (64 where 128 overflows the cap; exact below 64)."""
    from grpo_kernels.ops.fused.function import balanced_chunk_tokens

    for cap in (1, 5, 12, 63, 64, 100, 128, 200, 640, 1664, 2432):
        for total in range(1, 3001, 7):
            size = balanced_chunk_tokens(total, cap)
            n_chunks = -(-total // cap)
            even = -(-total // n_chunks)
            why = f"total {total}, cap {cap}: {size}"
            assert size <= cap and -(-total // size) == n_chunks, why
            if total <= cap:
                assert size == cap, why
            elif -(-even // 128) * 128 <= cap:
                assert size == -(-even // 128) * 128, why
            elif -(-even // 64) * 64 <= cap:
                assert size == -(-even // 64) * 64, why
            else:
                assert size == even, why


def test_token_chunks_at_the_target_shape_are_even():
    """16 completions of 1,024 tokens (16,384 valid) in chunks of at most 4,608 (one_pass_dz_inplace's at the
    1.5 GiB goal): 4 chunks of 4,096, not 3 x 4,608 + 2,560. Kernel C's grad_hidden GEMM (128 x 256 tiles, H =
    4096: 16 column tiles; 132 SMs on an H100 / H200) then runs 4 x 4 waves of CTAs instead of 3 x 5 + 3."""
    from grpo_kernels.ops.fused.function import plan_token_chunks

    cu, valid = _layout([1024] * 16, [1024] * 16)
    sizes = [int(valid[t0:t1].sum()) for _, _, t0, t1 in plan_token_chunks(cu, valid, 4608)]
    assert sizes == [4096] * 4, sizes

    def waves(chunk_sizes):
        return sum(-(-(-(-n // 128) * 16) // 132) for n in chunk_sizes)

    assert (waves(sizes), waves([4608, 4608, 4608, 2560])) == (16, 18)


@pytest.mark.parametrize("seed", range(6))
def test_chunk_planners_on_random_layouts(seed):
    """Random completion lengths and masks. Whole-sequence chunks: as many as greedy packing takes (the
    fewest), the largest as small as any split into that many runs allows (against a brute-force search),
    every sequence once, in order. Token chunks: as many as chunks of the cap take, every chunk but the
    last of the same size, every token once."""
    from grpo_kernels.ops.fused.function import host_index, plan_chunks, plan_token_chunks

    g = torch.Generator().manual_seed(seed)
    n_seqs = int(torch.randint(1, 24, (), generator=g))
    lengths = torch.randint(1, 40, (n_seqs,), generator=g).tolist()
    counts = [int(torch.randint(0, n + 1, (), generator=g)) for n in lengths]
    cu, valid = _layout(lengths, counts)
    total = sum(counts)
    for cap in sorted({max(counts + [1]), max(counts + [1]) + 3, 50, 97, 400}):
        chunks = plan_chunks(cu, valid, cap)
        sizes = [int(valid[t0:t1].sum()) for _, _, t0, t1 in chunks]
        why = f"seed {seed}, counts {counts}, cap {cap}: chunks {chunks}, sizes {sizes}"
        assert len(chunks) == len(_greedy_chunk_sizes(counts, cap)), why
        assert max(sizes) == _min_largest_chunk(counts, len(chunks)) <= cap, why
        assert [c[0] for c in chunks] == [0] + [c[1] for c in chunks[:-1]] and chunks[-1][1] == n_seqs, why
        assert all(t0 == int(cu[s0]) and t1 == int(cu[s1]) for s0, s1, t0, t1 in chunks), why
        token_chunks = plan_token_chunks(cu, valid, cap, host=host_index(cu, valid))
        sizes = [int(valid[t0:t1].sum()) for _, _, t0, t1 in token_chunks]
        assert len(token_chunks) == max(1, -(-total // cap)) and sum(sizes) == total, (token_chunks, sizes)
        assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0] <= cap, sizes
        assert [c[2] for c in token_chunks] == [0] + [c[3] for c in token_chunks[:-1]], token_chunks
        assert token_chunks[-1][3] == len(valid), token_chunks
    if max(counts) > 0:  # the longest sequence alone overflows a smaller budget
        assert plan_chunks(cu, valid, max(counts) - 1) is None, counts


@pytest.mark.parametrize(
    "cfg,local",
    [(C.grpo(), True), (C.dapo(), True), (C.dr_grpo(), True), (C.cispo(), True), (C.sapo(), True),
     (C.olmo3(), True), (C.gspo(), False), (C.gspo(ratio_level="sequence_token"), False), (C.gmpo(), False),
     (C.tic_grpo(), False), (C(ratio_level="prefix"), False), (C(is_level="sequence"), False),
     (C(off_policy_mask_threshold=0.5), False), (C(top_entropy_quantile=0.2), False)],
)  # fmt: skip
def test_token_local_objectives(cfg, local):
    """Which objectives may cut a sequence across one-pass chunks (the gradient of each token needs
    nothing of the other tokens but the sequence's length)."""
    assert cfg.token_local is local


def test_segment_partials_merge_per_sequence():
    pytest.importorskip("triton")
    from grpo_kernels.ops.loss_head import triton as lh

    parts = torch.zeros(3, lh.NUM_PARTIALS)
    parts[:, lh.P_LOSS_PG] = torch.tensor([1.0, 2.0, 4.0])
    parts[:, lh.P_RATIO_MIN] = torch.tensor([0.75, 0.5, float("inf")])  # the last piece had no valid token
    parts[:, lh.P_RATIO_MAX] = torch.tensor([1.25, 1.5, float("-inf")])
    merged = lh.merge_segment_partials(parts, torch.tensor([0, 0, 2]), 3)  # sequence 1: no piece
    assert merged[:, lh.P_LOSS_PG].tolist() == [3.0, 0.0, 4.0]
    assert merged[:, lh.P_RATIO_MIN].tolist() == [0.5, float("inf"), float("inf")]
    assert merged[:, lh.P_RATIO_MAX].tolist() == [1.5, float("-inf"), float("-inf")]


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "cispo_relative", "entropy_bonus", "top_entropy"])
def test_low_memory_schedule_equals_two_pass(name, monkeypatch):
    """The vocabulary-outer backward (no fp32 [V, H] accumulator) gives the two-pass schedule's loss and
    gradients. Slabs of 128 columns of V = 301 make three, one ragged, and targets in every slab."""
    from grpo_kernels.ops.fused import function as fused

    monkeypatch.setattr(fused, "LOW_MEMORY_SLAB_BYTES", 1)  # the minimum: 128-column slabs
    cfg = CONFIGS[name]
    d = inputs()
    results = {}
    for schedule in ("two_pass", "low_memory"):
        leaves = [x.clone().requires_grad_() for x in (d["hidden"], d["weight"], d["bias"])]
        out = gk.fused_linear_grpo_loss(leaves[0], leaves[1], d["targets"], d["adv"], d["mask"],
                                        bias=leaves[2], config=cfg, backend="torch", schedule=schedule,
                                        **optional_inputs(cfg, d))  # fmt: skip
        out.loss.backward()
        results[schedule] = (out.loss, *[x.grad for x in leaves])
    # fp32 sums over <= 301 columns in another order: a few ulp of the largest element
    for label, a, b in zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), results["low_memory"],
                           results["two_pass"]):  # fmt: skip
        assert_close(label, a, b, atol=4e-6 * max(b.abs().max().item(), 1e-30), rtol=0)


def test_bytes_per_logit_of_the_streaming_passes():
    """ops/fused/cost.py's count of the bytes each pass over the [tokens, V] logits moves per logit (bf16), and
    the time model charging exactly that: at one chunk, each more valid token adds count x V bytes."""
    from grpo_kernels.ops.fused import cost

    names = ("one_pass", "one_pass_inplace", "one_pass_cublas", "one_pass_cublas_inplace", "one_pass_dz",
             "one_pass_dz_inplace", "two_pass")  # fmt: skip
    counts = {s: sum(cost.logit_bytes(s).values()) for s in names}
    # cuBLAS writes fp32 logits (4), the statistics pass reads them (4), the dz pass reads them (4) and writes the
    # bf16 dz slab (2) that the two GEMMs read (2 + 2); kernel A has no statistics pass and stores fp16 z - m with
    # an fp32 offset per 64 logits (2 + 4/64 per pass over them); two_pass keeps no logits
    assert counts == {"one_pass": 10.125, "one_pass_inplace": 10.125, "one_pass_cublas": 18,
                      "one_pass_cublas_inplace": 18, "one_pass_dz": 6.1875, "one_pass_dz_inplace": 6.1875,
                      "two_pass": 6}, counts  # fmt: skip
    # fp32 inputs: kernel A keeps fp32 logits (4 per pass), the dz slab is fp32 (4 per pass)
    counts32 = {s: sum(cost.logit_bytes(s, 4).values()) for s in names}
    assert counts32 == {"one_pass": 20, "one_pass_inplace": 20, "one_pass_cublas": 24, "one_pass_cublas_inplace": 24,
                        "one_pass_dz": 12, "one_pass_dz_inplace": 12, "two_pass": 12}, counts32  # fmt: skip
    assert sum(cost.logit_bytes("one_pass_cublas", transform_writes=True).values()) == 22  # z written back
    h, v = 64, 1000
    for schedule in ("one_pass", "one_pass_inplace", "one_pass_cublas", "one_pass_cublas_inplace"):
        one, two = (cost.schedule_time(schedule, n, h, v, 2, chunk_rows=4096).bytes_moved for n in (100, 101))
        assert two - one == counts[schedule] * v, (schedule, two - one)
