"""The torchtitan RL adapter (grpo_kernels.integrations.torchtitan.GRPOKernelsLoss) against torchtitan 0.3.0.

* the oracle is torchtitan's own code: ``DAPOLoss`` (and ``GRPOLoss``) on the full logits, and the
  ``ChunkedLossWrapper(DAPOLoss)`` the trainer runs on hidden states; compared: the loss, every metric
  DAPOLoss reports, the gradients of the hidden states and of the LM-head weight, in both modes, with a
  non-finite generator log-prob (dropped), masked prompt / padding tokens and global_valid_tokens larger
  than the batch's own count (gradient accumulation);
* two training steps as torchtitan's ``PolicyTrainer.forward_backward`` runs them (model forward with
  ``_skip_lm_head``, ``loss_fn(pred, labels, global_valid_tokens, generator_logprobs=, advantages=,
  loss_mask=)``, ``loss.backward()``, an optimizer step) on a tiny decoder keeping torchtitan's decoder
  contract, with torchtitan's ChunkedLossWrapper(DAPOLoss) and with ours: the same metrics, gradients and
  parameters (``PolicyTrainer`` itself is a Monarch actor: it needs monarch and torchstore);
* the config builds the class (torchtitan's ``Config.build``), refusals name the option.
Tolerances: fp32 on both sides, sums over the vocabulary (128) and the batch in different orders.
"""

from __future__ import annotations

import pytest
import torch
from trainer_support import require_torchtitan

from grpo_kernels.testing import assert_close

losses = require_torchtitan()
from torchtitan.components.loss import ChunkedLossWrapper  # noqa: E402

from grpo_kernels.integrations import torchtitan as gk_tt  # noqa: E402

pytestmark = pytest.mark.parity
B, L, H, V = 3, 16, 24, 128


def data(seed=0, valid_tokens=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, H, generator=g)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.6)
    labels = torch.randint(0, V, (B, L), generator=g)
    loss_mask = torch.zeros(B, L, dtype=torch.bool)
    loss_mask[0, 4:16], loss_mask[1, 6:11], loss_mask[2, 2:9] = True, True, True
    labels[~loss_mask] = -100  # prompt and padding positions carry torchtitan's IGNORE_INDEX
    with torch.no_grad():
        current = torch.log_softmax(hidden @ head.weight.T, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    generator = current + torch.randn(B, L, generator=g) * 0.3  # ratios beyond both clip bounds
    generator[1, 8] = float("-inf")  # vLLM under cudagraph: dropped from the loss and the denominator
    generator[~loss_mask] = 0.0
    adv = torch.where(loss_mask, torch.randn(B, 1, generator=g).expand(B, L), torch.zeros(B, L))
    valid = int((loss_mask & torch.isfinite(generator)).sum())
    return hidden, head, labels, generator, adv, loss_mask, valid if valid_tokens is None else valid_tokens


def run(loss, hidden, head, labels, generator, adv, mask, gvt, *, on_logits=False):
    h = hidden.clone().requires_grad_()
    head.weight.grad = None
    if on_logits:  # torchtitan's DAPOLoss on the full logits
        out, metrics = loss(h @ head.weight.T, labels, gvt, generator_logprobs=generator, advantages=adv, loss_mask=mask)
    else:
        loss.set_lm_head(head)
        out, metrics = loss(h, labels, gvt, generator_logprobs=generator, advantages=adv, loss_mask=mask)
    out.backward()
    return out.detach(), {k: v.detach() for k, v in metrics.items()}, h.grad, head.weight.grad.clone()


def compare(ours, theirs):
    assert_close("loss", ours[0], theirs[0], atol=1e-6, rtol=1e-5)
    assert set(ours[1]) == set(theirs[1]), sorted(set(ours[1]) ^ set(theirs[1]))
    for key, value in theirs[1].items():
        assert_close(f"metric {key}", ours[1][key], value, atol=2e-6, rtol=1e-5)
    for name, o, t in (("grad hidden", ours[2], theirs[2]), ("grad weight", ours[3], theirs[3])):
        assert_close(name, o, t, atol=1e-5 * t.abs().max().item(), rtol=1e-4)


def dapo(low=0.2, high=0.28):
    return losses.DAPOLoss.Config(ratio_clip_low=low, ratio_clip_high=high).build()


@pytest.mark.parametrize("mode", gk_tt.MODES)
@pytest.mark.parametrize("gvt", [None, 90], ids=["own-count", "accumulated-count"])
def test_equals_dapo_on_full_logits_and_chunked(mode, gvt):
    hidden, head, labels, generator, adv, mask, valid = data(valid_tokens=gvt)
    ours = run(gk_tt.GRPOKernelsLoss.Config(ratio_clip_low=0.2, ratio_clip_high=0.28, mode=mode).build(),
               hidden, head, labels, generator, adv, mask, valid)
    full = run(dapo(), hidden, head, labels, generator, adv, mask, valid, on_logits=True)
    chunked = run(ChunkedLossWrapper.Config(num_chunks=4, loss_fn=losses.DAPOLoss.Config(
        ratio_clip_low=0.2, ratio_clip_high=0.28)).build(), hidden, head, labels, generator, adv, mask, valid)
    compare(ours, full)
    compare(ours, chunked)
    assert 0 < full[1]["loss/ratio_clipped_frac"] < full[1]["loss/ratio_mean"], full[1]  # the clip binds on some


def test_grpo_loss_is_the_symmetric_case():
    hidden, head, labels, generator, adv, mask, valid = data(seed=1)
    ours = run(gk_tt.GRPOKernelsLoss.Config(ratio_clip_low=0.25, ratio_clip_high=0.25).build(),
               hidden, head, labels, generator, adv, mask, valid)
    theirs = run(losses.GRPOLoss.Config(clip_eps=0.25).build(), hidden, head, labels, generator, adv, mask, valid,
                 on_logits=True)
    compare(ours, theirs)


def test_is_a_chunked_loss_wrapper_and_refuses_by_name():
    loss = gk_tt.GRPOKernelsLoss.Config().build()
    assert isinstance(loss, ChunkedLossWrapper)  # what makes torchtitan's trainer hand it the LM head
    hidden, head, labels, generator, adv, mask, valid = data()
    with pytest.raises(ValueError, match="set_lm_head"):
        loss(hidden, labels, valid, generator_logprobs=generator, advantages=adv, loss_mask=mask)
    with pytest.raises(ValueError, match="mode must be one of"):
        gk_tt.GRPOKernelsLoss.Config(mode="chunked").build()
    loss.set_lm_head(head)
    with pytest.raises(ValueError, match="_skip_lm_head"):
        loss(hidden @ head.weight.T, labels, valid, generator_logprobs=generator, advantages=adv, loss_mask=mask)


class TinyDecoder(torch.nn.Module):
    """The contract torchtitan's decoders keep for the RL trainer (models/common/decoder.py): an ``lm_head``
    module and a ``_skip_lm_head`` attribute that makes the forward return the final norm's output.
    (torchtitan's own debug models need flex attention, whose backward does not run on CPU.)"""

    _skip_lm_head = False

    def __init__(self, vocab=96, dim=24):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(2 * dim, dim)
        self.norm = torch.nn.RMSNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, positions=None):
        x = self.embed(tokens)
        previous = torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]  # a causal mixing of neighbours
        h = self.norm(x + torch.tanh(self.mix(torch.cat([x, previous], -1))))
        return h if self._skip_lm_head else self.lm_head(h)


