"""Workers of the multi-process tests (module level: spawned processes import them by name).

Each worker builds the same inputs on every rank, runs grpo_kernels with the process group, runs the
single-process call on the whole weight / whole batch itself, and returns the worst differences as
[got, expected, index, scale] (the parent asserts, so a failure names the worst element and the rank).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def worst(a, b):
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    if a.numel() == 0:
        return [0.0, 0.0, -1, 0.0]
    diff = (a - b).abs()
    i = int(diff.argmax())
    return [a[i].item(), b[i].item(), i, b.abs().max().item()]


def lm_inputs(vocab, seed=0, b=5, t=7, h=24):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g)
    weight = torch.randn(vocab, h, generator=g) / h**0.5 * 3
    bias = torch.randn(vocab, generator=g) * 0.3
    targets = torch.randint(0, vocab, (b, t), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6][:b])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g)
    noise = torch.randn(3, b, t, generator=g)
    return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, mask=mask, adv=adv, noise=noise)


def _configs():
    from grpo_kernels import PolicyLossConfig as C

    return {
        "grpo_kl": C.grpo(),
        "grpo_kl_entropy_bonus": C.grpo(entropy_coef=0.01),
        "dapo": C.dapo(),
        "gspo": C.gspo(),
        "cispo": C.cispo(),
    }


def tp_worker(rank, world, sizes, backend, schedules):
    """Vocabulary-parallel log-probs, entropy and fused losses against the whole head on one process."""
    import grpo_kernels as gk
    import grpo_kernels.ops.fused.function as fused

    fused.ONE_PASS_CHUNK_TOKENS = 7  # several one-pass chunks, sequences cut for token-local objectives
    group = dist.group.WORLD
    d = lm_inputs(sum(sizes))
    start, end = sum(sizes[:rank]), sum(sizes[: rank + 1])
    out = {}

    def leaves(full):
        x = d["hidden"].clone().requires_grad_()
        w = (d["weight"] if full else d["weight"][start:end]).clone().requires_grad_()
        bb = (d["bias"] if full else d["bias"][start:end]).clone().requires_grad_()
        return x, w, bb

    # log-probs + entropy, forward and every gradient
    results = {}
    for full in (True, False):
        x, w, bb = leaves(full)
        lp = gk.fused_linear_logprobs(x, w, d["targets"], bb, 0.8, mask=d["mask"], backend=backend,
                                      tp_group=None if full else group)  # fmt: skip
        ((lp.logprobs * d["noise"][0]).sum() + (lp.entropy * d["noise"][1]).sum()).backward()
        results[full] = (lp.logprobs, lp.entropy, x.grad, w.grad if full else w.grad, bb.grad)
    ref, got = results[True], results[False]
    out["logprobs/logprobs"] = worst(got[0], ref[0])
    out["logprobs/entropy"] = worst(got[1], ref[1])
    out["logprobs/grad_hidden"] = worst(got[2], ref[2])
    out["logprobs/grad_weight"] = worst(got[3], ref[3][start:end])
    out["logprobs/grad_bias"] = worst(got[4], ref[4][start:end])

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        base = gk.fused_linear_logprobs(d["hidden"], d["weight"], d["targets"], d["bias"], mask=d["mask"],
                                        backend="torch").logprobs  # fmt: skip
    old = base + 0.3 * torch.randn(base.shape, generator=g)
    ref_lp = base + 0.2 * torch.randn(base.shape, generator=g)
    # (layout, schedule) pairs: every layout and every schedule, not every combination (CI time)
    pairs = [("padded", schedules[0]), ("packed", schedules[-1])]
    for name, cfg in _configs().items():
        for layout, schedule in pairs:
            runs = {}
            for full in (True, False):
                x, w, bb = leaves(full)
                hidden, targets, mask, o, r = x, d["targets"], d["mask"], old, ref_lp
                extra = {}
                if layout == "packed":
                    lengths = d["mask"].sum(-1)
                    extra["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
                    hidden, targets, o, r = (z[d["mask"]] for z in (x, targets, old, ref_lp))
                    mask = torch.ones(int(lengths.sum()), dtype=torch.bool)
                res = gk.fused_linear_grpo_loss(
                    hidden, w, targets, d["adv"], mask, o, r if cfg.kl_coef > 0 else None, bias=bb,
                    config=cfg.replace(temperature=0.9), backend=backend, schedule=schedule,
                    tp_group=None if full else group, **extra,
                )  # fmt: skip
                res.loss.backward()
                runs[full] = (res, x.grad, w.grad, bb.grad)
            (rr, rx, rw, rb), (gr, gx, gw, gb) = runs[True], runs[False]
            key = f"{name}/{layout}/{schedule}"
            out[f"{key}/loss"] = worst(gr.loss, rr.loss)
            out[f"{key}/logprobs"] = worst(gr.logprobs, rr.logprobs)
            out[f"{key}/entropy"] = worst(gr.entropy, rr.entropy)
            out[f"{key}/grad_hidden"] = worst(gx, rx)
            out[f"{key}/grad_weight"] = worst(gw, rw[start:end])
            out[f"{key}/grad_bias"] = worst(gb, rb[start:end])
            for m, v in rr.metrics.items():
                out[f"{key}/metric/{m}"] = worst(gr.metrics[m], v)
    return out


def one_rank_group_worker(rank, world, backend):
    """A process group of one rank behaves exactly as tp_group=None."""
    import grpo_kernels as gk

    d = lm_inputs(203)
    a = gk.fused_linear_logprobs(d["hidden"], d["weight"], d["targets"], d["bias"], backend=backend)
    b = gk.fused_linear_logprobs(d["hidden"], d["weight"], d["targets"], d["bias"], backend=backend,
                                 tp_group=dist.group.WORLD)  # fmt: skip
    return bool(torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropy, b.entropy))


def ddp_worker(rank, world, with_normalizers):
    """Data parallelism: each rank holds its share of the sequences; gradients averaged over ranks (what
    DDP does) against one process on the whole batch."""
    import grpo_kernels as gk
    from grpo_kernels import PolicyLossConfig as C

    d = lm_inputs(203, b=5)
    mine = list(range(rank, 5, world))  # sequences of this rank: uneven token counts on purpose
    out = {}
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(5, 7, generator=g) * 4
    for name, cfg in {"token-mean": C.dapo(), "token-sum": C(loss_agg_mode="token-sum"),
                      "seq-mean-token-mean": C.grpo(kl_coef=0.0)}.items():  # fmt: skip
        w_full = d["weight"].clone().requires_grad_()
        # the whole batch on this one process: its own counts ARE the batch's (said explicitly, no warning)
        full = gk.fused_linear_grpo_loss(d["hidden"], w_full, d["targets"], d["adv"], d["mask"], old,
                                         config=cfg, backend="torch", num_tokens=int(d["mask"].sum()),
                                         num_sequences=5)  # fmt: skip
        full.loss.backward()
        w = d["weight"].clone().requires_grad_()
        kwargs = {}
        if with_normalizers:
            kwargs = dict(num_tokens=int(d["mask"].sum()), num_sequences=5, dp_size=world)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            local = gk.fused_linear_grpo_loss(d["hidden"][mine], w, d["targets"][mine], d["adv"][mine],
                                              d["mask"][mine], old[mine], config=cfg, backend="torch", **kwargs)  # fmt: skip
        local.loss.backward()
        grad = w.grad.clone()
        dist.all_reduce(grad)  # DDP: the mean of the ranks' gradients
        grad /= world
        loss = local.loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world
        out[name] = {
            "grad_weight": worst(grad, w_full.grad),
            "loss": worst(loss, full.loss),
            "warned": [str(c.message) for c in caught if c.category is gk.DistributedNormalizerWarning],
        }
    return out


def entropy_quantile_worker(rank, world):
    """top_entropy_quantile across data-parallel ranks (TRL gathers every process's entropies): with
    entropy_group the ranks' averaged gradient is the single-process one on the whole batch; without it
    each rank selects by its own quantile (reported, to show the difference is real)."""
    import grpo_kernels as gk
    from grpo_kernels import PolicyLossConfig as C

    d = lm_inputs(203, b=5)
    # sequences of different sharpness, so each rank's own entropy quantile is far from the batch's
    d["hidden"] = d["hidden"] * torch.tensor([0.3, 1.0, 2.5, 4.0, 0.6])[:, None, None]
    mine = list(range(rank, 5, world))
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(5, 7, generator=g) * 4
    cfg = C.dapo(top_entropy_quantile=0.4, entropy_coef=0.02)
    n_tokens = int(d["mask"].sum())
    w_full = d["weight"].clone().requires_grad_()
    full = gk.fused_linear_grpo_loss(d["hidden"], w_full, d["targets"], d["adv"], d["mask"], old, config=cfg,
                                     backend="torch", num_tokens=n_tokens, num_sequences=5)  # fmt: skip
    full.loss.backward()
    out = {}
    for name, group in (("entropy_group", dist.group.WORLD), ("local_quantile", None)):
        w = d["weight"].clone().requires_grad_()
        local = gk.fused_linear_grpo_loss(d["hidden"][mine], w, d["targets"][mine], d["adv"][mine], d["mask"][mine],
                                          old[mine], config=cfg, backend="torch", num_tokens=n_tokens,
                                          num_sequences=5, dp_size=world, entropy_group=group)  # fmt: skip
        local.loss.backward()
        grad = w.grad.clone()
        dist.all_reduce(grad)
        grad /= world
        loss = local.loss.detach().clone()
        dist.all_reduce(loss)
        loss /= world
        out[name] = {"grad_weight": worst(grad, w_full.grad), "loss": worst(loss, full.loss)}
    # grpo_loss on log-probs takes the same group
    lp = full.logprobs.detach()
    ent = full.entropy.detach()
    whole = gk.grpo_loss(lp.clone().requires_grad_(), d["adv"], d["mask"], old, entropy=ent, config=cfg,
                         backend="torch", num_tokens=n_tokens, num_sequences=5)  # fmt: skip
    part = gk.grpo_loss(lp[mine], d["adv"][mine], d["mask"][mine], old[mine], entropy=ent[mine], config=cfg,
                        backend="torch", num_tokens=n_tokens, num_sequences=5, dp_size=world,
                        entropy_group=dist.group.WORLD)  # fmt: skip
    total = part.loss.detach().clone()
    dist.all_reduce(total)
    out["grpo_loss"] = {"loss": worst(total / world, whole.loss)}
    return out


class _GlooAccelerator:
    """accelerate's Accelerator as GRPOTrainer._compute_loss uses it, on a real gloo group: gather
    concatenates every rank's tensor along dim 0, reduce sums, pad_across_processes pads dim 0 to the
    longest rank's."""

    sync_gradients = True

    def __init__(self, world):
        self.num_processes = world

    def gather(self, x):
        x = torch.atleast_1d(x).contiguous()
        parts = [torch.empty_like(x) for _ in range(self.num_processes)]
        dist.all_gather(parts, x)
        return torch.cat(parts)

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        x = x.clone()
        dist.all_reduce(x)
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        size = torch.tensor([x.shape[0]])
        sizes = [torch.zeros_like(size) for _ in range(self.num_processes)]
        dist.all_gather(sizes, size)
        longest = int(max(sizes))
        return torch.cat([x, x.new_full((longest - x.shape[0], *x.shape[1:]), pad_index)])


def trl_entropy_quantile_worker(rank, world):
    """TRL's _compute_loss with top_entropy_quantile on `world` real processes (each its own batch) against
    the TRL adapter's configuration of grpo_kernels (its loss_normalizers pass the default group as
    entropy_group): loss, dloss/dlogp, dloss/dentropy and every logged metric. Returns the failure text
    of tests/test_parity_trl.compare, or "ok"."""
    import test_parity_trl as parity

    out = {}
    for loss_type in ("dapo", "grpo"):
        case = parity.trl_case(loss_type, num_processes=world, grad_accum=2, beta=0.04, top_entropy_quantile=0.4,
                               entropy_coef=0.05)  # fmt: skip
        x = parity.make_token_inputs(parity.SEED + rank)  # every rank its own batch
        theirs = parity.run_trl(case, x, _GlooAccelerator(world))
        ours = parity.run_ours(case, x, _GlooAccelerator(world))
        try:
            parity.compare(case, theirs, ours)
            out[loss_type] = "ok"
        except AssertionError as exc:
            out[loss_type] = str(exc)
    return out


def verl_lce_worker(rank, world):
    """verl's Megatron calling convention: linear_cross_entropy(hidden, local weight block, global labels,
    temperature, "none", tp_group) positionally, against the whole head on one process."""
    import checkout

    checkout.use_this_checkouts_integrations()
    from grpo_kernels.integrations import verl as gk_verl

    d = lm_inputs(204)
    block = 204 // world
    x = d["hidden"].clone().requires_grad_()
    w = d["weight"][rank * block:(rank + 1) * block].clone().requires_grad_()
    lp, ent = gk_verl.linear_cross_entropy(x, w, d["targets"], 0.7, "none", dist.group.WORLD)
    (lp * d["noise"][0].reshape(-1)).sum().backward()
    x_full = d["hidden"].clone().requires_grad_()
    w_full = d["weight"].clone().requires_grad_()
    lp_full, ent_full = gk_verl.linear_cross_entropy(x_full, w_full, d["targets"], 0.7, "none", None)
    (lp_full * d["noise"][0].reshape(-1)).sum().backward()
    # TP = 1: verl passes a 1-rank tensor-parallel group; every rank is its own (new_group: all ranks call it)
    singles = [dist.new_group([r]) for r in range(world)]
    lp_one, ent_one = gk_verl.linear_cross_entropy(d["hidden"], d["weight"], d["targets"], 0.7, "none", singles[rank])
    return {
        "tp1/logprobs": worst(lp_one, lp_full), "tp1/entropy": worst(ent_one, ent_full),
        "logprobs": worst(lp, lp_full), "entropy": worst(ent, ent_full), "grad_/hidden": worst(x.grad, x_full.grad),
        "grad_/weight": worst(w.grad, w_full.grad[rank * block:(rank + 1) * block]),
    }


class TinyLM(torch.nn.Module):
    """Embedding, one MLP block and an LM head: enough to shard and to check every gradient."""

    def __init__(self, vocab=203, hidden=24):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.block = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, loss_inputs=None):
        hidden = self.block(self.embed(ids))
        if loss_inputs is None:
            return hidden
        import grpo_kernels as gk  # the loss inside the forward, on the head's weight as FSDP hands it over

        return gk.fused_linear_grpo_loss(hidden, self.lm_head.weight, **loss_inputs).loss


