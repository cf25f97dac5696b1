"""grad_weight's error per accumulation schedule, against float64, simulated on CPU at the target head.

    python benchmarks/grad_weight_error.py            # N = 16384 and 65536, H = 4096, V = 151936 (~3 min, 2 cores)
    python benchmarks/grad_weight_error.py --quick    # N = 2048, printed only (seconds)

writes docs/records/grad_weight_error.json; the README's error table and the chunk-count bound "auto" uses
(grpo_kernels/ops/fused/accuracy.py) come from it, and tests/test_readme_records.py checks both.

What is emulated, rounding by rounding, per token t and vocabulary row v (GRPO / DAPO on-policy, entropy
coefficient 0, so dL/dlogit = g_t (1[v = y_t] - p_tv) with g_t = dL/dlogp_t):

  float64        p from the float64 logits, dz and grad_weight = dz^T X in float64 (the truth)
  fp32 acc       the one_pass schedule: fp32 logits (kernel A) and fp32 lse, dz formed in fp32 and rounded
                 once to bf16 (the dz slab), grad_weight accumulated in fp32 chunk by chunk (cuBLAS, fp32
                 output), rounded once to bf16 at the end
  bf16 in place  the one_pass_inplace schedules: the same dz, but after each chunk the gradient buffer
                 itself (bf16) holds the sum: G <- bf16(G + dz_c^T X_c), the chunk's GEMM summing in fp32
                 (cuBLAS addmm into a bf16 C: fp32 epilogue alpha AB + beta C, one rounding per chunk)
  PyTorch bf16   plain autograd through bf16 logits (the usual TRL path): logits rounded to bf16,
                 log_softmax computed in fp32 from them and its output rounded to bf16, g rounded to bf16,
                 the log_softmax backward g 1[v = y] - exp(logp) g in fp32 rounded to bf16, grad_weight one
                 GEMM over all N tokens (fp32 sum) rounded once to bf16
  bf16 floor     the float64 grad_weight rounded once to bf16 (no bf16 gradient can do better)

The data model (no checkpoint at this size fits a 2-core CI machine): per token a Gaussian background of
std s_t ~ U(1, 3) over all V entries and one preferred token whose logit sits m_t ~ U(-1, 7) above the
background's log-sum-exp (p(preferred) from 0.27 to 0.999: confident and uncertain tokens, as a
policy's); the preferred token is drawn from a Zipf law over the vocabulary (P(rank k) ~ 1 / (k + 1),
rank = row id), so frequent tokens are targets in every chunk, as in text; the target is sampled from the
float64 softmax. Hidden rows X ~ N(0, 1) in bf16; g_t = -A_seq / N with sequences of 512 tokens and
advantages A ~ N(0, 1). Everything but the data model is the kernels' arithmetic; the forward GEMM's own
fp32 rounding (~1e-7 relative) is below every effect measured, so logits enter as values rounded once to
fp32 (kernel A's output; its lse likewise) or to bf16 (PyTorch's).

Why a slice of rows and columns is enough: grad_weight[v, h] = sum_t dz[t, v] X[t, h]. Given the tokens'
statistics (lse, target, g) the rows are independent, and the columns h are i.i.d. given dz. The squared
errors and squared norms summed over all V rows are estimated without bias from the slice (Horvitz-
Thompson): the ROWS_TOP most frequent rows in full (they carry most of the norm) plus ROWS_SAMPLED rows
drawn uniformly from the rest, weighted by (V - ROWS_TOP) / ROWS_SAMPLED; the record gives the estimate
from each half of the sampled rows as its spread. The softmax is over all V entries: the background
outside the slice enters every normalizer and the target sampling with its expected mass
(V - rows - 1) exp(s_t^2 / 2) (a drawn sum differs from it by up to ~20 % at s_t = 3, which changes the
modelled distribution, not how each schedule rounds it; the bf16 rounding of those logits averages out
over 150k terms), and the preferred token wherever it lands.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

VOCAB, HIDDEN = 151936, 4096
SEQ_LEN = 512
TOKEN_BLOCK = 2048  # tokens drawn at once
ROWS_TOP, ROWS_SAMPLED = 1024, 2048
RECORD = Path(__file__).resolve().parents[1] / "docs" / "records" / "grad_weight_error.json"


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


def zipf_rank(n: int, gen: torch.Generator) -> torch.Tensor:
    """n draws from P(k) ~ 1 / (k + 1), k in [0, V): inverse CDF of the continuous law on [1, V + 1)."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return (torch.exp(u * math.log(VOCAB + 1.0)) - 1.0).floor().long().clamp(0, VOCAB - 1)


