"""Benchmark shapes: real LM heads (hidden size H, vocabulary V) times a number of completion tokens N.

A shape is one (N, H, V) point with the padded layout the loss ops see: B sequences of T tokens,
N = B * T. Presets are named lists of shapes; `--shapes` takes a comma-separated list of names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BenchShape:
    model: str  # where H and V come from
    hidden: int  # H
    vocab: int  # V
    tokens: int  # N = B * T
    seq_len: int  # T, completion length of one sequence

    def __post_init__(self):
        if self.tokens % self.seq_len:
            raise ValueError(f"tokens={self.tokens} is not a multiple of seq_len={self.seq_len}")

    @property
    def batch(self) -> int:  # B
        return self.tokens // self.seq_len

    @property
    def label(self) -> str:
        return f"{self.model} N={self.tokens} H={self.hidden} V={self.vocab}"

    @property
    def family(self) -> str:  # shapes of one family differ only in N (one line per provider in a plot)
        return f"{self.model} H={self.hidden} V={self.vocab}"

    def gemm_flops(self) -> int:
        """One GEMM unit G = 2 N H V: [N, H] x [H, V]."""
        return 2 * self.tokens * self.hidden * self.vocab

    def as_dict(self) -> dict:
        return {**asdict(self), "batch": self.batch}


# (model name, H, V) from the models' config.json (hidden_size, vocab_size)
QWEN25_7B = ("Qwen2.5-7B", 3584, 152064)
LLAMA3_8B = ("Llama-3-8B", 4096, 128256)
QWEN3_8B = ("Qwen3-8B", 4096, 151936)  # the docs/design.md §7 target shape at N = 16384
SEQ_LEN = 1024  # completion length of the real-model presets: B = N / 1024 sequences

# tiny: CPU smoke shapes. V = 1000 is not a multiple of any tile size (exercises the masked edges);
# H = 128 is the smallest hidden size verl's kernel accepts (H % 128 == 0).
# cpu: the PyTorch backend against TRL's paths on a CPU, at two heads a CPU user trains: a small head with a
# Llama-2-sized vocabulary (H = 1024, V = 32000, 2048 tokens) and Qwen2.5-3B's (H = 2048, V = 151936, 512
# tokens), as (model, H, V, N, T)
CPU_SHAPES = (("H1024-V32000", 1024, 32000, 2048, 1024), ("Qwen2.5-3B", 2048, 151936, 512, 512))
TINY = ("tiny", 128, 1000)
TINY_TOKENS = (64, 256)
TINY_SEQ_LEN = 32
SWEEP_TOKENS = (2048, 4096, 8192, 16384, 32768, 65536)
SESSION_SWEEP_TOKENS = (4096, 8192, 16384, 32768, 65536)  # the GPU session's sweep (benchmarks/gpu/run.sh)
TRL_SWEEP_TOKENS = (4096, 8192, 16384, 32768)  # the session's sweep against TRL, each size beside its floor
# The loss head alone moves 17 bytes per token: below ~1M tokens it is launch-latency bound, so its
# bandwidth is measured over larger batches too (LM-head ops skip shapes above their token range).
LOSS_SWEEP_TOKENS = (65536, 262144, 1048576, 4194304)


def _model_shapes(model, tokens, seq_len=SEQ_LEN) -> list[BenchShape]:
    name, hidden, vocab = model
    return [BenchShape(name, hidden, vocab, n, min(seq_len, n)) for n in tokens]


PRESETS: dict[str, list[BenchShape]] = {
    "tiny": _model_shapes(TINY, TINY_TOKENS, TINY_SEQ_LEN),
    "qwen2.5-7b": _model_shapes(QWEN25_7B, (16384,)),
    "llama3-8b": _model_shapes(LLAMA3_8B, (16384,)),
    "qwen3-8b": _model_shapes(QWEN3_8B, (16384,)),
    "sweep": _model_shapes(QWEN3_8B, SWEEP_TOKENS),
    "session-sweep": _model_shapes(QWEN3_8B, SESSION_SWEEP_TOKENS),
    "trl-sweep": _model_shapes(QWEN3_8B, TRL_SWEEP_TOKENS),
    "loss-sweep": _model_shapes(QWEN3_8B, LOSS_SWEEP_TOKENS),
    "cpu": [BenchShape(*shape) for shape in CPU_SHAPES],
}
PRESETS["full"] = PRESETS["qwen2.5-7b"] + PRESETS["llama3-8b"] + PRESETS["sweep"] + PRESETS["loss-sweep"]

PRESET_HELP = {
    "tiny": f"H={TINY[1]} V={TINY[2]}, N in {TINY_TOKENS} (CPU smoke test; seconds)",
    "qwen2.5-7b": "Qwen2.5-7B head, H=3584 V=152064, N=16384",
    "llama3-8b": "Llama-3-8B head, H=4096 V=128256, N=16384",
    "qwen3-8b": "Qwen3-8B head, H=4096 V=151936, N=16384 (docs/design.md §7 target)",
    "sweep": f"Qwen3-8B head, N in {SWEEP_TOKENS}: how time and memory grow with tokens",
    "session-sweep": f"Qwen3-8B head, N in {SESSION_SWEEP_TOKENS} (the GPU session's sweep)",
    "trl-sweep": f"Qwen3-8B head, N in {TRL_SWEEP_TOKENS} (the GPU session's sweep against TRL, interleaved)",
    "loss-sweep": f"N in {LOSS_SWEEP_TOKENS}, for loss_head only (the LM-head ops stop at 65536 tokens)",
    "full": "qwen2.5-7b + llama3-8b + sweep + loss-sweep (the committed GPU run)",
    "cpu": "H=1024 V=32000 N=2048 and Qwen2.5-3B H=2048 V=151936 N=512: the PyTorch backend against TRL on a CPU "
           "(fused_grpo; minutes per dtype)",
}


def resolve_presets(names: list[str]) -> list[BenchShape]:
    """Shapes of the named presets, in order, without duplicates."""
    shapes: list[BenchShape] = []
    for name in names:
        if name not in PRESETS:
            raise ValueError(f"unknown shape preset {name!r}; known: {', '.join(PRESETS)}")
        shapes += [s for s in PRESETS[name] if s not in shapes]
    return shapes
