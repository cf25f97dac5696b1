"""Comparisons that report the worst element (index, expected, got) so a failure says where to look.

Tolerances follow the house rule: compare against PyTorch's own error in the same dtype, with a
float64 (or fp32) computation as ground truth.
"""

from __future__ import annotations

import torch


def worst_element(got: torch.Tensor, expected: torch.Tensor) -> str:
    got64, exp64 = got.detach().double(), expected.detach().double()
    if got64.shape != exp64.shape:
        return f"shape mismatch: got {tuple(got64.shape)}, expected {tuple(exp64.shape)}"
    if got64.numel() == 0:
        return "empty"
    diff = (got64 - exp64).abs()
    diff = torch.where(torch.isnan(got64) != torch.isnan(exp64), torch.full_like(diff, float("inf")), diff)
    diff = torch.nan_to_num(diff, nan=0.0)
    flat = int(diff.reshape(-1).argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got64.shape)) if got64.dim() else ()
    return (
        f"worst |diff| = {diff.reshape(-1)[flat].item():.3e} at index {idx}: "
        f"expected {exp64.reshape(-1)[flat].item():.10g}, got {got64.reshape(-1)[flat].item():.10g}"
    )


def assert_close(name: str, got: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float) -> None:
    """Elementwise |got - expected| <= atol + rtol |expected|, NaN only where expected is NaN."""
    got64, exp64 = got.detach().double(), expected.detach().double()
    if got64.shape != exp64.shape:
        raise AssertionError(f"{name}: shape {tuple(got64.shape)} != expected {tuple(exp64.shape)}")
    nan_mismatch = torch.isnan(got64) != torch.isnan(exp64)
    ok = ((got64 - exp64).abs() <= atol + rtol * exp64.abs()) | (torch.isnan(got64) & torch.isnan(exp64))
    if bool(nan_mismatch.any()) or not bool(ok.all()):
        raise AssertionError(f"{name}: not close (atol={atol}, rtol={rtol}); {worst_element(got, expected)}")


def assert_no_worse_than(
    name: str,
    got: torch.Tensor,
    baseline: torch.Tensor,
    ground_truth: torch.Tensor,
    *,
    factor: float = 2.0,
    floor: float = 0.0,
) -> None:
    """max |got - truth| <= factor * max |baseline - truth| + floor.

    `baseline` is PyTorch's own computation in the same dtype (the error users already accept);
    `ground_truth` a float64 computation from the same (rounded) inputs.
    """
    err = (got.detach().double() - ground_truth.detach().double()).abs().max().item()
    base = (baseline.detach().double() - ground_truth.detach().double()).abs().max().item()
    if not err <= factor * base + floor:
        raise AssertionError(
            f"{name}: error {err:.3e} exceeds {factor} x PyTorch's same-dtype error {base:.3e} + {floor:.1e}; "
            f"{worst_element(got, ground_truth)}"
        )
