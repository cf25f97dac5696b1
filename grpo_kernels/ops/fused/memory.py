"""What each schedule of fused_linear_grpo_loss holds in memory, from the same planners the code runs.

`schedule_memory` lists the buffers that scale with V (the vocabulary) or with a chunk of tokens times
H or V, for the Triton backend's two schedules, and their peak "extra" (beyond the inputs and the
gradients). Buffers of O(N) bytes (per-token statistics, the loss head's vectors: a few dozen bytes
per token) are summed into one line. tests/test_fused_memory.py checks the model against the bytes a
run actually allocates (a counting profiler, interpreter tier) and prints the table at the target
shape; the op README gives it. No GPU is needed: every size here is a planning decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from .function import ONE_PASS_LOGITS_BYTES, one_pass_capacity, stored_logits_row_stride

GIB = 2**30
# The extra-memory goal of the fused loss (beyond inputs and gradients): "auto" leaves a schedule whose
# modelled peak exceeds it for the low-memory schedule when that one fits better (prefer_low_memory).
EXTRA_MEMORY_GOAL = 3 * GIB // 2
# per valid token, the O(N) vectors the fused path keeps alive at once (fp32 / int64 per-token values:
# logprobs, entropy, leaves, g_lp, g_ent, row indices, statistics, loss-head inputs): an upper bound
PER_TOKEN_BYTES = 160


@dataclass(frozen=True)
class ScheduleMemory:
    schedule: str
    buffers: dict[str, int]  # name -> bytes, all alive at the peak
    peak_extra: int  # bytes beyond inputs and gradients at the peak

    def table(self) -> str:
        lines = [f"{self.schedule}: peak extra {self.peak_extra / GIB:.2f} GiB"]
        lines += [f"  {name:<44} {nbytes / 2**20:10,.1f} MiB" for name, nbytes in self.buffers.items()]
        return "\n".join(lines)


def schedule_memory(schedule: str, n_valid: int, hidden: int, vocab: int, element_size: int = 2, *,
                    bias: bool = False, logits_bytes: int = ONE_PASS_LOGITS_BYTES,
                    workspace_bytes: int | None = None, block_m: int = 128, masked: bool = True) -> ScheduleMemory:  # fmt: skip
    """The peak of the Triton backend's fused forward (which computes every gradient) for `n_valid`
    valid tokens. one_pass: the fp32 grad_weight accumulator, the chunk's fp32 logits, and per chunk
    the dz slab (input dtype) and the chunk's fp32 grad_hidden and gathered hidden rows. two_pass:
    the accumulator, the gathered hidden rows of the whole batch, and per backward chunk the dz slab
    and its fp32 grad_hidden. The cast of the accumulator to the weight's dtype (the gradient) happens
    after the logits buffer is released. low_memory: no V x H fp32 buffer; grad_hidden in fp32, and per
    vocabulary slab the dz rows and the slab's fp32 grad_weight block. `masked`: some tokens are masked,
    so the two-pass schedules gather the valid hidden rows (a copy) first."""
    from ..lm_head.triton import DEFAULT_WORKSPACE_BYTES, plan_backward

    workspace_bytes = workspace_bytes or DEFAULT_WORKSPACE_BYTES
    if schedule == "low_memory":
        from .function import LOW_MEMORY_DZ_ROWS, vocab_slab_columns

        columns = vocab_slab_columns(n_valid, hidden, element_size, vocab)
        budget = LOW_MEMORY_DZ_ROWS * ((columns + 64) * element_size + 4 * hidden)
        plan = plan_backward(n_valid, columns, hidden, element_size, block_m, budget, store_dlogits=True,
                             need_bias_grad=bias, need_hidden_grad=True)  # fmt: skip
        buffers = {
            "grad_hidden accumulator, fp32 [N, H]": 4 * n_valid * hidden,
            "valid hidden rows [N, H] (when tokens are masked)": element_size * n_valid * hidden if masked else 0,
            f"slab grad_weight block, fp32 [{columns}, H]": 4 * columns * hidden,
            "slab dz rows [rows, slab] + fp32 grad_hidden rows": plan.workspace_bytes,
            "per-token vectors (O(N) bound)": PER_TOKEN_BYTES * n_valid,
        }
        return ScheduleMemory(schedule, buffers, sum(buffers.values()))
    buffers: dict[str, int] = {"grad_weight accumulator, fp32 [V, H]": 4 * vocab * hidden}
    if bias:
        buffers["grad_bias accumulator, fp32 [V]"] = 4 * vocab
    if schedule == "one_pass":
        rows = min(n_valid, max(1, one_pass_capacity(vocab, logits_bytes)))
        buffers["chunk logits, fp32 [chunk, V]"] = 4 * rows * stored_logits_row_stride(vocab)
        buffers["chunk hidden rows + chunk grad_hidden [chunk, H]"] = 2 * element_size * rows * hidden
        plan = plan_backward(rows, vocab, hidden, element_size, block_m, workspace_bytes, store_dlogits=True,
                             need_bias_grad=bias, need_hidden_grad=True)  # fmt: skip
    elif schedule == "two_pass":
        buffers["valid hidden rows [N, H] (when tokens are masked)"] = element_size * n_valid * hidden if masked else 0
        plan = plan_backward(n_valid, vocab, hidden, element_size, block_m, workspace_bytes, store_dlogits=True,
                             need_bias_grad=bias, need_hidden_grad=True)  # fmt: skip
    else:
        raise ValueError(f"schedule must be 'one_pass', 'two_pass' or 'low_memory', got {schedule!r}")
    buffers["dz slab [rows, V_pad] + fp32 grad_hidden rows"] = plan.workspace_bytes
    buffers["per-token vectors (O(N) bound)"] = PER_TOKEN_BYTES * n_valid
    return ScheduleMemory(schedule, buffers, sum(buffers.values()))


def prefer_low_memory(chosen: str, n_valid: int, hidden: int, vocab: int, element_size: int, *, bias: bool,
                      masked: bool, goal: int = EXTRA_MEMORY_GOAL) -> bool:  # fmt: skip
    """Whether "auto" takes the low-memory schedule instead of `chosen` ("one_pass" or "two_pass"): the
    chosen schedule's modelled peak extra exceeds `goal` and the low-memory one's is smaller.

    Why memory decides (README.md beside ops/lm_head, "Memory and bytes moved per schedule"): where the
    fp32 [V, H] accumulator breaks the goal (V x H large), the one-pass schedule's saved GEMM unit and the
    V x H traffic the accumulator costs per chunk are about the same time by the bandwidth / FLOP model
    (Qwen3-8B head: ~26 ms against ~25 ms at 16k tokens, ~103 against ~104 at 64k), while the peak is 5x
    smaller. Below the goal (small heads, frozen heads) nothing changes."""
    if chosen not in ("one_pass", "two_pass"):
        return False
    current = schedule_memory(chosen, n_valid, hidden, vocab, element_size, bias=bias, masked=masked)
    if current.peak_extra <= goal:
        return False
    low = schedule_memory("low_memory", n_valid, hidden, vocab, element_size, bias=bias, masked=masked)
    return low.peak_extra < current.peak_extra
