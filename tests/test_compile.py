"""torch.compile(fullgraph=True): a training step that calls the public functions traces without a graph
break (each function is one torch.library custom op under compile, grpo_kernels/_custom_ops.py), and
its forward and backward equal eager. The compiled and eager paths run the same computations in the same
order (the op body is the eager function), so they agree to the last bit up to the recomputation of the
log-prob backward; the tolerance is a few fp32 ulps of the largest element.

aot_eager traces the op's fake implementation and its registered autograd exactly as inductor does,
without generating C++; one case also runs inductor end to end."""

from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.ops.loss_head.reference import metric_names

C = gk.PolicyLossConfig
B, T, H, V, VOCAB_IN = 3, 7, 16, 37, 11


class TinyPolicy(torch.nn.Module):
    """Embedding -> one tanh layer -> hidden states; the LM head is a separate weight (and bias)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB_IN, H)
        self.layer = torch.nn.Linear(H, H)
        self.head = torch.nn.Linear(H, V)

    def hidden(self, ids):
        return torch.tanh(self.layer(self.embed(ids)))


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        ids=torch.randint(0, VOCAB_IN, (B, T), generator=g),
        targets=torch.randint(0, V, (B, T), generator=g),
        mask=torch.rand(B, T, generator=g) > 0.25,
        advantages=torch.randn(B, generator=g),
        old=torch.randn(B, T, generator=g) * 0.1 - 3.5,
        ref=torch.randn(B, T, generator=g) * 0.1 - 3.5,
    )


def assert_close_fp32(name, got, want):
    scale = want.abs().max().clamp(min=1.0)
    err = (got - want).abs()
    worst = int(err.argmax())
    assert err.max() <= 4 * torch.finfo(torch.float32).eps * scale, (
        f"{name}: max |compiled - eager| = {err.max():.3g} at flat index {worst} "
        f"(compiled {got.flatten()[worst]:.9g}, eager {want.flatten()[worst]:.9g})"
    )


def run_both(step, compile_backend="aot_eager"):
    """(loss, metrics, grads) of step(model, data) eager and compiled with fullgraph=True, same weights."""
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = TinyPolicy()
        data = batch()
        fn = torch.compile(step, fullgraph=True, backend=compile_backend) if compiled else step
        loss, metrics = fn(model, data)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads))
    return results


def compare(eager, compiled):
    (l_e, m_e, g_e), (l_c, m_c, g_c) = eager, compiled
    assert_close_fp32("loss", l_c, l_e)
    assert sorted(m_c) == sorted(m_e)
    for key in m_e:
        assert_close_fp32(f"metric {key}", m_c[key], m_e[key])
    for name in g_e:
        assert_close_fp32(f"grad {name}", g_c[name], g_e[name])


CONFIGS = {
    "grpo+kl": C.grpo(),
    "dapo": C.dapo(),
    "gspo": C.gspo(),
    "entropy bonus": C.grpo(entropy_coef=0.01),
    "group_dpo": C(loss_type="group_dpo", group_size=3, kl_coef=0.0),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_loss_training_step_compiles_fullgraph_and_equals_eager(name):
    cfg = CONFIGS[name]

    def step(model, d):
        out = gk.fused_linear_grpo_loss(
            model.hidden(d["ids"]), model.head.weight, d["targets"], d["advantages"], d["mask"], d["old"],
            d["ref"], bias=model.head.bias, config=cfg, backend="torch",
        )  # fmt: skip
        return out.loss + 0.0 * out.entropy.sum(), out.metrics

    compare(*run_both(step))


def test_logprobs_training_step_compiles_fullgraph_and_equals_eager():
    def step(model, d):
        out = gk.fused_linear_logprobs(model.hidden(d["ids"]), model.head.weight, d["targets"], model.head.bias,
                                       0.7, mask=d["mask"], backend="torch")  # fmt: skip
        m = d["mask"].float()
        loss = -(out.logprobs * m * d["advantages"][:, None]).sum() - 0.01 * (out.entropy * m).sum()
        return loss, {"mean_logprob": (out.logprobs * m).sum() / m.sum()}

    compare(*run_both(step))


def test_grpo_loss_on_logprobs_compiles_fullgraph_and_equals_eager():
    cfg = C.grpo(entropy_coef=0.01)

    def step(model, d):
        logits = model.head(model.hidden(d["ids"]))
        logp = torch.log_softmax(logits, -1)
        lp = logp.gather(-1, d["targets"][..., None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        out = gk.grpo_loss(lp, d["advantages"], d["mask"], d["old"], d["ref"], entropy=entropy, config=cfg,
                           backend="torch")  # fmt: skip
        return out.loss, out.metrics

    compare(*run_both(step))


def test_inductor_end_to_end():
    def step(model, d):
        out = gk.fused_linear_grpo_loss(model.hidden(d["ids"]), model.head.weight, d["targets"], d["advantages"],
                                        d["mask"], d["old"], d["ref"], bias=model.head.bias, backend="torch")  # fmt: skip
        return out.loss, out.metrics

    compare(*run_both(step, compile_backend="inductor"))


def test_checks_still_run_inside_the_compiled_op():
    d = batch()
    bad_targets = d["targets"].clone()
    bad_targets[0, 0] = V + 5  # out of range: found by a check that reads values (a host sync)

    def step(hidden, weight):
        return gk.fused_linear_logprobs(hidden, weight, bad_targets, backend="torch").logprobs

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="targets"):
        compiled(torch.randn(B, T, H), torch.randn(V, H))


def test_tp_group_is_refused_inside_compile():
    group = object()  # any non-None group: refused before it is used

    def step(hidden, weight, targets):
        return gk.fused_linear_logprobs(hidden, weight, targets, tp_group=group, backend="torch").logprobs

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="tp_group is not supported inside torch.compile"):
        compiled(torch.randn(B, T, H), torch.randn(V, H), torch.randint(0, V, (B, T)))


def test_entropy_group_is_refused_inside_compile():
    group = object()  # any non-None group: refused before it is used
    cfg = gk.PolicyLossConfig.dapo(top_entropy_quantile=0.5, entropy_coef=0.01)

    def step(logprobs, entropy, advantages, mask):
        return gk.grpo_loss(logprobs, advantages, mask, entropy=entropy, config=cfg, backend="torch",
                            entropy_group=group).loss  # fmt: skip

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="entropy_group is not supported inside torch.compile"):
        compiled(torch.randn(B, T), torch.rand(B, T), torch.randn(B), torch.ones(B, T, dtype=torch.bool))


def loss_head_configs():
    from test_loss_head import CONFIGS as ALL

    return ALL


@pytest.mark.parametrize("has_ref", [False, True])
@pytest.mark.parametrize("has_entropy", [False, True])
@pytest.mark.parametrize("has_is_weights", [False, True])
def test_metric_names_are_those_eager_reports(has_ref, has_entropy, has_is_weights):
    """The compiled path lays the metrics out by metric_names(); it must be exactly eager's key set, for
    every configuration of the loss-head tests."""
    d = batch()
    lp = d["old"] + 0.05
    rollout = d["old"] - 0.02
    wrong = []
    for name, cfg in loss_head_configs().items():
        if cfg.loss_type == "group_dpo":
            cfg = cfg.replace(group_size=B)  # one group: the batch's rows
        if cfg.needs_entropy and not has_entropy:
            continue
        needs_ref = cfg.kl_coef > 0 or cfg.loss_type == "group_dpo"
        if needs_ref and not has_ref:
            continue
        uses_rollout = cfg.uses_rollout_logprobs
        out = gk.grpo_loss(lp, d["advantages"], d["mask"], d["old"], d["ref"] if has_ref else None,
                           rollout if uses_rollout else None,
                           entropy=torch.full((B, T), 0.5) if has_entropy else None, config=cfg,
                           is_weights=torch.full((B, T), 0.9) if has_is_weights else None, backend="torch")  # fmt: skip
        declared = metric_names(cfg, has_ref=has_ref, has_entropy=has_entropy, has_is_weights=has_is_weights)
        if tuple(sorted(out.metrics)) != declared:
            wrong.append(f"{name}: eager {sorted(out.metrics)} vs declared {list(declared)}")
    assert not wrong, "\n".join(wrong)
