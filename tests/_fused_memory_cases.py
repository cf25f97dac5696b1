"""Run by tests/test_fused_memory.py with TRITON_INTERPRET=1: the bytes the fused Triton path allocates
(counted by the profiler) next to the memory model of grpo_kernels/ops/fused/memory.py, per schedule, and
the bytes the input validation allocates next to memory.validation_bytes. Prints JSON."""
import json
import torch
import grpo_kernels as gk
import grpo_kernels._checks as chk
import grpo_kernels.ops.fused.function as fused
from grpo_kernels.ops.fused.memory import schedule_memory, validation_bytes
from grpo_kernels.testing.memory import peak_allocated_bytes
B, T, H, V = 4, 13, 64, 4099
g = torch.Generator().manual_seed(0)
hidden = torch.randn(B, T, H, generator=g); weight = torch.randn(V, H, generator=g) / 8
targets = torch.randint(0, V, (B, T), generator=g)
lengths = torch.tensor([13, 9, 11, 7]); mask = torch.arange(T)[None] < lengths[:, None]
adv = torch.randn(B, generator=g); old = -torch.rand(B, T, generator=g) * 8
fused.ONE_PASS_LOGITS_BYTES = 12 * 4 * V  # at most 12 valid tokens per chunk: 4 chunks of the 40
fused.ONE_PASS_CHUNK_TOKENS = 12  # the in-place schedules' chunks (sized by the goal, capped here) as well
# DAPO is token-local: the 40 valid tokens run as 4 balanced chunks of 10 (function.balanced_chunk_tokens)
CHUNK_ROWS = fused.balanced_chunk_tokens(int(mask.sum()), 12)
assert CHUNK_ROWS == 10, CHUNK_ROWS
fused.LOW_MEMORY_SLAB_BYTES = 1024 * (40 * 4 + H * 4)  # 1024-column slabs: 5 of V = 4099
out = {}
# fp32 every schedule; bf16 the kernel-A one-pass schedules, whose chunk logits are then fp16 differences and
# offsets (HalfLogits, ~2 bytes per logit: 2x the tokens of the same budget, capped at 12 here)
RUNS = [(s, torch.float32) for s in ("one_pass", "two_pass", "low_memory", "one_pass_inplace", "one_pass_cublas",
                                     "one_pass_cublas_inplace")] + [(s, torch.bfloat16) for s in ("one_pass",
                                                                                                  "one_pass_inplace")]
for schedule, dtype in RUNS:
    x = hidden.to(dtype).requires_grad_(); w = weight.to(dtype).requires_grad_()
    def call():
        return gk.fused_linear_grpo_loss(x, w, targets, adv, mask, old, config=gk.PolicyLossConfig.dapo(),
                                         backend="triton", schedule=schedule)
    res, peak, end = peak_allocated_bytes(call)
    e = x.element_size()
    model = schedule_memory(schedule, int(mask.sum()), H, V, e, logits_bytes=fused.ONE_PASS_LOGITS_BYTES,
                            n_tokens=B * T, chunk_rows=CHUNK_ROWS)
    # gradients allocated inside the call: grad_hidden always; grad_weight by low_memory (written per
    # block in its final dtype) and the in-place schedules (the gradient buffer summed into); the other
    # schedules' fp32 accumulator is the fp32 gradient here, and in bf16 its cast is made after the logits
    # buffer is freed (below the peak)
    grads = x.numel() * e + (w.numel() * e if schedule == "low_memory" or schedule.endswith("_inplace") else 0)
    slab_dz = next((b for k, b in model.buffers.items() if k.startswith("slab dz")), 0)
    key = schedule if dtype == torch.float32 else f"{schedule}-bfloat16"
    out[key] = dict(peak=peak, model=model.peak_extra, grads=grads, tokens=B * T, slab_dz=slab_dz)
    if dtype != torch.float32:  # CPU torch has no bf16 GEMM with an fp32 output: the grad_weight GEMM's
        # fallback makes an fp32 copy of the chunk's dz slab and an fp32 [V, H] product (triton.py
        # _grad_weight_accumulate), which a GPU's out_dtype GEMM does not
        out[key]["cpu_upcast"] = 4 * V * H + 4 * CHUNK_ROWS * V
# validation alone (the checks fused_linear_grpo_loss makes on hidden and weight), against its model
flat = hidden.reshape(-1, H)
valid = mask.reshape(-1)
_, peak, _ = peak_allocated_bytes(lambda: (chk.check_finite("hidden", flat, valid[:, None]),
                                           chk.check_finite("weight", weight)))
out["validation"] = dict(peak=peak, model=validation_bytes(B * T, 4), weight_bytes=weight.numel())
print(json.dumps(out))
