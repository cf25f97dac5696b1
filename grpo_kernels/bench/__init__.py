"""The benchmark harness behind `python -m benchmarks` and `grpo-kernels bench` (see cli.py).

shapes.py     shape presets from real LM heads (Qwen2.5-7B, Llama-3-8B, Qwen3-8B) and a token sweep
ops.py        the benchmarked ops, their inputs and floors (cuBLAS GEMMs / compulsory-bytes copy)
oracle.py     fp32 ground truth and PyTorch's same-dtype result for the parity gate
providers.py  the registry: grpo_kernels, PyTorch eager / compile, TRL, Liger, verl, cut-cross-entropy
parity.py     the correctness gate every provider passes before it is timed
timing.py     CUDA-event (or perf_counter) timing, peak memory
runner.py     one run: every op x shape x provider
report.py     console tables, JSON, README table; plots.py: PNGs
gpu_session.py  the two-call GPU session (benchmarks/gpu/run.sh): plan, child processes, lost rows, files
session_worker.py  the session's child processes (preflight, smoke, micro, one provider's rows, profile)
microbench.py  per-kernel microbenchmarks and the devices' datasheet peaks
"""

from .cli import main

__all__ = ["main"]
