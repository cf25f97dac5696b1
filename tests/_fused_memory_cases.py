"""Run by tests/test_fused_memory.py with TRITON_INTERPRET=1: the bytes the fused Triton path allocates
(counted by the profiler) next to the memory model of grpo_kernels/ops/fused/memory.py. Prints JSON."""
import json
import torch
import grpo_kernels as gk
import grpo_kernels.ops.fused.function as fused
from grpo_kernels.ops.fused.memory import schedule_memory
from grpo_kernels.testing.memory import peak_allocated_bytes
B, T, H, V = 4, 13, 64, 4099
g = torch.Generator().manual_seed(0)
hidden = torch.randn(B, T, H, generator=g); weight = torch.randn(V, H, generator=g) / 8
targets = torch.randint(0, V, (B, T), generator=g)
lengths = torch.tensor([13, 9, 11, 7]); mask = torch.arange(T)[None] < lengths[:, None]
adv = torch.randn(B, generator=g); old = -torch.rand(B, T, generator=g) * 8
fused.ONE_PASS_LOGITS_BYTES = 12 * 4 * V  # 12 valid tokens per chunk: 4 chunks of the 40
out = {}
for schedule in ("one_pass", "two_pass"):
    x = hidden.clone().requires_grad_(); w = weight.clone().requires_grad_()
    def call():
        return gk.fused_linear_grpo_loss(x, w, targets, adv, mask, old, config=gk.PolicyLossConfig.dapo(),
                                         backend="triton", schedule=schedule)
    res, peak, end = peak_allocated_bytes(call)
    model = schedule_memory(schedule, int(mask.sum()), H, V, 4, logits_bytes=fused.ONE_PASS_LOGITS_BYTES)
    out[schedule] = dict(peak=peak, model=model.peak_extra, grads=x.numel() * 4, tokens=B * T)
print(json.dumps(out))
