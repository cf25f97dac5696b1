"""Logit soft-capping and a logit scale: z = c tanh(s x / c) / T (x = hidden @ W^T + b).

The PyTorch backend against the float64 reference (forward and every gradient), the Triton kernels under
the interpreter against the PyTorch backend (log-probs, and the fused loss in every schedule), and
transformers' own Gemma 2 / Gemma 3 forward on tiny models built here (the cap on the model's logits,
then the sampling temperature). fp32: sums over V = 203-301 and H = 16-32 terms, |diff| <= 2e-5 (1 + |x|),
gradients relative to their largest element, as in the interpreter tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.ops.lm_head.reference import lm_head_stats_reference

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from interpreter_runner import close  # noqa: E402

TOL = 2e-5


def assert_near(name, got, expected, relative_to_largest=False):
    got, expected = got.double().reshape(-1), expected.double().reshape(-1)
    diff = (got - expected).abs()
    i = int(diff.argmax())
    scale = expected.abs().max().item() if relative_to_largest else None
    assert close(got[i].item(), expected[i].item(), TOL, scale), (
        f"{name}: worst at {i}: got {got[i].item()!r}, expected {expected[i].item()!r}"
    )


@pytest.mark.parametrize("cap,scale,temperature", [(30.0, 1.0, 0.8), (5.0, 0.5, 1.3), (None, 0.25, 0.9), (2.0, 1.0, 1.0)])
def test_torch_backend_matches_the_float64_reference(cap, scale, temperature):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, 16, generator=g, dtype=torch.float64)
    w = torch.randn(301, 16, generator=g, dtype=torch.float64)
    b = torch.randn(301, generator=g, dtype=torch.float64)
    y = torch.randint(0, 301, (23,), generator=g)
    x1, w1, b1 = (t.clone().float().requires_grad_() for t in (h, w, b))
    out = gk.fused_linear_logprobs(x1, w1, y, b1, temperature, softcap=cap, logit_scale=scale, backend="torch")
    (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()
    x2, w2, b2 = (t.clone().requires_grad_() for t in (h, w, b))
    ref = lm_head_stats_reference(x2, w2, y, b2, temperature, softcap=cap, logit_scale=scale)
    (ref.logprobs.sum() + 0.3 * ref.entropy.sum()).backward()
    assert_near("logprobs", out.logprobs, ref.logprobs)
    assert_near("entropy", out.entropy, ref.entropy)
    for name, a, e in (("grad_hidden", x1.grad, x2.grad), ("grad_weight", w1.grad, w2.grad), ("grad_bias", b1.grad, b2.grad)):
        assert_near(name, a, e, relative_to_largest=True)


@pytest.mark.interpreter
def test_triton_kernels_match_the_torch_backend():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE.parent))
    proc = subprocess.run([sys.executable, str(HERE / "_softcap_cases.py")], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # the TMA kernel A ran for the "tma-" entries (and only it: the block asks for it throughout)
    assert report.pop("forward_kernels") == ["lm_head_fwd_kernel_partial_tma"]
    assert len(report) == 2 * (5 + 4 * 5) + 2 * 5
    for key, (got, expected, index, scale) in report.items():
        ok = close(got, expected, TOL, scale if ("grad_" in key) else None)
        assert ok, f"{key}: worst at {index}: triton {got!r}, torch {expected!r}"


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_matches_transformers_gemma_forward(kind):
    """The model's own logits (capped by transformers), then the sampling temperature, against
    grpo_kernels on the model's last hidden states and LM-head weight with softcap=config's cap."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    if kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, final_logit_softcapping=30.0))
    else:
        config = transformers.Gemma3TextConfig(**common, final_logit_softcapping=15.0)
        model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():  # larger head weights, so the cap bites (|logits| of tens)
        model.lm_head.weight.mul_(40.0)
    model.eval()
    cap = model.config.final_logit_softcapping
    ids = torch.randint(1, 97, (2, 9))
    temperature = 0.7
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()  # [2, 9, V], soft-capped by transformers
        hidden = model.model(input_ids=ids).last_hidden_state
    assert logits.abs().max() > 0.5 * cap, "the cap does not bind on these logits"
    log_p = torch.log_softmax(logits[:, :-1] / temperature, -1)
    targets = ids[:, 1:]
    expected_lp = log_p.gather(-1, targets[..., None]).squeeze(-1)
    expected_ent = -(log_p.exp() * log_p).sum(-1)
    out = gk.fused_linear_logprobs(hidden[:, :-1], model.lm_head.weight, targets, None, temperature, softcap=cap,
                                   backend="torch")  # fmt: skip
    assert_near("logprobs", out.logprobs, expected_lp)
    assert_near("entropy", out.entropy, expected_ent)


@pytest.mark.parametrize("kwargs,match", [
    (dict(softcap=0.0), "softcap must be a finite number > 0"), (dict(softcap=-3.0), "softcap must be a finite"),
    (dict(softcap=float("inf")), "softcap must be a finite"), (dict(softcap=torch.tensor(3.0)), "softcap must be a Python float"),
    (dict(softcap=True), "softcap must be a Python float"), (dict(logit_scale=0.0), "logit_scale must be a finite"),
    (dict(logit_scale=None), "logit_scale must be a Python float"),
])  # fmt: skip
def test_bad_transform_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gk.fused_linear_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]), **kwargs)
    with pytest.raises(ValueError, match=match):
        gk.fused_linear_grpo_loss(torch.randn(1, 3, 4), torch.randn(5, 4), torch.tensor([[0, 1, 2]]), torch.ones(1),
                                  torch.ones(1, 3, dtype=torch.bool), **kwargs)  # fmt: skip
