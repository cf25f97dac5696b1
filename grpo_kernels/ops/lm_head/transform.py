"""The logit transform between the GEMM and the softmax: a scale and Gemma-style soft-capping.

    x = hidden @ W^T + b,   z = c tanh(s x / c) / T   (softcap c),   or   z = s x / T   (no cap)

s is the logit scale (Granite's logits are x / logits_scaling: s = 1 / logits_scaling; TRL's logit_scale),
c the soft cap (Gemma 2 / 3 `final_logit_softcapping`, applied to the model's logits before the sampling
temperature T, as transformers and TRL do). Without a cap the scale is a temperature: T / s. With one the
backends compute z = cap_out tanh(cap_in x), cap_in = s / c, cap_out = c / T, in the GEMM's epilogue, and
the backward multiplies dL/dz by dz/dx = cap_in cap_out (1 - tanh^2) per element (README.md, "Soft-capping").
"""

from __future__ import annotations


def gradient_factor(inv_temperature: float, softcap=None) -> float:
    """The constant that multiplies the upstream gradients in dL/dx: 1 / T, or with a soft cap (cap_in, cap_out)
    the constant cap_in cap_out of dz/dx = cap_in cap_out (1 - tanh^2) (cap_out carries T: the backends take
    1 / T = 1 there). The fp16 dz scale is sized with it, and csrc's kernel C folds it into its per-token
    coefficients, leaving 1 - tanh^2 per logit."""
    if softcap is None:
        return float(inv_temperature)
    return float(softcap[0]) * float(softcap[1])


class LogitTransform:
    """A backend module's lm_head_forward / lm_head_backward with a logit scale and an optional soft cap."""

    def __init__(self, inner, softcap: float | None, logit_scale: float):
        self.inner, self.softcap, self.logit_scale = inner, softcap, float(logit_scale)
        self.__name__ = f"{inner.__name__} (logit scale {logit_scale:g}, softcap {softcap})"

    def _args(self, temperature: float):
        if self.softcap is None:
            return temperature / self.logit_scale, {}
        c = float(self.softcap)
        return temperature, {"softcap": (self.logit_scale / c, c / temperature)}

    def lm_head_forward(self, hidden, weight, bias, targets, temperature, **kwargs):
        t, extra = self._args(temperature)
        return self.inner.lm_head_forward(hidden, weight, bias, targets, t, **extra, **kwargs)

    def lm_head_backward(self, hidden, weight, bias, targets, temperature, *args, **kwargs):
        t, extra = self._args(temperature)
        return self.inner.lm_head_backward(hidden, weight, bias, targets, t, *args, **extra, **kwargs)
