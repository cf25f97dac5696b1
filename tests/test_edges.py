"""Numbers at the edges (grpo_kernels/ops/lm_head/README.md, "Numbers at the edges"), both backends against
float64 (the Triton kernels under the interpreter, tests/_edges_cases.py in a subprocess):

* the soft cap for caps 1 ... 1e30 (1e35 refused) and logit scales 1e-3 ... 1e3: log-prob and entropy errors within fp32
  rounding of the logits plus the softmax sum's (eps (8 (1 + max |z|) + V)), on both backends; the
  scalars the kernels cannot represent are refused before any work, naming the limit;
* a row whose every token is forbidden: refused by the default check, and without it the same values
  (uniform over V) and gradients on both backends;
* fp16 dz: gradients whose dL/dz entries lie below fp16's range equal the torch backend's to fp16
  rounding (no entry the output dtype can hold comes back 0).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk

HERE = Path(__file__).resolve().parent
EPS32 = torch.finfo(torch.float32).eps
V = 203  # the vocabulary of the cases' batch


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE.parent))
    proc = subprocess.run([sys.executable, str(HERE / "_edges_cases.py")], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.interpreter
def test_softcap_is_accurate_for_any_cap_on_both_backends(report):
    """fp32 logits carry a relative error of a few ulp (the capped tanh now too: README derivation), the
    softmax sums V terms: |error| <= eps (8 (1 + max|z|) + V). The old exp-form tanh failed this from a cap
    of 1e3 (an error of cap x eps)."""
    wrong, refused = [], []
    for key, row in report["softcap"].items():
        tol = EPS32 * (8 * (1 + row["z_max"]) + V)
        for backend in ("torch", "triton"):
            if isinstance(row[backend], str):
                refused.append((key, backend, row[backend]))
                continue
            for what, err in zip(("logprobs", "entropy"), row[backend]):
                if not err <= tol:
                    wrong.append(f"{key} {backend} {what}: |error| {err:.3g} > {tol:.3g}")
    assert not wrong, "\n".join(wrong)
    # only the cap beyond the logit limit is refused (1e35 / 0.8 > 2^100), at every scale, on both backends
    assert {k for k, _, _ in refused} == {f"scale={s:g},cap=1e+35" for s in (1e-3, 1.0, 1e3)}, refused
    assert len(refused) == 6
    assert all("softcap / temperature = 1.25e+35 exceeds 2^100 = 1.27e+30" in msg for _, _, msg in refused)


@pytest.mark.interpreter
def test_all_forbidden_row_is_the_same_on_both_backends(report):
    """Without the check: every logit is the forbidden-token sentinel, so the row is uniform over V on both
    backends (log-prob -log V, entropy log V, to fp32 rounding of log V) and their gradients agree."""
    rows = report["forbidden"]
    log_v = rows["log_v"]
    for backend in ("torch", "triton"):
        for lp, ent in zip(rows[backend]["logprobs"], rows[backend]["entropy"]):
            assert abs(lp + log_v) <= 4 * EPS32 * log_v and abs(ent - log_v) <= 4 * EPS32 * log_v, (backend, lp, ent)
    for name in ("grad_hidden", "grad_weight"):
        a, b = torch.tensor(rows["torch"][name]), torch.tensor(rows["triton"][name])
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), name
        # fp32 sums over V = 203 (grad_hidden) or 9 tokens (grad_weight) of terms up to the largest element
        assert (a - b).abs().max() <= EPS32 * V * a.abs().max(), (name, float((a - b).abs().max()))


@pytest.mark.interpreter
def test_fp16_dz_keeps_what_the_torch_backend_keeps(report):
    """fp16 inputs, upstream gradients 1, 1e-3, 1e-5 (dz down to ~1e-12, below fp16's 6e-8). Error bound
    against float64, relative to the largest gradient: fp16 rounding of dz and of the output (4 units of
    2^-11) plus the output's subnormal step 2^-24 / largest. Unscaled, the Triton backend flushed 2 % of
    grad_weight's entries to 0 at 1e-5 (6e-3 worst error) where the torch backend kept them."""
    for upstream, rows in report["fp16_dz"].items():
        for backend in ("torch", "triton"):
            for name, r in rows[backend].items():
                tol = 4 * 2.0**-11 + 2.0**-24 / r["largest"]
                assert r["worst_over_largest"] <= tol, (upstream, backend, name, r, tol)
                assert r["zeroed"] == 0.0, (upstream, backend, name, r)


def _call(**kwargs):
    g = torch.Generator().manual_seed(0)
    args = dict(hidden=torch.randn(4, 8, generator=g), weight=torch.randn(11, 8, generator=g),
                targets=torch.tensor([0, 3, 5, 10]), backend="torch")  # fmt: skip
    args.update(kwargs)
    return gk.fused_linear_logprobs(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(softcap=1e37), r"softcap / temperature = 1e\+37 exceeds 2\^100 = 1.27e\+30"),
    (dict(softcap=1e30, temperature=0.5), r"softcap / temperature = 2e\+30 exceeds 2\^100"),
    (dict(softcap=1e30, logit_scale=1e-9), r"logit_scale / softcap = 1e-39 is outside \[2\^-126, 2\^100\]"),
    (dict(softcap=1e-30, logit_scale=1e10), r"logit_scale / softcap = 1e\+40 is outside"),
    (dict(logit_scale=1e37), r"logit_scale / temperature = 1e\+37 exceeds 2\^100"),
    (dict(logit_scale=1e30), r"logit_scale / temperature = 1e\+30 times the bound .* exceeds 2\^100"),
    (dict(bias=torch.full((11,), -math.inf)), r"bias is -inf for all 11 tokens: every token is forbidden"),
])  # fmt: skip
def test_scalars_beyond_the_limits_are_refused_before_the_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _call(**kwargs)


