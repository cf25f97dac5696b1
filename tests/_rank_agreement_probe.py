"""The rank-agreement probe (tests/test_distributed_agreement.py): each case makes the ranks of a gloo group
disagree in one way (or agree, as controls) and says what must happen: a clear error, the same on every
rank, naming the cause; or a result equal to a float64 computation on one process.

Module level: spawned processes import it by name. `probe_worker` runs many cases in one process group
(each case in its own `new_group` with a short collective timeout, so a case that hangs raises a timeout
on the waiting rank, is counted as a hang, and the next case starts in step); it returns, per case, this
rank's outcome. The parent classifies the ranks' outcomes (`classify`).
"""

from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist

VOCAB, B, T, H = 37, 3, 5, 16
SWITCH = "GRPO_KERNELS_CHECK_AGREEMENT"
TOL = 2e-5  # fp32 statistics combined over ranks against float64: a few ulp (tests/test_distributed_tp.py)


# -- inputs and the float64 yardstick ------------------------------------------------------------------


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    d = dict(
        hidden=torch.randn(B, T, H, generator=g),
        weight=torch.randn(VOCAB, H, generator=g) / H**0.5 * 3,
        bias=torch.randn(VOCAB, generator=g) * 0.3,
        targets=torch.randint(0, VOCAB, (B, T), generator=g),
        mask=torch.arange(T)[None, :] < torch.tensor([5, 2, 4])[:, None],
        adv=torch.randn(B, generator=g),
    )
    d["old"] = -torch.rand(B, T, generator=g) * 3 - 1
    return d


def blocks(world):
    """Uneven contiguous blocks of the vocabulary: rank r holds rows [start_r, end_r)."""
    cuts = [0] + [round(VOCAB * (r + 1) / world) + (r % 2) * 2 for r in range(world - 1)] + [VOCAB]
    return list(zip(cuts[:-1], cuts[1:]))


