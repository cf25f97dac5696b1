"""Input validation helpers for the public functions (the functional layer is the only caller).

Every error names the argument, what was expected and what was given; value checks report the worst
element so a user can find it in their batch.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def fail(message: str) -> None:
    raise ValueError(message)


class DeviceChecks:
    """The value checks of one call, computed on the device and read with the call's one host read.

    Each check is a 0-d bool tensor (True: it fails) made by device operations, and the eager check that
    raises its error (today's message: the count, the first offender and its value); the eager checks run
    only when a flag says a check failed, in the order added, so an error has the message and the precedence
    it had when every check read its own flag. `read` makes the one copy to the host: the flags with the
    values the caller needs there (the batch's layout, tensor normalizers), one wait for the device per call
    instead of one per check. The inputs are read by no kernel before it: a failing call raises before any
    heavy work, as before. A check that raises at once (a shape, a dtype) after device checks were added
    yields to the first of them that fails (`earlier`, read on that failing path only): the old precedence."""

    def __init__(self):
        self.flags: list[torch.Tensor] = []
        self.eager: list = []
        self.done = False  # read: every flag was clear

    def add(self, failed: torch.Tensor, eager) -> None:
        self.flags.append(failed.reshape(()))
        self.eager.append(eager)

    def _first_failure(self, flags: list) -> ValueError | None:
        for failed, eager in zip(flags, self.eager):
            if failed:
                try:
                    eager()
                except ValueError as error:
                    return error
                raise AssertionError("grpo_kernels: a device check failed but its eager check passed")  # pragma: no cover
        return None

    def earlier(self, exc: BaseException) -> BaseException:
        """`exc` raised during validation: the error of a device check added before it that fails (the one the
        call raised when each check read its own flag), else `exc`."""
        if self.done or not self.flags:
            return exc
        error = self._first_failure(torch.stack(self.flags).tolist())
        if error is None:
            return exc
        error.__suppress_context__ = True  # raised in exc's place, not while handling it
        return error

    def read(self, *values: torch.Tensor) -> list[list]:
        """The one host read: the flags and `values` (numeric tensors, any shape) in one copy; raises the first
        failing check's error; else returns each value flattened to a Python list (int for integer dtypes)."""
        parts = ([torch.stack(self.flags)] if self.flags else []) + [v.reshape(-1) for v in values]
        # the parts on the device in one copy; a part already on the host (a CPU normalizer next to CUDA inputs)
        # is read where it is: moving it to the device first would be a copy that waits for the device too
        on_device = [p for p in parts if p.device.type != "cpu"] or parts
        read = iter(torch.cat([p.to(dtype=torch.float64) for p in on_device]).tolist() if on_device else [])
        host = []  # exact in float64: the layout's offsets and counts are < 2^53
        for p in parts:
            host += [next(read) for _ in range(p.numel())] if any(p is q for q in on_device) else \
                p.to(torch.float64).tolist()  # fmt: skip
        error = self._first_failure(host[: len(self.flags)])
        if error is not None:
            raise error
        self.done = True
        out, at = [], len(self.flags)
        for v in values:
            part = host[at:at + v.numel()]
            out.append([int(x) for x in part] if not v.is_floating_point() else part)
            at += v.numel()
        return out


def check_tensor(name: str, x, *, dtypes=None, ndim=None) -> None:
    if not isinstance(x, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        fail(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if ndim is not None and x.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        fail(f"{name} must have {ndim} dimension(s), got shape {tuple(x.shape)}")


def check_same_device(**tensors) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    for name, value in present.items():  # a numpy array or a list has no torch device: say what is expected
        if not isinstance(value, torch.Tensor):
            fail(f"{name} must be a torch.Tensor, got {type(value).__module__}.{type(value).__name__}")
        if value.device.type == "meta":
            fail(f"{name} is on the meta device (it has no values): pass a cpu or cuda tensor")
    devices = {k: v.device for k, v in present.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            fail(f"{name} is on {device} but {first_name} is on {first}: all tensors must share one device")
    return first


def check_shape(name: str, x: torch.Tensor, shape: tuple, ref_name: str) -> None:
    if tuple(x.shape) != tuple(shape):
        fail(f"{name} must have the shape of {ref_name} {tuple(shape)}, got {tuple(x.shape)}")


def _bad_of_minmax(lo: torch.Tensor, hi: torch.Tensor, allow_neg_inf: bool) -> torch.Tensor:
    """Non-finite from a minimum and maximum (NaN propagates into both): NaN or +inf, or -inf unless allowed."""
    if allow_neg_inf:
        return torch.isnan(lo) | torch.isnan(hi) | (hi == float("inf"))
    return ~(torch.isfinite(lo) & torch.isfinite(hi))


def _bad_elements(x: torch.Tensor, allow_neg_inf: bool) -> torch.Tensor:
    return torch.isnan(x) | (x == float("inf")) if allow_neg_inf else ~torch.isfinite(x)


def check_finite(name: str, x: torch.Tensor, where: torch.Tensor | None = None, allow_neg_inf: bool = False,
                 checks: DeviceChecks | None = None) -> None:
    """NaN / inf anywhere `where` is true (default: everywhere) is an error showing the first offender.
    allow_neg_inf: -inf is allowed (a bias that forbids tokens: p = 0 for them).

    Memory: a float tensor of 2+ dims is checked by its minimum and maximum (NaN propagates into both):
    the whole tensor at once without `where` (O(1) extra: no weight-sized temporary), per row with a row
    mask (`where` of shape [..., 1]: O(rows)). Other shapes (per-token vectors) elementwise. Only a failing
    check looks further, one row at a time, for the count and the first offender. One host sync, or, with
    `checks`, none: the flag joins the call's one read (DeviceChecks) and this eager check runs on failure."""
    if x.numel() == 0:
        return
    rowwise = x.dim() >= 2 and x.is_floating_point() and (where is None or (where.dim() == x.dim() and where.shape[-1] == 1))
    if checks is not None:
        if not rowwise:
            bad = _bad_elements(x, allow_neg_inf)
            failed = (bad if where is None else bad & where).any()
        elif where is None:
            failed = _bad_of_minmax(*torch.aminmax(x), allow_neg_inf)
        else:
            lo, hi = torch.aminmax(x, dim=-1)
            failed = (_bad_of_minmax(lo, hi, allow_neg_inf) & where[..., 0]).any()
        checks.add(failed, lambda: check_finite(name, x, where, allow_neg_inf))
        return
    if not rowwise:
        bad = _bad_elements(x, allow_neg_inf)
        if where is not None:
            bad = bad & where
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            _fail_finite(name, x, int(bad.sum()), idx)
        return
    if where is None:
        lo, hi = torch.aminmax(x)
        if not bool(_bad_of_minmax(lo, hi, allow_neg_inf)):
            return
        rows_where = None
    else:
        lo, hi = torch.aminmax(x, dim=-1)  # [...] per row
        bad_rows = _bad_of_minmax(lo, hi, allow_neg_inf) & where[..., 0]
        if not bool(bad_rows.any()):
            return
        rows_where = where[..., 0]
    # failing: find the bad rows by their min / max (O(rows)), then count within those rows only
    flat = x.reshape(-1, x.shape[-1])
    row_lo, row_hi = torch.aminmax(flat, dim=-1)
    bad_rows = _bad_of_minmax(row_lo, row_hi, allow_neg_inf)
    if rows_where is not None:
        bad_rows = bad_rows & rows_where.reshape(-1)
    count, first = 0, None
    for r in bad_rows.nonzero().squeeze(-1).tolist():
        bad = _bad_elements(flat[r], allow_neg_inf)
        if first is None:
            first = r * flat.shape[1] + int(bad.nonzero()[0])
        count += int(bad.sum())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), x.shape))
    _fail_finite(name, x, count, idx)


def _fail_finite(name: str, x: torch.Tensor, count: int, idx: tuple) -> None:
    fail(
        f"{name} has {count} non-finite value(s) at trained positions; first at index {idx}: "
        f"{x[idx].item()} (pass check_finite=False to skip this check)"
    )


def check_mask(name: str, mask: torch.Tensor, checks: DeviceChecks | None = None) -> torch.Tensor:
    """Bool masks pass; integer / float masks must hold only 0 and 1. Returns the bool mask. With `checks`
    the values are checked in the call's one read (DeviceChecks)."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        bad = (mask != 0) & (mask != 1)
        if checks is not None:
            checks.add(bad.any(), lambda: check_mask(name, mask))
        elif bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            fail(f"{name} must hold only 0 and 1 (or be bool); found {mask[idx].item()} at index {idx}")
        return mask != 0
    fail(f"{name} must be bool or hold 0/1, got dtype {mask.dtype}")


def check_targets(name: str, targets: torch.Tensor, vocab_size: int, valid: torch.Tensor,
                  checks: DeviceChecks | None = None) -> None:
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        fail(f"{name} must be an integer tensor of token ids, got {targets.dtype}")
    bad = ((targets < 0) | (targets >= vocab_size)) & valid
    if checks is not None:
        checks.add(bad.any(), lambda: check_targets(name, targets, vocab_size, valid))
    elif bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        fail(
            f"{name} has {int(bad.sum())} id(s) outside [0, {vocab_size}) at trained positions; first at "
            f"index {idx}: {targets[idx].item()}"
        )


def check_global_count(name: str, value, local: int, what: str) -> None:
    """A global normalizer (num_tokens / num_sequences) counts the whole optimizer step: never fewer than
    what this call alone holds."""
    if value is None:
        return
    value = value.item() if isinstance(value, torch.Tensor) else value
    if value < local:
        fail(
            f"{name}={value:g} is fewer than the {local} {what} of this call: it must count the whole optimizer "
            "step (every micro-batch of every data-parallel rank), or be left out (None) for local counts"
        )


def check_count(name: str, value, *, integer: bool = False, minimum: float | None = 1, meaning: str = "") -> None:
    """A normalizer: None, or a finite number (or 1-element tensor), a whole number where `integer`, at least
    `minimum`, or > 0 when minimum is None. Refused otherwise, naming it (and what it means)."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            fail(f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(f"{name} must be a number, got {type(value).__name__}")
    bound = "> 0" if minimum is None else f">= {minimum}"
    kind = "a whole number" if integer else "a finite number"
    if not math.isfinite(value) or (integer and int(value) != value):
        fail(f"{name} must be {kind} {bound}{meaning}, got {value:g}")
    if not (value > 0 if minimum is None else value >= minimum):
        fail(f"{name} must be {kind} {bound}{meaning}, got {value:g}")  # :g: 2 and 2.0 alike


def cu_seqlens_to_index(cu_seqlens: torch.Tensor, n_tokens: int, checks: DeviceChecks | None = None) -> torch.Tensor:
    """Validated cu_seqlens [S+1] (0 = start, n_tokens = end, non-decreasing) -> seq_index [N]. With `checks`
    the offsets are checked in the call's one read (DeviceChecks) and seq_index is made without a host read
    (a search of each token's offset: defined, if meaningless, for offsets that then fail the check)."""
    check_tensor("cu_seqlens", cu_seqlens, ndim=1)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        fail(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.numel() < 2:
        fail(f"cu_seqlens must hold at least 2 offsets (one sequence), got {cu_seqlens.numel()}")
    cu = cu_seqlens.long()
    if checks is not None:
        failed = (cu[0] != 0) | (cu[-1] != n_tokens) | (cu[1:] < cu[:-1]).any()
        checks.add(failed, lambda: cu_seqlens_to_index(cu_seqlens, n_tokens))
        # token t belongs to the sequence s with cu[s] <= t < cu[s + 1] (empty sequences hold no token): the
        # number of offsets cu[1:] at or below t, as repeat_interleave(arange(S), lengths) gives it
        tokens = torch.arange(n_tokens, device=cu.device)
        return torch.searchsorted(cu[1:], tokens, right=True).clamp_(max=cu.numel() - 2)
    if int(cu[0]) != 0 or int(cu[-1]) != n_tokens:
        fail(f"cu_seqlens must start at 0 and end at the token count {n_tokens}, got {int(cu[0])}..{int(cu[-1])}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        i = int((lengths < 0).nonzero()[0])
        fail(f"cu_seqlens must be non-decreasing; offset {i + 1} ({int(cu[i + 1])}) < offset {i} ({int(cu[i])})")
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