def test_training_step_as_policy_trainer(monkeypatch):
    """PolicyTrainer.forward_backward's sequence (forward with _skip_lm_head, the loss, backward), then an SGD
    step, twice: torchtitan's ChunkedLossWrapper(DAPOLoss) and ours log the same metrics and train alike."""
    torch.manual_seed(0)
    stock_model = TinyDecoder()
    ours_model = TinyDecoder()
    ours_model.load_state_dict(stock_model.state_dict())
    g = torch.Generator().manual_seed(3)
    vocab = stock_model.lm_head.weight.shape[0]
    tokens = torch.randint(0, vocab, (2, 32), generator=g)
    results = {}
    for name, model, loss in (("stock", stock_model, ChunkedLossWrapper.Config(num_chunks=4, loss_fn=losses.DAPOLoss.Config(
            ratio_clip_low=0.2, ratio_clip_high=0.28)).build()),
            ("ours", ours_model, gk_tt.GRPOKernelsLoss.Config(ratio_clip_low=0.2, ratio_clip_high=0.28).build())):
        loss.set_lm_head(model.lm_head)
        model._skip_lm_head = True  # what PolicyTrainer.__init__ does for a ChunkedLossWrapper
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        metrics_per_step = []
        for step in range(2):
            positions = torch.arange(32)[None].expand(2, 32)
            labels = torch.roll(tokens, -1, 1)
            mask = torch.zeros(2, 32, dtype=torch.bool)
            mask[0, 10:31], mask[1, 14:25] = True, True
            with torch.no_grad():
                pred = model(tokens, positions=positions)
                lp = torch.log_softmax(model.lm_head(pred).float(), -1).gather(-1, labels[..., None])[..., 0]
            generator = torch.where(mask, lp + 0.2 * torch.randn(2, 32, generator=torch.Generator().manual_seed(step)),
                                    torch.zeros(2, 32))
            adv = torch.where(mask, torch.tensor([[1.0], [-0.7]]).expand(2, 32), torch.zeros(2, 32))
            pred = model(tokens, positions=positions)
            out, metrics = loss(pred, labels, int(mask.sum()), generator_logprobs=generator, advantages=adv,
                                loss_mask=mask)
            out.backward()
            if step == 0:
                first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            optimizer.step()
            optimizer.zero_grad()
            metrics_per_step.append({k: v.detach() for k, v in metrics.items()})
        results[name] = (metrics_per_step, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()})
    for step, (mo, mt) in enumerate(zip(results["ours"][0], results["stock"][0])):
        assert set(mo) == set(mt), (step, sorted(set(mo) ^ set(mt)))
        for key, value in mt.items():
            assert_close(f"step {step} {key}", mo[key], value, atol=2e-6, rtol=1e-5)
    for name, grad in results["stock"][1].items():
        assert_close(f"grad {name}", results["ours"][1][name], grad, atol=1e-5 * grad.abs().max().item() + 1e-12,
                     rtol=1e-4)
    for name, p in results["stock"][2].items():
        assert_close(f"parameter {name}", results["ours"][2][name], p, atol=1e-6, rtol=1e-5)