def stats64(hidden, weight, bias, targets, valid, temperature=1.0, softcap=None):
    """Float64 log p(target) and entropy of the whole head on one process; 0 where not valid."""
    x = hidden.double() @ weight.double().T + bias.double()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    logp = torch.log_softmax(x / temperature, -1)
    lp = logp.gather(-1, targets.clamp(0, weight.shape[0] - 1).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def worst(got, expected):
    a, b = got.detach().double().reshape(-1), expected.detach().double().reshape(-1)
    if a.numel() == 0:
        return [0.0, 0.0]
    i = int((a - b).abs().nan_to_num(float("inf")).argmax())
    return [a[i].item(), b[i].item()]


# -- cases -----------------------------------------------------------------------------------------
# A case: (kind, expectation, change). kind: which call; expectation: ("error", words the message must
# name) or ("exact",); change(rank, world, d, kw) edits this rank's inputs / keywords in place.

def _last(rank, world):
    return rank == world - 1


def _perturb(name, index, delta):
    def change(rank, world, d, kw):
        if _last(rank, world):
            d[name] = d[name].clone()
            d[name].reshape(-1)[index] += delta
    return change


def _set_kw(name, value):
    def change(rank, world, d, kw):
        if _last(rank, world):
            kw[name] = value
    return change


def _set_kw_everywhere(name, value):
    def change(rank, world, d, kw):
        kw[name] = value
    return change


def _config(**fields):
    def change(rank, world, d, kw):
        if _last(rank, world):
            kw["config"] = kw["config"].replace(**fields)
    return change


def _whole_head(rank, world, d, kw):
    kw["whole_head"] = True


def _empty_block(rank, world, d, kw):
    kw["sizes"] = [0] + [None] * (world - 1)  # rank 0 holds no row; the others share the vocabulary


def _mask_all(rank, world, d, kw):
    d["mask"] = torch.zeros_like(d["mask"])


def _mask_all_on_last(rank, world, d, kw):
    if _last(rank, world):
        d["mask"] = torch.zeros_like(d["mask"])


def _mask_one_token(rank, world, d, kw):
    if _last(rank, world):
        d["mask"] = d["mask"].clone()
        d["mask"][1, 3] = True  # one more token than the other ranks


def _nan_in_own_block(rank, world, d, kw):
    kw["nan_block"] = _last(rank, world)


def _float_targets(rank, world, d, kw):
    if _last(rank, world):
        d["targets"] = d["targets"].float()


def _target_out_of_range(rank, world, d, kw):
    d["targets"] = d["targets"].clone()
    d["targets"][0, 0] = VOCAB + 3  # on every rank: the id is outside the whole vocabulary


def _nothing(rank, world, d, kw):
    pass


def _dp_nan_advantage(rank, world, d, kw):
    if _last(rank, world):
        d["adv"] = d["adv"].clone()
        d["adv"][0] = float("nan")


TP_CASES = {
    # controls: ranks that agree bitwise are never refused, and equal float64
    "agree": ("exact", _nothing),
    "agree_softcap": ("exact", _set_kw_everywhere("softcap_all", 5.0)),
    "agree_check_off": ("exact", _set_kw_everywhere("check_off", True)),
    "check_off_on_one_rank": (("error", "GRPO_KERNELS_CHECK_AGREEMENT"), _set_kw("check_off", True)),
    "empty_block": ("exact", _empty_block),
    "all_masked_every_rank": ("exact", _mask_all),
    # disagreement: the fingerprints in the first collective name what differs
    "hidden_differs": (("error", "hidden"), _perturb("hidden", 17, 1e-3)),
    "targets_differ": (("error", "targets"), _perturb("targets", 4, 1)),
    "temperature_differs": (("error", "temperature"), _set_kw("temperature", 0.7)),
    "softcap_differs": (("error", "softcap"), _set_kw("softcap", 30.0)),
    "logit_scale_differs": (("error", "logit_scale"), _set_kw("logit_scale", 0.5)),
    "mask_differs_by_one_token": (("error", "mask"), _mask_one_token),
    "one_rank_all_masked": (("error", "mask"), _mask_all_on_last),
    "whole_head_on_every_rank": (("error", "same weight block"), _whole_head),
    # a bad input on one rank only: every rank raises that rank's message
    "nan_in_one_rank_block": (("error", "weight", "non-finite", "rank"), _nan_in_own_block),
    "float_targets_on_one_rank": (("error", "targets", "integer", "rank"), _float_targets),
    "target_out_of_range": (("error", "targets", "outside"), _target_out_of_range),
}
LOSS_ONLY_CASES = {
    "config_differs": (("error", "config"), _config(clip_high=0.28)),
    "advantages_differ": (("error", "advantages"), _perturb("adv", 1, 0.5)),
    "old_logprobs_differ": (("error", "old_logprobs"), _perturb("old", 6, 0.1)),
    "num_tokens_differs": (("error", "num_tokens"), _set_kw("num_tokens", 99)),
    "schedule_differs": (("error", "schedule"), _set_kw("schedule", "two_pass")),
    "nan_advantage_on_one_rank": (("error", "advantages", "non-finite", "rank"), _dp_nan_advantage),
}
ENTROPY_CASES = {  # data-parallel ranks (their own sequences) with entropy_group
    "dp_agree": ("exact", _nothing),
    "dp_one_rank_all_masked": ("exact", _mask_all_on_last),
    "dp_config_differs": (("error", "config"), _config(top_entropy_quantile=0.5)),
    "dp_num_tokens_differs": (("error", "num_tokens"), _set_kw("num_tokens", 99)),
    "dp_num_sequences_differs": (("error", "num_sequences"), _set_kw("num_sequences", 12)),
    "dp_size_differs": (("error", "dp_size"), _set_kw("dp_size", 4)),
    "dp_nan_advantage_on_one_rank": (("error", "advantages", "non-finite", "rank"), _dp_nan_advantage),
    "dp_no_quantile_on_one_rank": (("error", "top_entropy_quantile", "rank"), _config(top_entropy_quantile=1.0)),
}


DP_FUSED_ONLY_CASES = {  # refused by the schedule planner, after the checks, on one rank only
    "dp_one_pass_on_one_rank": (("error", "one_pass", "rank"), _set_kw("schedule", "one_pass")),
}


def catalogue():
    """Every case name -> (call, expectation, change)."""
    out = {}
    for call in ("tp_logprobs", "tp_loss"):
        for name, (expect, change) in TP_CASES.items():
            out[f"{call}/{name}"] = (call, expect, change)
    for name, (expect, change) in LOSS_ONLY_CASES.items():
        out[f"tp_loss/{name}"] = ("tp_loss", expect, change)
    for call in ("dp_grpo_loss", "dp_fused_loss"):
        for name, (expect, change) in ENTROPY_CASES.items():
            out[f"{call}/{name}"] = (call, expect, change)
    for name, (expect, change) in DP_FUSED_ONLY_CASES.items():
        out[f"dp_fused_loss/{name}"] = ("dp_fused_loss", expect, change)
    return out


# -- running a case on one rank --------------------------------------------------------------------


def _tp_call(call, rank, world, group, backend, d, kw):
    import grpo_kernels as gk

    sizes = kw.get("sizes")
    if sizes is not None:  # rank 0 empty, the rest split among the others
        rest = blocks(world - 1)
        spans = [(0, 0)] + rest
    else:
        spans = blocks(world)
    start, end = (0, VOCAB) if kw.get("whole_head") else spans[rank]
    weight = d["weight"][start:end].clone()
    if kw.get("nan_block"):
        weight[0, 0] = float("nan")
    weight.requires_grad_()
    bias = d["bias"][start:end]
    hidden = d["hidden"].clone().requires_grad_()
    softcap = kw.get("softcap", kw.get("softcap_all"))
    valid = d["mask"]
    temperature = kw.get("temperature", 0.9)
    # the float64 yardstick, differentiable: its gradients are the ones every rank must return
    hidden64 = d["hidden"].double().requires_grad_()
    weight64 = d["weight"].double().requires_grad_()
    lp64, ent64 = stats64(hidden64, weight64, d["bias"], d["targets"].long(), valid, 0.9, kw.get("softcap_all"))
    if call == "tp_logprobs":
        out = gk.fused_linear_logprobs(hidden, weight, d["targets"], bias, temperature, mask=d["mask"],
                                       softcap=softcap, logit_scale=kw.get("logit_scale", 1.0), backend=backend,
                                       tp_group=group)  # fmt: skip
        noise = torch.linspace(-1.0, 1.0, valid.numel()).reshape(valid.shape)
        (out.logprobs * noise + out.entropy * noise.flip(0)).sum().backward()
        (lp64 * noise + ent64 * noise.flip(0)).sum().backward()
        report = {"logprobs": worst(out.logprobs, lp64), "entropy": worst(out.entropy, ent64)}
    else:
        cfg = kw["config"].replace(temperature=temperature)
        out = gk.fused_linear_grpo_loss(hidden, weight, d["targets"], d["adv"], d["mask"], d["old"], bias=bias,
                                        config=cfg, softcap=softcap, logit_scale=kw.get("logit_scale", 1.0),
                                        backend=backend, schedule=kw.get("schedule", "auto"), tp_group=group,
                                        num_tokens=kw.get("num_tokens"))  # fmt: skip
        out.loss.backward()
        ref = gk.grpo_loss(lp64, d["adv"], d["mask"], d["old"], entropy=ent64, config=kw["config"], backend="torch")
        ref.loss.backward()
        report = {"loss": worst(out.loss, ref.loss), "logprobs": worst(out.logprobs, lp64),
                  "entropy": worst(out.entropy, ent64)}  # fmt: skip
        for key, value in ref.metrics.items():
            report[f"metric/{key}"] = worst(out.metrics[key], value)
    report["grad_hidden"] = worst(hidden.grad, hidden64.grad)
    report["grad_weight_block"] = worst(weight.grad, weight64.grad[start:end])
    return report


def _dp_call(call, rank, world, group, backend, change):
    """Data parallelism with the top-entropy quantile over entropy_group: rank r holds sequences r::world of a
    batch of 2 * B sequences; the ranks' summed losses / world equal one process on the whole batch."""
    import grpo_kernels as gk

    g = torch.Generator().manual_seed(5)
    n_seq = 2 * B
    d = inputs()
    hidden = torch.randn(n_seq, T, H, generator=g) * torch.linspace(0.3, 3.0, n_seq)[:, None, None]
    targets = torch.randint(0, VOCAB, (n_seq, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 2, 4, 3, 5, 1])[:, None]
    adv = torch.randn(n_seq, generator=g)
    old = -torch.rand(n_seq, T, generator=g) * 3 - 1
    mine = list(range(rank, n_seq, world))
    local = dict(mask=mask[mine], adv=adv[mine])
    kw = {"config": gk.PolicyLossConfig.dapo(top_entropy_quantile=0.4, entropy_coef=0.02)}
    change(rank, world, local, kw)
    whole_mask = mask.clone()  # the whole batch as the ranks hold it
    if change is _mask_all_on_last:
        whole_mask[list(range(world - 1, n_seq, world))] = False
    n_tokens = int(whole_mask.sum())
    lp64, ent64 = stats64(hidden, d["weight"], d["bias"], targets, whole_mask)
    common = dict(config=kw["config"], backend=backend, num_tokens=kw.get("num_tokens", n_tokens),
                  num_sequences=kw.get("num_sequences", n_seq), dp_size=kw.get("dp_size", world),
                  entropy_group=group)  # fmt: skip
    if call == "dp_grpo_loss":
        out = gk.grpo_loss(lp64[mine].float(), local["adv"], local["mask"], old[mine], entropy=ent64[mine].float(),
                           **common)  # fmt: skip
    else:
        out = gk.fused_linear_grpo_loss(hidden[mine], d["weight"], targets[mine], local["adv"], local["mask"],
                                        old[mine], bias=d["bias"], schedule=kw.get("schedule", "auto"),
                                        **common)  # fmt: skip
    total = out.loss.detach().clone()
    dist.all_reduce(total, group=group)  # what DDP's gradient average makes of the ranks' losses
    ref = gk.grpo_loss(lp64, adv, whole_mask, old, entropy=ent64, config=kw["config"], backend="torch",
                       num_tokens=n_tokens, num_sequences=n_seq)  # fmt: skip
    return {"loss": worst(total / world, ref.loss)}


def run_case(name, rank, world, group, backend):
    import grpo_kernels as gk

    call, _, change = catalogue()[name]
    if call.startswith("dp_"):
        return _dp_call(call, rank, world, group, backend, change)
    d = inputs()
    kw = {"config": gk.PolicyLossConfig.grpo(kl_coef=0.0, entropy_coef=0.01)}
    change(rank, world, d, kw)
    switch = os.environ.pop(SWITCH, None)
    if kw.get("check_off"):
        os.environ[SWITCH] = "0"
    try:
        return _tp_call(call, rank, world, group, backend, d, kw)
    finally:
        os.environ.pop(SWITCH, None)
        if switch is not None:
            os.environ[SWITCH] = switch


def probe_worker(rank, world, names, backend, collective_timeout):
    """Every case in `names` on this rank, each in its own group (created up front, in the same order on
    every rank) whose collectives time out after `collective_timeout` seconds. Returns {name: outcome}:
    {"result": report} or {"error": type, "message": text, "timeout": bool}."""
    import warnings

    import grpo_kernels.ops.fused.function as fused

    fused.ONE_PASS_CHUNK_TOKENS = 4  # several one-pass chunks: the ranks must plan the same chunks
    warnings.simplefilter("ignore")  # backend-fallback notices
    timeout = datetime.timedelta(seconds=collective_timeout)
    groups = {name: dist.new_group(list(range(world)), timeout=timeout) for name in names}
    # after each case the ranks meet again (a rank stuck in a case's collective until its timeout arrives
    # late): each case starts in step, so one hang does not spill into the next case
    resync = {name: dist.new_group(list(range(world)), timeout=3 * timeout) for name in names}
    out = {}
    for name in names:
        try:
            out[name] = {"result": run_case(name, rank, world, groups[name], backend)}
        except Exception as exc:  # noqa: BLE001 - the outcome is what the probe measures
            text = str(exc)
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()
            out[name] = {"error": type(exc).__name__, "message": text[:3000], "timeout": timed_out}
        dist.barrier(group=resync[name])
    return out


# -- the parent's verdict ------------------------------------------------------------------------


def classify(name, outcomes: list[dict]) -> tuple[str, str]:
    """(verdict, detail): verdict in clear / exact / wrong / hang."""
    _, expect, _ = catalogue()[name]
    if any(o.get("timeout") for o in outcomes):
        return "hang", "; ".join(f"rank {r}: {o.get('message', '')[:200]}" for r, o in enumerate(outcomes))
    errors = [o for o in outcomes if "error" in o]
    if expect == "exact":
        if errors:
            return "wrong", f"refused a valid input: {errors[0]['error']}: {errors[0]['message'][:400]}"
        for r, o in enumerate(outcomes):
            for key, (got, want) in o["result"].items():
                if not (math.isfinite(got) and abs(got - want) <= TOL * (1 + abs(want))):
                    return "wrong", f"rank {r} {key}: got {got!r}, float64 {want!r}"
        return "exact", ""
    words = expect[1:]
    if len(errors) < len(outcomes):
        quiet = [r for r, o in enumerate(outcomes) if "error" not in o]
        return "wrong", f"rank(s) {quiet} returned a result where an error naming {words} was due"
    texts = {o["message"] for o in errors}
    if len(texts) > 1:
        return "wrong", "ranks raised different messages: " + " | ".join(t[:300] for t in texts)
    text = texts.pop()
    missing = [w for w in words if w.lower() not in text.lower()]
    if missing:
        return "wrong", f"the error does not name {missing}: {text[:500]}"
    return "clear", text[:200]


def run_probe(world: int, backend: str, names=None, collective_timeout: float = 10.0, env=None) -> tuple[dict, list]:
    """Every case (or `names`) on one spawned group of `world` ranks: (counts, [(verdict, name, detail)]).
    counts: cases, clear, exact, wrong, hangs. The harness kills the group past a watchdog limit (a hang
    that even the collective timeouts miss fails the run instead of waiting)."""
    from grpo_kernels.testing.distributed import run_group

    names = list(catalogue()) if names is None else list(names)
    # every case at most two collective timeouts, plus start-up: past that the group is killed
    watchdog = 120 + len(names) * 2 * collective_timeout
    results = run_group(probe_worker, world, names, backend, collective_timeout, env=env, timeout=watchdog,
                        collective_timeout=collective_timeout)  # fmt: skip
    rows = [(*classify(name, [r[name] for r in results]), name) for name in names]
    rows = [(verdict, name, detail) for verdict, detail, name in rows]
    counts = {"cases": len(rows)}
    for key, verdict in (("clear", "clear"), ("exact", "exact"), ("wrong", "wrong"), ("hangs", "hang")):
        counts[key] = sum(1 for v, _, _ in rows if v == verdict)
    return counts, rows


def main(argv=None) -> int:
    """python tests/_rank_agreement_probe.py [--world 2] [--backend torch] [--interpret]: print every case's
    verdict and the counts."""
    import argparse
    import os
    import time

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", default="torch", choices=("torch", "triton"))
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    args = parser.parse_args(argv)
    env = {"TRITON_INTERPRET": "1"} if args.backend == "triton" else None
    if env:
        os.environ.update(env)
    start = time.monotonic()
    counts, rows = run_probe(args.world, args.backend, args.cases.split(",") if args.cases else None, env=env)
    for verdict, name, detail in rows:
        print(f"{verdict:5s}  {name}: {detail[:240]}")
    print(f"world={args.world} backend={args.backend}: {counts} in {time.monotonic() - start:.0f} s")
    return 1 if counts["wrong"] or counts["hangs"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
