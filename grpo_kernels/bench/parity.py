"""The correctness gate run on the benchmark inputs before anything is timed.

For every output a provider returns (log-probs, entropy, loss, gradients):
  error     = ||out - truth||_2 / ||truth||_2  (a scalar loss: |out - truth| / |truth|)
  yardstick = the same error of PyTorch's own computation in the benchmark dtype (oracle.same_dtype)
  pass      iff error <= max(ERROR_FACTOR * yardstick, ERROR_FLOOR[dtype]) and out is finite.
The norm-wise error (FLA's assert_close ratio) judges a bf16 kernel by its typical element; the worst
element is still reported. ERROR_FACTOR is loose on purpose: the gate rejects wrong semantics (a
missing term, a wrong normaliser: errors of order 1e-2 to 1) and broken kernels, not rounding choices
(bf16 accumulation across chunks costs a peer a factor of a few against PyTorch's single rounding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

ERROR_FACTOR = 8.0
ERROR_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


@dataclass
class TensorCheck:
    name: str
    error: float  # relative L2 error against the fp32 truth
    yardstick: float  # PyTorch's own same-dtype relative error
    tolerance: float
    passed: bool
    worst: str  # the worst element: index, truth, output

    @property
    def ratio(self) -> float:  # error in units of PyTorch's own error
        return self.error / self.yardstick if self.yardstick > 0 else float("inf") if self.error > 0 else 0.0


@dataclass
class ParityResult:
    passed: bool
    checks: list[TensorCheck]

    def summary(self) -> str:
        if not self.checks:
            return "nothing compared"
        if not self.passed:
            bad = [c for c in self.checks if not c.passed]
            return "FAIL " + "; ".join(f"{c.name} {c.error:.2e} > {c.tolerance:.2e}" for c in bad)
        worst = max(self.checks, key=lambda c: c.error / c.tolerance)
        finite = [c.ratio for c in self.checks if c.yardstick > 0]
        if not finite:  # PyTorch's same-dtype result is the reference itself (loss_head)
            return f"pass (err {worst.error:.1e} <= {worst.tolerance:.0e})"
        return f"pass {max(finite):.2g}x torch"

    def failure_message(self) -> str:
        return "\n".join(
            f"  {c.name}: error {c.error:.3e} vs tolerance {c.tolerance:.3e} "
            f"(PyTorch same-dtype {c.yardstick:.3e}); {c.worst}"
            for c in self.checks
            if not c.passed
        )

    def as_dict(self) -> dict:
        return {
            "passed": self.passed,
            "checks": [{**asdict(c), "ratio_to_torch": c.ratio} for c in self.checks],
        }


def relative_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    out32, truth32 = out.detach().float().reshape(-1), truth.detach().float().reshape(-1)
    if not bool(torch.isfinite(out32).all()):
        return float("inf")
    if truth32.numel() == 1:
        return abs(out32.item() - truth32.item()) / max(abs(truth32.item()), 1e-30)
    return (
        torch.linalg.vector_norm(out32 - truth32) / torch.linalg.vector_norm(truth32).clamp(min=1e-30)
    ).item()


def worst_element(out: torch.Tensor, truth: torch.Tensor) -> str:
    out32, truth32 = out.detach().float().reshape(-1), truth.detach().float().reshape(-1)
    diff = torch.nan_to_num((out32 - truth32).abs(), nan=float("inf"))
    flat = int(diff.argmax())
    index = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(truth.shape)))
        if truth.dim()
        else ()
    )
    return (
        f"worst |diff| {diff[flat].item():.3e} at {index}: truth {truth32[flat].item():.7g}, "
        f"got {out32[flat].item():.7g}"
    )


def check_outputs(outputs: dict, truth: dict, yardstick: dict, names: tuple[str, ...], dtype) -> ParityResult:
    checks = []
    for name in names:
        if name not in outputs or outputs[name] is None:
            continue
        out, gt = outputs[name], truth[name]
        if tuple(out.shape) != tuple(gt.shape):
            if out.numel() != gt.numel():
                mismatch = f"shape {tuple(out.shape)} != truth {tuple(gt.shape)}"
                checks.append(TensorCheck(name, float("inf"), 0.0, 0.0, False, mismatch))
                continue
            out = out.reshape(gt.shape)
        error = relative_error(out, gt)
        base = relative_error(yardstick[name], gt)
        tolerance = max(ERROR_FACTOR * base, ERROR_FLOOR[dtype])
        checks.append(TensorCheck(name, error, base, tolerance, error <= tolerance, worst_element(out, gt)))
    return ParityResult(bool(checks) and all(c.passed for c in checks), checks)