def test_scalars_within_the_limits_give_finite_results():
    """At the limits' edge (and with a capped all -inf bias: every logit -softcap / T, a uniform row) nothing
    is NaN; a large scale whose logits stay bounded is taken."""
    for kwargs in (dict(softcap=1e30), dict(softcap=1e29, logit_scale=1e-3),
                   dict(logit_scale=1e29, hidden=torch.full((4, 8), 1e-8)),
                   dict(softcap=30.0, bias=torch.full((11,), -math.inf))):  # fmt: skip
        out = _call(**kwargs)
        assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.entropy).all(), kwargs
    uniform = _call(softcap=30.0, bias=torch.full((11,), -math.inf))
    torch.testing.assert_close(uniform.entropy, torch.full((4,), math.log(11)), rtol=4 * EPS32, atol=0)


RECORD = HERE.parent / "docs" / "records" / "softcap_accuracy.json"
TABLE_CAPS = (("1", "1"), ("1e2", "100"), ("1e4", "10000"), ("1e6", "1e+06"), ("1e8", "1e+08"))
TABLE_WIDE = ("1e+10", "1e+15", "1e+20", "1e+25", "1e+30")


def softcap_table(record: dict) -> str:
    """The LM-head README's soft-cap error table, from docs/records/softcap_accuracy.json (logit scale 1)."""
    def cell(rows):
        lp = max(r[0] for r in rows)
        ent = max(r[1] for r in rows)
        return f"{lp:.2g} / {ent:.2g}"

    lines = ["| cap | torch | Triton before | Triton now |", "|---|---|---|---|"]
    groups = [(label, [key]) for label, key in TABLE_CAPS] + [("1e10 … 1e30", list(TABLE_WIDE))]
    for label, keys in groups:
        names = [f"scale=1,cap={k}" for k in keys]
        lines.append(f"| {label} | {cell([record['after'][n]['torch'] for n in names])} | "
                     f"{cell([record['before'][n]['triton'] for n in names])} | "
                     f"{cell([record['after'][n]['triton'] for n in names])} |")  # fmt: skip
    return "\n".join(lines)


def test_readme_softcap_table_is_the_record():
    """The README's table is generated from the record (never typed); the record's 'after' columns are
    within the bound test_softcap_is_accurate_for_any_cap_on_both_backends enforces on a live run."""
    record = json.loads(RECORD.read_text())
    readme = (HERE.parent / "grpo_kernels" / "ops" / "lm_head" / "README.md").read_text()
    assert softcap_table(record) in readme, softcap_table(record)
    for key, row in record["after"].items():
        if isinstance(row["triton"], str) or isinstance(row["torch"], str):
            continue
        assert max(row["triton"] + row["torch"]) <= EPS32 * (8 * (1 + row["z_max"]) + V), key