def simulate(n_tokens: int, chunks: list[int], rows_top: int, rows_sampled: int, cols: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sampled = rows_top + torch.randperm(VOCAB - rows_top, generator=gen)[:rows_sampled]
    slice_rows = torch.cat([torch.arange(rows_top), sampled.sort().values])  # [R] vocabulary ids
    n_rows = slice_rows.numel()
    where_in_slice = torch.full((VOCAB,), -1, dtype=torch.long)
    where_in_slice[slice_rows] = torch.arange(n_rows)
    rest = VOCAB - n_rows - 1  # background entries outside the slice (one of V is the preferred token)
    x = bf16(torch.randn(n_tokens, cols, generator=gen))
    x64 = x.double()
    advantages = torch.randn(-(-n_tokens // SEQ_LEN), generator=gen, dtype=torch.float64)
    g64 = -advantages.repeat_interleave(SEQ_LEN)[:n_tokens] / n_tokens  # dL/dlogp (token-mean)
    truth = torch.zeros(n_rows, cols, dtype=torch.float64)
    dz_kernel, dz_torch, entropy = [], [], []
    for t0 in range(0, n_tokens, TOKEN_BLOCK):
        n = min(TOKEN_BLOCK, n_tokens - t0)
        idx = torch.arange(n)
        s = 1.0 + 2.0 * torch.rand(n, generator=gen, dtype=torch.float64)
        z = torch.randn(n, n_rows, generator=gen, dtype=torch.float64) * s[:, None]
        slot = where_in_slice[zipf_rank(n, gen)]  # the preferred token's column in the slice, or -1
        inside = slot >= 0
        margin = -1.0 + 8.0 * torch.rand(n, generator=gen, dtype=torch.float64)
        rest_mass = rest * torch.exp(s * s / 2)  # E[sum exp(z)] over the background outside the slice
        rest_first = rest * s * s * torch.exp(s * s / 2)  # E[sum exp(z) z] over it
        e = torch.exp(z)
        e_bg = e.sum(1) - torch.where(inside, e[idx, slot.clamp(min=0)], 0.0)
        z_pref = torch.log(e_bg + rest_mass) + margin
        z[idx[inside], slot[inside]] = z_pref[inside]
        e = torch.exp(z)
        outside = rest_mass + torch.where(inside, 0.0, torch.exp(z_pref))  # mass outside the slice
        total = e.sum(1) + outside
        lse64 = torch.log(total)
        probs = torch.cat([e, outside[:, None]], 1) / total[:, None]
        target = torch.multinomial(probs, 1, generator=gen).squeeze(1)  # == n_rows: outside the slice
        mean_z = ((e * z).sum(1) + rest_first + torch.where(inside, 0.0, torch.exp(z_pref) * z_pref)) / total
        entropy.append(lse64 - mean_z)
        onehot = target[:, None] == torch.arange(n_rows)[None, :]
        g = g64[t0:t0 + n]
        truth += (g[:, None] * (onehot.double() - probs[:, :n_rows])).T @ x64[t0:t0 + n]
        # kernels: p from fp32 logits and fp32 lse, dz formed in fp32, rounded once to bf16
        g32 = g.float()
        p32 = torch.exp(z.float() - lse64.float()[:, None])
        dz_kernel.append(bf16(p32 * (-g32[:, None]) + torch.where(onehot, g32[:, None], 0.0)))
        # PyTorch: bf16 logits, log_softmax in fp32 over them, output bf16, bf16 gradient
        zb = bf16(z).double()
        outside_b = rest_mass + torch.where(inside, 0.0, torch.exp(bf16(z_pref).double()))
        lse_b = torch.log(torch.exp(zb).sum(1) + outside_b).float()
        logp_b = bf16(zb.float() - lse_b[:, None])
        gb = bf16(g32).float()[:, None]
        dz_torch.append(bf16(torch.where(onehot, gb, 0.0) - torch.exp(logp_b.float()) * gb))
        del z, e, probs, p32, zb, logp_b, onehot
    dz_kernel, dz_torch = torch.cat(dz_kernel), torch.cat(dz_torch)
    x32 = x.float()

    def accumulate(chunk: int, in_place: bool) -> torch.Tensor:
        acc = torch.zeros(n_rows, cols, dtype=torch.float32)
        for c0 in range(0, n_tokens, chunk):
            part = dz_kernel[c0:c0 + chunk].float().T @ x32[c0:c0 + chunk]  # one GEMM, fp32 sum
            acc = bf16(acc + part).float() if in_place else acc + part
        return acc if in_place else bf16(acc).float()

    results = {"bf16 floor": bf16(truth).double(), "PyTorch bf16": bf16(dz_torch.float().T @ x32).double()}
    for chunk in chunks:
        results[f"fp32 acc, {chunk}-token chunks"] = accumulate(chunk, False).double()
        results[f"bf16 in place, {chunk}-token chunks"] = accumulate(chunk, True).double()

    weight = torch.full((n_rows,), (VOCAB - rows_top) / rows_sampled, dtype=torch.float64)
    weight[:rows_top] = 1.0
    half = torch.zeros(n_rows, dtype=torch.bool)
    half[rows_top:rows_top + rows_sampled // 2] = True

    def rel(g: torch.Tensor, part: int = 0) -> float:
        w = weight.clone()
        if part:  # one half of the sampled rows, reweighted
            w[rows_top:] *= 2.0
            w[half if part == 2 else ~half & (torch.arange(n_rows) >= rows_top)] = 0.0
        err = ((g - truth) ** 2).sum(1) @ w
        ref = (truth**2).sum(1) @ w
        return float((err / ref).sqrt())

    top_share = float((truth[:rows_top] ** 2).sum() / ((truth**2).sum(1) @ weight))
    return {
        "n_tokens": n_tokens,
        "mean_entropy_nats": round(float(torch.cat(entropy).mean()), 3),
        "norm_share_of_top_rows": round(top_share, 3),
        "rel_l2": {k: rel(v) for k, v in results.items()},
        "rel_l2_halves": {k: [rel(v, 1), rel(v, 2)] for k, v in results.items()},
        "chunks": {str(c): -(-n_tokens // c) for c in chunks},
    }


def readme_table(record: dict) -> str:
    """The README's error table, from a record (tests/test_readme_records.py compares the two)."""
    runs = record["runs"]
    head = "| grad_weight, relative L2 error against float64 | " + " | ".join(
        f"N = {r['n_tokens']}" for r in runs) + " |"  # fmt: skip
    lines = [head, "|---|" + "---|" * len(runs)]
    labels = {
        "bf16 floor": "float64 result rounded once to bf16 (the floor)",
        "PyTorch bf16": "plain PyTorch bf16 autograd (bf16 logits, the usual TRL path)",
    }
    fp32_done = False
    for key in runs[0]["rel_l2"]:
        if key in labels:
            label = labels[key]
        elif key.startswith("fp32 acc"):  # the same to 3 digits for every chunking simulated: one row
            if fp32_done:
                first = next(k for k in runs[0]["rel_l2"] if k.startswith("fp32 acc"))
                if any(f"{r['rel_l2'][key]:.2e}" != f"{r['rel_l2'][first]:.2e}" for r in runs):
                    raise ValueError(f"{key} differs from {first}: the table's one fp32 row would hide it")
                continue
            fp32_done = True
            label = "fp32 accumulator, cast once (one_pass, one_pass_cublas; any chunking)"
        else:
            kind, chunk = key.split(", ")
            chunk = chunk.split("-")[0]
            counts = " / ".join(str(r["chunks"][chunk]) for r in runs)
            label = f"in place in bf16 (one_pass_inplace, one_pass_cublas_inplace), {chunk}-token chunks ({counts} chunks)"
        lines.append(f"| {label} | " + " | ".join(f"{r['rel_l2'][key]:.2e}" for r in runs) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1280, 1664, 3328],
                        help="one-pass chunk sizes (valid tokens) to simulate")  # fmt: skip
    parser.add_argument("--rows-top", type=int, default=ROWS_TOP, help="most frequent rows, all in the slice")
    parser.add_argument("--rows-sampled", type=int, default=ROWS_SAMPLED, help="other rows, drawn uniformly")
    parser.add_argument("--cols", type=int, default=64, help="hidden columns in the slice")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="N = 2048 only, no record written")
    parser.add_argument("--out", type=Path, default=RECORD)
    parser.add_argument("--readme", action="store_true", help="print the README table of the record and exit")
    args = parser.parse_args(argv)
    if args.readme:
        print(readme_table(json.loads(args.out.read_text())))
        return 0
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokens = [2048] if args.quick else args.tokens
    chunks = [256, 512] if args.quick else args.chunks
    runs = []
    for n in tokens:
        start = time.perf_counter()
        r = simulate(n, chunks, args.rows_top, args.rows_sampled, args.cols, args.seed)
        r["seconds"] = round(time.perf_counter() - start, 1)
        runs.append(r)
        print(f"N = {n} ({r['seconds']} s, mean entropy {r['mean_entropy_nats']} nats):", file=sys.stderr)
        for k, v in r["rel_l2"].items():
            print(f"  {k:<36} {v:.2e}", file=sys.stderr)
    record = {
        "script": "benchmarks/grad_weight_error.py",
        "command": "python benchmarks/grad_weight_error.py",
        "shape": {"hidden": HIDDEN, "vocab": VOCAB, "dtype": "bfloat16"},
        "slice": {"rows_top": args.rows_top, "rows_sampled": args.rows_sampled, "cols": args.cols},
        "seed": args.seed,
        "torch": torch.__version__,
        "runs": runs,
    }
    if args.quick:
        print(json.dumps(record))
        return 0
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