def fsdp_all_worker(rank, world):
    """fsdp_worker for the head in / out of its own unit x the loss in / after the forward, one group."""
    out = {}
    for own in (True, False):
        for inside in (True, False):
            for key, value in fsdp_worker(rank, world, own, inside).items():
                out[f"own={own}/inside={inside}/{key}"] = value
    return out


def fsdp_worker(rank, world, head_own_unit, inside_forward):
    """FSDP2 (fully_shard) with grpo_kernels on lm_head.weight: each rank its share of the sequences and the
    global normalizers; the sharded gradients after FSDP's reduce-scatter against one process."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import grpo_kernels as gk
    from grpo_kernels import PolicyLossConfig as C

    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    if head_own_unit:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(3)
    b, t = 4, 7
    ids = torch.randint(0, 203, (b, t + 1), generator=g)
    lengths = torch.tensor([7, 3, 5, 6])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g)
    old = -torch.rand(b, t, generator=g) * 5
    cfg = C.dapo()
    mine = list(range(rank, b, world))
    common = dict(config=cfg, backend="torch", num_tokens=int(mask.sum()), num_sequences=b)

    def loss_inputs(rows, dp_size):
        return dict(targets=ids[rows, 1:], advantages=adv[rows], mask=mask[rows], old_logprobs=old[rows],
                    dp_size=dp_size, **common)  # fmt: skip

    if inside_forward:
        loss = model(ids[mine, :-1], loss_inputs(mine, world))
    else:
        hidden = model(ids[mine, :-1])
        loss = gk.fused_linear_grpo_loss(hidden, model.lm_head.weight, **loss_inputs(mine, world)).loss
    loss.backward()
    ref_hidden = reference(ids[:, :-1])
    ref_loss = gk.fused_linear_grpo_loss(ref_hidden, reference.lm_head.weight, **loss_inputs(list(range(b)), 1)).loss
    ref_loss.backward()
    out = {}
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        out[f"grad_/{name}"] = worst(p.grad.full_tensor(), q.grad)
    return out


def zero3_stub_worker(rank, world):
    """A ZeRO-3 partitioned parameter as DeepSpeed leaves it outside the forward: 0 elements, a ds_id."""
    import grpo_kernels as gk

    d = lm_inputs(203)
    stub = torch.nn.Parameter(torch.empty(0))
    stub.ds_id = 7
    try:
        gk.fused_linear_logprobs(d["hidden"], stub, d["targets"])
    except ValueError as exc:
        return str(exc)
    return "no error"


def trl_fsdp2_head_worker(rank, world):
    """The TRL adapter's check on an FSDP2 head given as its own unit (a DTensor inside the forward)."""
    import checkout

    checkout.use_this_checkouts_integrations()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from grpo_kernels.integrations.trl import check_fsdp2_head

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(8, 16, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

    mesh = init_device_mesh("cpu", (world,))
    model = Model()
    fully_shard(model.lm_head, mesh=mesh)  # its own unit: a DTensor whenever its own forward is not running
    out = {}
    with torch.no_grad():
        check_fsdp2_head(model)  # no gradient flows (reference / old-policy passes): fine
    try:
        check_fsdp2_head(model)
        out["with_grad"] = "no error"
    except RuntimeError as exc:
        out["with_grad"] = str(exc)
    return out
