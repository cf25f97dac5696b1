"""Run by tests/test_batch_invariant.py, for the backend in argv[1] (triton: with TRITON_INTERPRET=1).

One sequence (7 tokens) scored alone and inside a batch of 64 random others, padded and packed, with
fused_linear_logprobs and with fused_linear_grpo_loss (every schedule the backend has, two one-pass chunk
sizes, two SM counts the default split plan would use), in batch-invariant mode: the sequence's log-probs
and entropy must be bitwise equal every time; and the gradients of one call, run twice, bitwise equal.
Prints one JSON line: check name -> [equal, max |difference|]."""

import json
import sys

import torch

import grpo_kernels as gk
import grpo_kernels.ops.fused.function as fused
from grpo_kernels import PolicyLossConfig as C

H, V, T, OTHERS = 32, 203, 7, 64


def main(backend):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g) / H**0.5 * 3
    bias = torch.randn(V, generator=g) * 0.3
    seq_h = torch.randn(T, H, generator=g)
    seq_y = torch.randint(0, V, (T,), generator=g)
    others_h = torch.randn(OTHERS, T, H, generator=g)
    others_y = torch.randint(0, V, (OTHERS, T), generator=g)
    lengths = torch.randint(1, T + 1, (OTHERS,), generator=g)
    place = 37  # the sequence's row in the batch
    batch_h = torch.cat([others_h[:place], seq_h[None], others_h[place:]])
    batch_y = torch.cat([others_y[:place], seq_y[None], others_y[place:]])
    batch_mask = torch.arange(T)[None, :] < torch.cat([lengths[:place], torch.tensor([T]), lengths[place:]])[:, None]
    report = {}
    alone = gk.fused_linear_logprobs(seq_h, weight, seq_y, bias, batch_invariant=True, backend=backend)
    ref = (alone.logprobs, alone.entropy)

    def record(name, lp, ent):
        same = torch.equal(lp, ref[0]) and torch.equal(ent, ref[1])
        report[name] = [same, max(float((lp - ref[0]).abs().max()), float((ent - ref[1]).abs().max()))]

    padded = gk.fused_linear_logprobs(batch_h, weight, batch_y, bias, mask=batch_mask, batch_invariant=True,
                                      backend=backend)  # fmt: skip
    record("logprobs/padded", padded.logprobs[place], padded.entropy[place])
    flat_h, flat_y = batch_h[batch_mask], batch_y[batch_mask]
    start = int(batch_mask[:place].sum())
    packed = gk.fused_linear_logprobs(flat_h, weight, flat_y, bias, batch_invariant=True, backend=backend)
    record("logprobs/packed", packed.logprobs[start:start + T], packed.entropy[start:start + T])
    default = gk.fused_linear_logprobs(batch_h, weight, batch_y, bias, mask=batch_mask, backend=backend)
    report["default_mode_max_diff"] = float((default.logprobs[place] - ref[0]).abs().max())

    adv = torch.randn(OTHERS + 1, generator=g)
    old = torch.randn(OTHERS + 1, T, generator=g) * 0.1 - 5
    # (schedule, one-pass chunk tokens, SM count the default split plan would size the splits for)
    runs = [("one_pass", 7, 4), ("one_pass", 23, 132), ("two_pass", 7, 4), ("two_pass", 7, 132)]
    if backend != "triton":  # the PyTorch backend has one schedule and no SM count
        runs = [("two_pass", 7, 132)]
    for schedule, chunk, num_sms in runs:
        fused.ONE_PASS_CHUNK_TOKENS = chunk
        if backend == "triton":
            import grpo_kernels.ops.lm_head.triton as lt

            lt.DEFAULT_NUM_SMS = num_sms
        out = gk.fused_linear_grpo_loss(batch_h, weight, batch_y, adv, batch_mask, old, bias=bias, config=C.dapo(),
                                        batch_invariant=True, backend=backend, schedule=schedule)  # fmt: skip
        record(f"loss/{schedule}/chunk{chunk}/sms{num_sms}", out.logprobs[place], out.entropy[place])
    # gradients: deterministic run to run
    grads = []
    for _ in range(2):
        x, w = batch_h.clone().requires_grad_(), weight.clone().requires_grad_()
        out = gk.fused_linear_grpo_loss(x, w, batch_y, adv, batch_mask, old, bias=bias, config=C.grpo(kl_coef=0.0),
                                        batch_invariant=True, backend=backend)  # fmt: skip
        out.loss.backward()
        grads.append((x.grad, w.grad))
    report["gradients_repeatable"] = [torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1]), 0.0]
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
