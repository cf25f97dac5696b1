"""Run by tests/test_integration_openrlhf.py: OpenRLHF's Actor under DeepSpeed ZeRO-3 (CPU accelerator, gloo,
one process started as torchrun would), as OpenRLHF's strategy prepares it (`Actor.model` is the DeepSpeed
engine around the transformers model), one training micro-batch: stock (OpenRLHF's forward and PolicyLoss) and
with the adapter (both parts). Prints one JSON line: the worst differences of log-probs, entropy, loss,
gradients (`safe_get_full_grad`) and parameters after one SGD step, with their scales, and the ZeRO-3 state of
the head."""

import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import checkout  # noqa: E402

checkout.use_this_checkouts_integrations()
import _openrlhf_support  # noqa: E402

_openrlhf_support.install_stubs()

import deepspeed  # noqa: E402
import torch  # noqa: E402
from openrlhf.models import Actor  # noqa: E402
from openrlhf.models import PolicyLoss as StockPolicyLoss  # noqa: E402

import grpo_kernels.integrations.openrlhf as gk_openrlhf  # noqa: E402

_openrlhf_support.eager_compute_entropy()
from test_integration_openrlhf import batch, make_model  # noqa: E402

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": 3,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": False},
    "zero_allow_untested_optimizer": True,  # torch's SGD: a plain step, easy to compare
}


def step(model, patched):
    if patched:
        gk_openrlhf.install_actor_forward(Actor)
    else:
        gk_openrlhf.uninstall_actor_forward(Actor)
    actor = Actor(copy.deepcopy(model), temperature=0.7)
    actor.packing_samples = False
    optimizer = torch.optim.SGD(actor.model.parameters(), lr=0.5)
    engine, *_ = deepspeed.initialize(model=actor.model, optimizer=optimizer, config=ZERO3)
    actor.model = engine  # as OpenRLHF's DeepspeedStrategy.prepare
    head = engine.module.get_output_embeddings().weight
    sequences, attention_mask, action_mask, old, advantages = batch()
    log_probs, output = actor(
        sequences, action_mask, attention_mask=attention_mask, return_output=True, return_entropy=True
    )
    loss_fn = gk_openrlhf.PolicyLoss() if patched else StockPolicyLoss()
    loss = loss_fn(log_probs, old, advantages, action_mask=action_mask)[0]
    width = action_mask.shape[1]
    entropy = output.entropy[:, -width:] * action_mask
    total = loss - 0.01 * (entropy.sum() / action_mask.sum())
    engine.backward(total)
    grads = {n: deepspeed.utils.safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    partitioned = head.numel() == 0  # outside the forward ZeRO-3 keeps only this rank's shard
    engine.step()
    params = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            params[name] = p.detach().clone()
    return dict(
        log_probs=log_probs.detach(),
        entropy=entropy.detach(),
        loss=total.detach(),
        grads=grads,
        params=params,
        partitioned=partitioned,
    )


def worst(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a), max(b[k].abs().max().item() for k in b)


def main():
    torch.manual_seed(0)
    model = make_model("llama")
    theirs, ours = step(model, False), step(model, True)
    grad_diff, grad_scale = worst(ours["grads"], theirs["grads"])
    param_diff, param_scale = worst(ours["params"], theirs["params"])
    report = dict(
        log_probs=(ours["log_probs"] - theirs["log_probs"]).abs().max().item(),
        entropy=(ours["entropy"] - theirs["entropy"]).abs().max().item(),
        loss=abs(ours["loss"].item() - theirs["loss"].item()),
        loss_value=theirs["loss"].item(),
        grad_diff=grad_diff,
        grad_scale=grad_scale,
        param_diff=param_diff,
        param_scale=param_scale,
        head_partitioned=[theirs["partitioned"], ours["partitioned"]],
        grads_present=sorted(ours["grads"]) == sorted(theirs["grads"]) and len(ours["grads"]) > 0,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
