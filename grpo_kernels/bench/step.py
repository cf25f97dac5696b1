"""A GRPO training step, stock against grpo_kernels: time split, peak memory, tokens/s, and the memory wall.

    python -m grpo_kernels.bench.step run  --model qwen3-1.7b --family trl --out DIR   # one family, every side
    python -m grpo_kernels.bench.step wall --model qwen3-1.7b --side trl-stock --axis length --lo 1024 --hi 32768 --out DIR
    python -m grpo_kernels.bench.step report DIR                                     # step.json + step.png

The model is a real Qwen3-family model built in code (transformers' Qwen3ForCausalLM, random weights,
nothing downloaded): Qwen3-1.7B with full fine-tuning, Qwen3-8B with LoRA through peft (r = 16 on every
projection), and a tiny Qwen3 config for the CPU rehearsal. The rollouts are fixed (prompt + completion ids,
completion lengths, rewards -> group advantages, all drawn from a seed), so generation takes no time and
every side trains on the same tokens. One optimizer step = one micro-batch of `seqs` sequences:

  old       the old-policy log-probs (no grad; what one batch feeding several updates needs)
  ref       the reference log-probs (no grad; KL, beta = 0.04)
  policy    the policy forward + the loss + backward
  optimizer AdamW's step and zero_grad

Families and sides (each family runs in one process, its sides one after another on fresh models built
from the same seed; each side's timings and peak memory are its own):

  trl      TRL 1.16's GRPOTrainer: `trl-stock`; GRPOKernelsTrainer (integrations/trl.py) in its two modes,
           `trl-fused` (the loss is fused_linear_grpo_loss) and `trl-logprobs` (TRL's loss on grpo_kernels'
           log-probs). Generation is bypassed: the trainer's own `_get_per_token_logps_and_entropies` makes
           the old / reference passes (the reference as `_generate_and_score_completions` does it: its
           ref_model, or the adapter disabled under LoRA), then `compute_loss` on the inputs dict that
           `_generate_and_score_completions` returns, `accelerator.backward`, and the trainer's own optimizer.
           TRL's defaults otherwise (loss_type "dapo", gradient checkpointing on).
  trainer  the reference trainer's update (grpo_kernels/trainer/trainer.py: `_token_logprobs` for the
           passes, `_update` for the step): `trainer-fused` as it runs, and `trainer-torch-head`, the same
           update with a plain PyTorch head (logits [n, V] materialised in the compute dtype, fp32
           log_softmax, the loss head in PyTorch) in place of the fused functions.

Pairs: (trl-stock, trl-fused), (trl-stock, trl-logprobs), (trainer-torch-head, trainer-fused). Before anything
is timed every side computes the loss (and its backward) on the same parity inputs: the first side's old /
reference log-probs plus fixed noise, so ratios leave 1, clipping and KL are active, and the loss depends on
each side's LM head. A side whose loss differs from its pair's first side by more than the tolerance (the
compute dtype's rounding, `parity_tolerance`) is refused: not timed, its row says why.

Memory wall: the longest completion (at fixed sequences per micro-batch) or the most sequences (at a fixed
completion length) that train one step without running out of memory, per side; a bounded search
(`wall_search`: a first guess from the side's measured peak memory when known, then doubling / bisection on a
grid, at most `tries` tries), each try in its own process. On CPU a planted limit stands in for the GPU's
memory: with GRPO_KERNELS_STEP_PLANTED_BYTES=N any single tensor the step allocates larger than N bytes
raises torch.OutOfMemoryError (a dispatch-mode check on every op's outputs), so the search logic runs.

Peak memory is torch.cuda.max_memory_allocated over the timed steps (CUDA only; null on CPU, said so in the
row). Tokens per second count every token the step's forward passes see (prompt + completion, padding
included) per second of the whole step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import gc
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .plots import save_figure, sha_label

SCHEMA = "grpo_kernels.step/1"
PLANTED_ENV = "GRPO_KERNELS_STEP_PLANTED_BYTES"
BETA = 0.04
LEARNING_RATE = 1e-6
SEED = 0
FAMILIES = {
    "trl": ("trl-stock", "trl-fused", "trl-logprobs"),
    "trainer": ("trainer-torch-head", "trainer-fused"),
}
PAIRS = (("trl-stock", "trl-fused"), ("trl-stock", "trl-logprobs"), ("trainer-torch-head", "trainer-fused"))
SIDES = tuple(s for family in FAMILIES.values() for s in family)
# Qwen3 model cards' configs (hidden, MLP, layers, heads, KV heads, head_dim, vocabulary, tied embeddings)
MODELS = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       lora=False),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False, lora=True),
    # the CPU rehearsal: the same architecture, tiny (a LoRA variant runs the peft path)
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=512, tie_word_embeddings=True, lora=False),
    "tiny-lora": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=512, tie_word_embeddings=False, lora=True),
}  # fmt: skip
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHASES = ("old", "ref", "policy", "optimizer")


@dataclass(frozen=True)
class Shape:
    seqs: int  # sequences per micro-batch (= per optimizer step)
    prompt: int  # prompt tokens
    completion: int  # completion tokens (the longest; shorter ones are right-padded)

    @property
    def tokens(self) -> int:
        return self.seqs * (self.prompt + self.completion)


# ------------------------------------------------------------------------------------------------
# model and rollouts
# ------------------------------------------------------------------------------------------------


def device_and_dtype() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def model_config(name: str):
    import transformers

    spec = {k: v for k, v in MODELS[name].items() if k != "lora"}
    return transformers.Qwen3Config(**spec, max_position_embeddings=40960, rope_theta=1000000.0,
                                    pad_token_id=0, eos_token_id=1, bos_token_id=None, use_cache=False)  # fmt: skip


def build_model(name: str, device: torch.device, dtype: torch.dtype):
    """Qwen3ForCausalLM with random weights drawn from SEED, on `device` in `dtype` (the same weights every
    time: each side builds its own)."""
    import transformers

    torch.manual_seed(SEED)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(model_config(name)).to(dtype)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")


def make_rollouts(shape: Shape, vocab: int, device: torch.device, seed: int = 1) -> dict:
    """Fixed rollouts: prompts (no padding), completions of lengths between half and all of `completion`
    (right-padded with 0), rewards -> advantages standardised within groups of 2 (GRPO's)."""
    g = torch.Generator().manual_seed(seed)
    b, p, c = shape.seqs, shape.prompt, shape.completion
    prompt_ids = torch.randint(2, vocab, (b, p), generator=g)
    completion_ids = torch.randint(2, vocab, (b, c), generator=g)
    lengths = torch.randint(max(1, c // 2), c + 1, (b,), generator=g)
    lengths[0] = c  # the longest fills the shape
    completion_mask = torch.arange(c)[None, :] < lengths[:, None]
    completion_ids = completion_ids.masked_fill(~completion_mask, 0)
    rewards = torch.rand(b, generator=g)
    groups = rewards.view(-1, 2) if b % 2 == 0 else rewards.view(1, -1)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).reshape(-1)
    noise = torch.randn(2, b, c, generator=g)
    out = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones(b, p, dtype=torch.long), completion_ids=completion_ids,
               completion_mask=completion_mask.long(), advantages=advantages, noise=noise)  # fmt: skip
    return {k: v.to(device) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------
# sides
# ------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _Side:
    """What every side shares: its optimizer's step and zero_grad (`self.optimizer`, set by the side)."""

    optimizer: torch.optim.Optimizer

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


class TRLSide(_Side):
    """A TRL 1.16 GRPOTrainer (stock, or GRPOKernelsTrainer in `mode`) around a model built here."""

    def __init__(self, side: str, model_name: str, shape: Shape, device, dtype, workdir: str):
        import datasets
        import trl
        import trl.trainer.grpo_trainer as grpo_module

        self.device = device
        lora = MODELS[model_name]["lora"]
        model = build_model(model_name, device, dtype)
        reference = None if lora else copy.deepcopy(model).eval().requires_grad_(False)
        args = trl.GRPOConfig(
            output_dir=workdir, per_device_train_batch_size=shape.seqs, num_generations=2 if shape.seqs % 2 == 0
            else shape.seqs, max_completion_length=shape.completion, beta=BETA, learning_rate=LEARNING_RATE,
            report_to=[], save_strategy="no", logging_steps=1, use_cpu=device.type == "cpu",
            bf16=dtype == torch.bfloat16, seed=SEED, disable_tqdm=True,
        )  # fmt: skip
        kwargs = dict(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                      train_dataset=datasets.Dataset.from_dict({"prompt": ["a"] * shape.seqs}),
                      processing_class=_tokenizer(), peft_config=lora_config() if lora else None)  # fmt: skip
        saved = grpo_module.create_model_from_path
        # TRL loads the reference from the policy's path; this model has none: the same weights, frozen
        grpo_module.create_model_from_path = lambda *a, **k: reference
        try:
            if side == "trl-stock":
                self.trainer = trl.GRPOTrainer(**kwargs)
            else:
                from grpo_kernels.integrations.trl import GRPOKernelsTrainer

                self.trainer = GRPOKernelsTrainer(**kwargs, grpo_kernels_mode=side.split("-", 1)[1])
        finally:
            grpo_module.create_model_from_path = saved
        self.trainer.model.train()
        self.trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets: one micro-batch per step
        self.trainer.create_optimizer()
        self.optimizer = self.trainer.optimizer
        self.settings = {"loss_type": args.loss_type, "gradient_checkpointing": args.gradient_checkpointing,
                         "optimizer": type(self.optimizer).__name__, "lora": lora, "beta": BETA}  # fmt: skip

    def _pass(self, model, r, reference: bool):
        t = self.trainer
        ids = torch.cat([r["prompt_ids"], r["completion_ids"]], 1)
        attention = torch.cat([r["prompt_mask"], r["completion_mask"]], 1)
        with torch.no_grad():
            if reference and t.ref_model is None:  # LoRA: the adapter disabled, as TRL does
                from trl.trainer.utils import use_adapter

                with use_adapter(t.accelerator.unwrap_model(t.model), adapter_name=None):
                    return t._get_per_token_logps_and_entropies(t.model, ids, attention, r["completion_ids"].shape[1])[0]
            return t._get_per_token_logps_and_entropies(model, ids, attention, r["completion_ids"].shape[1])[0]

    def old(self, r):
        return self._pass(self.trainer.model, r, False)

    def ref(self, r):
        return self._pass(self.trainer.ref_model, r, True)

    def loss_backward(self, r, old, ref) -> float:
        inputs = {k: r[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
        inputs.update(num_items_in_batch=r["completion_mask"].sum(), old_per_token_logps=old, ref_per_token_logps=ref)
        loss = self.trainer.compute_loss(self.trainer.model, inputs)
        self.trainer.accelerator.backward(loss)
        return float(loss.detach())



class TrainerSide(_Side):
    """The reference trainer's passes and update; `torch_head`: the same update with a plain PyTorch head."""

    def __init__(self, side: str, model_name: str, shape: Shape, device, dtype, workdir: str):
        from types import SimpleNamespace

        import grpo_kernels as gk
        from grpo_kernels.trainer import trainer as trainer_module

        self.module, self.device, self.torch_head = trainer_module, device, side == "trainer-torch-head"
        lora = MODELS[model_name]["lora"]
        model = build_model(model_name, device, dtype)
        self.reference = None
        if lora:
            from peft import get_peft_model

            torch.manual_seed(SEED)
            model = get_peft_model(model, lora_config())
        else:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.policy = model
        self.compute = trainer_module.Compute(device, dtype)
        self.config = SimpleNamespace(micro_batch_size=shape.seqs, backend="auto", batch_invariant=False,
                                      keep_dropout=False, grad_clip=0.0, temperature=1.0)  # fmt: skip
        self.loss_config = gk.PolicyLossConfig.dapo().replace(kl_coef=BETA)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, fused=device.type == "cuda")
        self.settings = {"loss": "dapo", "gradient_checkpointing": False, "optimizer": "AdamW (fused on CUDA)",
                         "lora": lora, "beta": BETA, "head": "plain PyTorch" if self.torch_head else "grpo_kernels"}  # fmt: skip

    @contextlib.contextmanager
    def _head(self):
        if not self.torch_head:
            yield
            return
        saved = self.module.fused_linear_grpo_loss, self.module.fused_linear_logprobs
        self.module.fused_linear_grpo_loss, self.module.fused_linear_logprobs = _plain_grpo_loss, _plain_logprobs
        try:
            yield
        finally:
            self.module.fused_linear_grpo_loss, self.module.fused_linear_logprobs = saved

    def batch(self, r, old=None, ref=None):
        from grpo_kernels.trainer.rollout import PaddedBatch

        mask = r["completion_mask"].bool()
        return PaddedBatch(r["prompt_ids"], r["prompt_mask"].bool(), r["completion_ids"], mask, None, mask,
                           advantages=r["advantages"], old_logprobs=old, ref_logprobs=ref)  # fmt: skip

    def old(self, r):
        with self._head():
            return self.module._token_logprobs(self.policy, self.batch(r), self.config, self.compute, False)[0]

    def ref(self, r):
        with self._head():
            if self.reference is not None:
                return self.module._token_logprobs(self.reference, self.batch(r), self.config, self.compute, False)[0]
            with self.policy.disable_adapter():
                return self.module._token_logprobs(self.policy, self.batch(r), self.config, self.compute, False)[0]

    def loss_backward(self, r, old, ref) -> float:
        # _update's micro-batch loop for one micro-batch, without its optimizer step (timed apart)
        batch = self.batch(r, old, ref)
        mask = batch.loss_mask
        normalizers = {"num_tokens": float(mask.sum()), "num_sequences": float(len(batch)), "dp_size": 1}
        self.policy.train(False)
        with self._head():
            loss, _ = self.module._micro_batch_loss(self.policy, batch, slice(0, len(batch)), self.loss_config,
                                                    self.config, self.compute, normalizers, None)  # fmt: skip
        loss.backward()
        return float(loss.detach())



def _plain_logprobs(hidden, weight, targets, bias=None, temperature=1.0, *, mask=None, compute_entropy=True,
                    softcap=None, logit_scale=1.0, **_):  # fmt: skip
    """What a training loop without fused kernels does: logits [.., V] in the compute dtype (the LM-head
    GEMM), then fp32 log_softmax, the target's entry, the entropy."""
    from grpo_kernels import LogProbsOutput

    if softcap is not None:
        raise ValueError("the plain PyTorch head of the step benchmark has no soft-cap (Qwen3 has none)")
    logits = hidden @ weight.T if bias is None else hidden @ weight.T + bias  # [.., V] compute dtype
    z = logits.float() * (logit_scale / temperature)
    log_p = torch.log_softmax(z, -1)
    logprobs = log_p.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if compute_entropy else None
    return LogProbsOutput(logprobs=logprobs, entropy=entropy)


def _plain_grpo_loss(hidden, weight, targets, advantages, mask, old_logprobs=None, ref_logprobs=None,
                     rollout_logprobs=None, bias=None, config=None, *, softcap=None, logit_scale=1.0,
                     num_tokens=None, num_sequences=None, dp_size=1, grad_accum_steps=1, **_):  # fmt: skip
    import grpo_kernels as gk

    out = _plain_logprobs(hidden, weight, targets, bias, config.temperature, softcap=softcap, logit_scale=logit_scale,
                          compute_entropy=config.needs_entropy if hasattr(config, "needs_entropy") else True)  # fmt: skip
    return gk.grpo_loss(out.logprobs, advantages, mask, old_logprobs, ref_logprobs, rollout_logprobs, out.entropy,
                        config, num_tokens=num_tokens, num_sequences=num_sequences, dp_size=dp_size,
                        grad_accum_steps=grad_accum_steps, backend="torch")  # fmt: skip


def _tokenizer():
    """A word-level tokenizer (TRL's trainer needs one; the rollouts are ids, never text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_side(side: str, model_name: str, shape: Shape, device, dtype, workdir: str):
    return (TRLSide if side.startswith("trl") else TrainerSide)(side, model_name, shape, device, dtype, workdir)


def _free(side=None) -> None:
    """Release a side (its trainer, model, optimizer) and return the memory to the device before the next
    one is built: the trainers hold reference cycles (callbacks, the accelerator's prepared models)."""
    if side is not None:
        trainer = getattr(side, "trainer", None)
        if trainer is not None:
            trainer.accelerator.free_memory()
        side.__dict__.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# parity and timing
# ------------------------------------------------------------------------------------------------


def parity_tolerance(loss: float, tokens: int, dtype: torch.dtype) -> float:
    """How far two sides' losses on the same inputs may be apart. Each side's per-token log-probs carry the
    compute dtype's rounding of the logits (unit roundoff u: 2^-8 in bf16, 2^-24 in fp32) times the few
    roundings of the log-softmax (8 u bounds them); the loss is a token mean of terms linear in
    exp(logp - old) near 1, so that relative error reaches it once, plus the summation's log2(tokens) u.
    Both sides' errors add: 2 x (8 + log2 tokens) u, relative to max(|loss|, 1)."""
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11 if dtype == torch.float16 else 2.0**-24
    return 2 * (8 + math.log2(max(tokens, 2))) * u * max(abs(loss), 1.0)


def parity(family: str, model_name: str, shape: Shape, device, dtype, r: dict, workdir: str) -> dict:
    """Every side's loss on the same parity inputs (old / ref from the family's first side plus fixed noise);
    side -> {"loss", "ok", "reason"}."""
    sides = FAMILIES[family]
    out, fixed = {}, None
    for side in sides:
        s = make_side(side, model_name, shape, device, dtype, workdir)
        try:
            if fixed is None:  # the first side's passes, moved off 1 by noise (the same for every side)
                mask = r["completion_mask"].bool()
                old, ref = s.old(r), s.ref(r)
                fixed = ((old + 0.3 * r["noise"][0]).masked_fill(~mask, 0), (ref + 0.2 * r["noise"][1]).masked_fill(~mask, 0))
            loss = s.loss_backward(r, *fixed)
            s.zero_grad()
            out[side] = {"loss": loss}
        except Exception as exc:  # noqa: BLE001 - named in the row, the other sides go on
            out[side] = {"loss": None, "error": f"{type(exc).__name__}: {exc}"[:400]}
        finally:
            _free(s)
            s = None
    tokens = int(r["completion_mask"].sum())
    for first, second in PAIRS:
        if first not in out or second not in out:
            continue
        a, b = out[first]["loss"], out[second]["loss"]
        if a is None or b is None:
            out[second].update(ok=False, reason=f"no loss to compare ({first}: {a}, {second}: {b})")
            continue
        tol = parity_tolerance(a, tokens, dtype)
        ok = math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tol
        out[second].update(ok=ok, against=first, diff=abs(a - b), tolerance=tol)
        if not ok:
            out[second]["reason"] = f"loss {b!r} vs {first}'s {a!r}: |diff| {abs(a - b):.3g} > tolerance {tol:.3g}"
    for first, _ in PAIRS:
        if first in out and out[first]["loss"] is not None:
            out[first].setdefault("ok", math.isfinite(out[first]["loss"]))
    return out


def time_side(side: str, model_name: str, shape: Shape, device, dtype, r: dict, steps: int, warmup: int,
              workdir: str) -> dict:  # fmt: skip
    """`warmup` untimed steps, then `steps` timed ones: per step the seconds of each phase, the step's peak
    memory (CUDA), tokens/s; the medians over the timed steps."""
    s = make_side(side, model_name, shape, device, dtype, workdir)
    try:
        per_step, losses, peaks = [], [], []
        resident = None
        for i in range(warmup + steps):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                if resident is None and i >= warmup:  # weights + optimizer state, between steps
                    resident = torch.cuda.memory_allocated()
            times = {}
            _sync(device)
            t0 = time.perf_counter()
            old = s.old(r)
            _sync(device)
            t1 = time.perf_counter()
            ref = s.ref(r)
            _sync(device)
            t2 = time.perf_counter()
            losses.append(s.loss_backward(r, old, ref))
            _sync(device)
            t3 = time.perf_counter()
            s.step()
            _sync(device)
            t4 = time.perf_counter()
            times = {"old": t1 - t0, "ref": t2 - t1, "policy": t3 - t2, "optimizer": t4 - t3, "step": t4 - t0}
            if i >= warmup:
                per_step.append(times)
                if device.type == "cuda":
                    peaks.append(torch.cuda.max_memory_allocated())
        median = {k: _median([t[k] for t in per_step]) for k in (*PHASES, "step")}
        return {
            "side": side, "status": "ok", "settings": s.settings, "steps": per_step, "median_s": median,
            "tokens": shape.tokens, "tokens_per_s": shape.tokens / median["step"],
            "completion_tokens": int(r["completion_mask"].sum()), "losses": losses,
            "peak_memory_bytes": max(peaks) if peaks else None,
            "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if peaks else None,
            "resident_bytes": resident,
            "peak_memory_note": "torch.cuda.max_memory_allocated over each timed step" if peaks
            else "not measured: peak memory is read on CUDA only",
        }  # fmt: skip
    finally:
        _free(s)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def run_family(family: str, model_name: str, shape: Shape, steps: int, warmup: int) -> dict:
    """One row: the family's parity check, then each side that passed it timed (a refused side is not)."""
    device, dtype = device_and_dtype()
    r = make_rollouts(shape, MODELS[model_name]["vocab_size"], device)
    with tempfile.TemporaryDirectory() as workdir:
        checks = parity(family, model_name, shape, device, dtype, r, workdir)
        sides = []
        for side in FAMILIES[family]:
            check = checks.get(side, {})
            if not check.get("ok"):
                sides.append({"side": side, "status": "parity-failed" if check.get("loss") is not None else "error",
                              "reason": check.get("reason") or check.get("error") or "no parity result"})  # fmt: skip
                continue
            try:
                sides.append(time_side(side, model_name, shape, device, dtype, r, steps, warmup, workdir))
            except torch.OutOfMemoryError as exc:
                _free()
                sides.append({"side": side, "status": "oom", "reason": str(exc)[:300]})
            except Exception as exc:  # noqa: BLE001 - this side's row says why; the others go on
                _free()
                sides.append({"side": side, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:400]})
    return {"kind": "step", "model": model_name, "family": family, "environment": versions(),
            "shape": shape.__dict__, "dtype": str(dtype),
            "device": device.type, "steps": steps, "warmup": warmup, "parity": checks, "sides": sides}  # fmt: skip


# ------------------------------------------------------------------------------------------------
# the memory wall
# ------------------------------------------------------------------------------------------------


class _PlantedLimit(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op's outputs checked against a byte limit: the CPU's stand-in for the GPU's memory."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.limit:
                raise torch.OutOfMemoryError(
                    f"planted limit: {func} allocated {t.numel() * t.element_size()} bytes > {self.limit} "
                    f"({PLANTED_ENV})"
                )
        return out


def one_try(side: str, model_name: str, shape: Shape) -> dict:
    """One training step (passes, policy forward + backward, optimizer) at `shape`: "ok" with its peak
    memory, or "oom". Run in a process of its own (`try` command)."""
    import warnings

    from .._backend import BackendFallbackWarning

    warnings.filterwarnings("ignore", category=BackendFallbackWarning)  # a CPU rehearsal: said once by the row
    device, dtype = device_and_dtype()
    planted = os.environ.get(PLANTED_ENV)
    guard = _PlantedLimit(int(planted)) if planted else contextlib.nullcontext()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            r = make_rollouts(shape, MODELS[model_name]["vocab_size"], device)
            s = make_side(side, model_name, shape, device, dtype, workdir)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with guard:
                old, ref = s.old(r), s.ref(r)
                s.loss_backward(r, old, ref)
                s.step()
            _sync(device)
    except torch.OutOfMemoryError as exc:
        return {"status": "oom", "reason": str(exc).splitlines()[0][:300]}
    except RuntimeError as exc:  # an allocation that failed below PyTorch's allocator (cuBLAS workspace, ...)
        if "out of memory" in str(exc).lower() or "ALLOC_FAILED" in str(exc):
            return {"status": "oom", "reason": str(exc).splitlines()[0][:300]}
        raise
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    total = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None
    return {"status": "ok", "peak_memory_bytes": peak, "device_memory_bytes": total}


def wall_search(fits, lo: int, hi: int, grid: int, tries: int, guess: int | None = None) -> dict:
    """The largest value on the grid (multiples of `grid`, in [lo, hi]) for which `fits(value)` returns
    "ok", in at most `tries` calls: the first at `guess` (or lo), doubling while it fits, then bisection
    between the largest that fitted and the smallest that did not. Returns the largest that fitted (None:
    not even the first), the smallest that did not (None: none failed up to the last tried), whether the
    two are one grid step apart (`exact`), and every try."""

    def snap(x):
        return max(lo, min(hi, int(x) // grid * grid))

    ok_at, fail_at, log = None, None, []
    value = snap(guess if guess is not None else lo)
    while len(log) < tries:
        status = fits(value)
        log.append({"value": value, "status": status})
        if status == "ok":
            ok_at = value if ok_at is None else max(ok_at, value)
        else:
            fail_at = value if fail_at is None else min(fail_at, value)
        if fail_at is None:
            if ok_at >= hi:
                break
            nxt = snap(2 * ok_at)
        elif ok_at is None:
            if fail_at <= lo:
                break
            nxt = snap(max(lo, fail_at // 2))
        else:
            nxt = snap((ok_at + fail_at) // 2)
        if nxt in (v["value"] for v in log) or (ok_at is not None and fail_at is not None and fail_at - ok_at <= grid):
            break
        value = nxt
    exact = (ok_at is not None and fail_at is not None and fail_at - ok_at <= grid) or (ok_at == hi) or (
        fail_at == lo)  # fmt: skip
    return {"largest_ok": ok_at, "smallest_oom": fail_at, "exact": bool(exact), "tries": log, "grid": grid,
            "range": [lo, hi]}  # fmt: skip


_PRELOAD: tuple[str, ...] = ("grpo_kernels.bench.step",)  # what the tries' fork server imports (run_wall)


def _try_child(conn, side: str, model_name: str, shape: Shape) -> None:
    try:
        conn.send(one_try(side, model_name, shape))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, the try is lost, not the search
        conn.send({"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]})
    finally:
        conn.close()


def try_in_process(side: str, model_name: str, shape: Shape, timeout: float) -> dict:
    """one_try in a fresh process: a fault or an out-of-memory there costs that try only. The processes fork
    from a fork server that imported the libraries once and never computed (no thread pool or CUDA context
    to inherit), so a try costs its model build and its step, not the imports."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_try_child, args=(send, side, model_name, shape), daemon=True)
    proc.start()
    send.close()
    try:
        result = receive.recv() if receive.poll(timeout) else {"status": "timeout", "reason": f"over {timeout:.0f} s"}
    except EOFError:  # the child died before it answered
        result = None
    if result is None or result["status"] == "timeout":
        proc.kill()
    proc.join(10)
    if result is None:
        result = {"status": "crashed", "reason": f"the try's process died (exit status {proc.exitcode})"}
    return result


def run_wall(side: str, model_name: str, axis: str, base: Shape, lo: int, hi: int, grid: int, tries: int,
             guess: int | None, timeout: float) -> dict:  # fmt: skip
    """The memory wall of one side along `axis` ("length": completion tokens at base.seqs sequences;
    "seqs": sequences at base.completion tokens), each try a fresh process."""
    global _PRELOAD
    _PRELOAD = ("grpo_kernels.bench.step", "transformers", "grpo_kernels.trainer.trainer",
                *(("trl.trainer.grpo_trainer", "grpo_kernels.integrations.trl") if side.startswith("trl") else ()),
                *(("peft",) if MODELS[model_name]["lora"] else ()))  # fmt: skip
    details = []

    def fits(value: int) -> str:
        shape = Shape(base.seqs, base.prompt, value) if axis == "length" else Shape(value, base.prompt, base.completion)
        t0 = time.monotonic()
        result = try_in_process(side, model_name, shape, timeout)
        details.append({"value": value, **result, "seconds": round(time.monotonic() - t0, 1)})
        return result["status"]

    search = wall_search(fits, lo, hi, grid, tries, guess)
    search["tries"] = details
    # the search stops at any try that did not run (out of memory, or past its time limit, or broken): the
    # smallest that ran out of memory is the wall; a smaller one that failed otherwise is named beside it
    ooms = [t["value"] for t in details if t["status"] == "oom"]
    search["smallest_oom"] = min(ooms) if ooms else None
    failed = {t["value"]: t["status"] for t in details if t["status"] not in ("ok", "oom")}
    if failed:
        search["failed_otherwise"] = failed
        search["exact"] = False
    return {"kind": "wall", "model": model_name, "side": side, "axis": axis, "base": base.__dict__, "guess": guess,
            "planted_limit_bytes": int(os.environ[PLANTED_ENV]) if os.environ.get(PLANTED_ENV) else None, **search}  # fmt: skip


def append_row(path: str | Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    return rows


def wall_guess(step_rows: list[dict], model_name: str, side: str, axis: str, base: Shape) -> int | None:
    """A first guess from the side's measured step (CUDA) at the same fixed dimension: the memory above the
    resident weights and optimizer state, scaled linearly to 95 % of the device's (activations are linear in
    the completion length and in the sequences: SDPA attention). No CUDA call here: the tries' processes
    fork from this one."""
    for row in step_rows:
        fixed = "seqs" if axis == "length" else "completion"
        if row.get("kind") != "step" or row.get("model") != model_name or row["shape"][fixed] != getattr(base, fixed):
            continue
        for s in row.get("sides", []):
            if s.get("side") == side and s.get("peak_memory_bytes") and s.get("device_memory_bytes"):
                resident = s.get("resident_bytes") or 0  # weights and optimizer state: they do not grow
                scale = (0.95 * s["device_memory_bytes"] - resident) / max(1, s["peak_memory_bytes"] - resident)
                shape = row["shape"]
                return int((shape["completion"] if axis == "length" else shape["seqs"]) * scale)
    return None


# ------------------------------------------------------------------------------------------------
# the GPU session's rows (gpu_session.py's "step" part; session_worker.py's "step" job runs them)
# ------------------------------------------------------------------------------------------------

STEP_SHAPE = Shape(8, 256, 1024)  # 8 sequences of 256 + up to 1024 tokens: 10k tokens per step
# Each try builds the model and trains one step: ~5-20 s to build, and a step of 8 x 32k tokens of Qwen3-8B is
# ~1.3e16 FLOPs (~25 s); so the ranges stop there, the fork server's imports and 4 tries of at most 35 s fit a row's
# limit, and a wall past a
# range's end is reported as "no OOM up to" it
WALL_LENGTH = dict(lo=1024, hi=32768, grid=512, tries=4)  # completion tokens at STEP_SHAPE.seqs sequences
WALL_SEQS = dict(lo=8, hi=128, grid=8, tries=4)  # sequences at WALL_SEQS_COMPLETION tokens
WALL_SEQS_COMPLETION = 2048
TRY_TIMEOUT_S = 35
REHEARSAL_SHAPE = Shape(4, 8, 16)
REHEARSAL_PLANTED_BYTES = 600_000  # the tiny model's logits [4 x 64, 512] fp32 run into it between 64 and 128
REHEARSAL_WALL = dict(lo=32, hi=256, grid=32, tries=3)  # 32, 64 fit; 128 runs into the planted limit
REHEARSAL_WALL_SEQS = dict(lo=8, hi=64, grid=8, tries=3)  # 16-token completions: 8 sequences fit, 16 do not


def session_rows(rehearsal: bool) -> dict[str, dict]:
    """key -> what the row runs, in priority order: the step rows of both models (TRL's family first), then
    the memory walls (TRL stock against the adapter's fused mode, then the reference trainer's two heads)."""
    if rehearsal:  # a tiny model, 2 steps, the same code; the LoRA path too; a planted memory limit
        rows = {f"step|{m}|{f}": dict(kind="step", model=m, family=f, shape=REHEARSAL_SHAPE, steps=2, warmup=0)
                for m in ("tiny", "tiny-lora") for f in ("trl", "trainer")}  # fmt: skip
        for side in ("trainer-torch-head", "trainer-fused"):
            rows[f"wall|tiny|length|{side}"] = dict(kind="wall", model="tiny", side=side, axis="length",
                                                   shape=REHEARSAL_SHAPE, **REHEARSAL_WALL)  # fmt: skip
        rows["wall|tiny|seqs|trainer-torch-head"] = dict(kind="wall", model="tiny", side="trainer-torch-head",
                                                         axis="seqs", shape=REHEARSAL_SHAPE, **REHEARSAL_WALL_SEQS)  # fmt: skip
        return rows
    rows = {f"step|{m}|{f}": dict(kind="step", model=m, family=f, shape=STEP_SHAPE, steps=3, warmup=1)
            for m in ("qwen3-1.7b", "qwen3-8b") for f in ("trl", "trainer")}  # fmt: skip
    seqs_shape = Shape(STEP_SHAPE.seqs, STEP_SHAPE.prompt, WALL_SEQS_COMPLETION)
    for sides in (("trl-stock", "trl-fused"), ("trainer-torch-head", "trainer-fused")):
        for axis, shape, search in (("length", STEP_SHAPE, WALL_LENGTH), ("seqs", seqs_shape, WALL_SEQS)):
            for m in ("qwen3-1.7b", "qwen3-8b"):
                for side in sides:
                    rows[f"wall|{m}|{axis}|{side}"] = dict(kind="wall", model=m, side=side, axis=axis, shape=shape,
                                                           **search)  # fmt: skip
    return rows


def run_session_row(spec: dict, earlier_rows: list[dict]) -> dict:
    """One row of the session's step part (its spec from session_rows)."""
    shape = spec["shape"]
    if spec["kind"] == "step":
        return run_family(spec["family"], spec["model"], shape, spec["steps"], spec["warmup"])
    guess = wall_guess(earlier_rows, spec["model"], spec["side"], spec["axis"], shape)
    return run_wall(spec["side"], spec["model"], spec["axis"], shape, spec["lo"], spec["hi"], spec["grid"],
                    spec["tries"], guess, TRY_TIMEOUT_S)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# report and plot
# ------------------------------------------------------------------------------------------------


def report(rows: list[dict], environment: dict, source: dict) -> dict:
    """The step report: every step and wall row, the speedups of each pair, the GPU, versions and git sha."""
    steps = [r for r in rows if r.get("kind") == "step" and "sides" in r]
    walls = [r for r in rows if r.get("kind") == "wall" and "tries" in r]
    lost = [{k: r.get(k) for k in ("key", "status", "reason")} for r in rows
            if r.get("kind") in ("step", "wall") and r not in steps and r not in walls]  # fmt: skip
    # the versions the worker saw (the peers' wheels are on its path only), over the caller's
    environment = {**environment, **next((r["environment"] for r in steps if r.get("environment")), {})}
    pairs = []
    for row in steps:
        by_side = {s["side"]: s for s in row.get("sides", [])}
        for first, second in PAIRS:
            a, b = by_side.get(first), by_side.get(second)
            if not a or not b:
                continue
            entry = {"model": row["model"], "stock": first, "ours": second, "status": f"{a['status']} / {b['status']}"}
            if a["status"] == "ok" and b["status"] == "ok":
                entry["step_speedup"] = a["median_s"]["step"] / b["median_s"]["step"]
                if a.get("peak_memory_bytes") and b.get("peak_memory_bytes"):
                    entry["peak_memory_saved_gib"] = (a["peak_memory_bytes"] - b["peak_memory_bytes"]) / 2**30
            pairs.append(entry)
    return {"schema": SCHEMA, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": environment, "git": source, "measured": environment.get("cuda_available") is True,
            "steps": steps, "walls": walls, "pairs": pairs, "lost": lost}  # fmt: skip


def versions() -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    for name in ("transformers", "trl", "peft", "accelerate", "triton"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001
            info[name] = f"not importable: {type(exc).__name__}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda_runtime=torch.version.cuda)
    return info


def plot(rep: dict, path: Path) -> Path:
    """Left: each side's median step time split into its phases (bars, one group per model), its peak
    memory written beside; right: the memory wall per side and axis (largest that fitted, and the
    smallest that ran out, as a range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_w) = plt.subplots(1, 2, figsize=(15, 5.5))
    labels, y = [], 0
    colors = {"old": "#9ecae1", "ref": "#6baed6", "policy": "#2171b5", "optimizer": "#fd8d3c"}
    for row in rep["steps"]:
        for s in row["sides"]:
            label = f"{row['model']} {s['side']}"
            if s.get("status") == "ok":
                left = 0.0
                for phase in PHASES:
                    width = s["median_s"][phase] * 1e3
                    ax_t.barh(y, width, left=left, color=colors[phase], label=phase if y == 0 else None)
                    left += width
                mem = s.get("peak_memory_bytes")
                note = f"{left:.3g} ms, {s['tokens_per_s']:.3g} tok/s" + (
                    f", peak {mem / 2**30:.1f} GiB" if mem else ", peak n/a (CPU)")  # fmt: skip
                ax_t.text(left, y, " " + note, va="center", fontsize=7)
            else:
                ax_t.text(0, y, f" {s.get('status')}: {s.get('reason', '')[:70]}", va="center", fontsize=7, color="red")
            labels.append(label)
            y += 1
    ax_t.set_yticks(range(len(labels)), labels, fontsize=8)
    ax_t.invert_yaxis()
    ax_t.set_xlim(0, 1.7 * max([1e-3] + [s["median_s"]["step"] * 1e3 for row in rep["steps"] for s in row["sides"]
                                         if s.get("status") == "ok"]))  # room for the notes  # fmt: skip
    ax_t.set_xlabel("median step time (ms), split into phases")
    if labels:
        ax_t.legend(fontsize=8, loc="upper right")
    wl = []
    for i, w in enumerate(rep["walls"]):
        ok, oom = w.get("largest_ok"), w.get("smallest_oom")
        if ok is not None:
            ax_w.barh(i, ok, color="#31a354")
        if oom is not None:
            ax_w.plot([oom], [i], "rx")
        text = f" fits {ok}" + (f", OOM at {oom}" if oom is not None else ", no OOM up to the range") + (
            "" if w.get("exact") else " (bounded)")  # fmt: skip
        ax_w.text(max(ok or 0, oom or 0), i, text, va="center", fontsize=7)
        base = w["base"]
        fixed = f"{base['seqs']} seqs" if w["axis"] == "length" else f"{base['completion']} tok"
        wl.append(f"{w['model']} {w['side']} {w['axis']} @ {fixed}")
    ax_w.set_xlim(0, 1.6 * max([1] + [max(w.get("largest_ok") or 0, w.get("smallest_oom") or 0) for w in rep["walls"]]))
    ax_w.set_yticks(range(len(wl)), wl, fontsize=8)
    ax_w.invert_yaxis()
    ax_w.set_xlabel("memory wall: completion tokens (length) or sequences (seqs) that fit one step")
    if not wl:
        ax_w.text(0.5, 0.5, "no memory-wall rows", ha="center", transform=ax_w.transAxes, color="gray")
    env, git = rep["environment"], rep.get("git") or {}
    sha = sha_label(git)
    where = env.get("gpu") or "CPU: the flow, not the product's numbers (planted memory limit)"
    fig.suptitle(f"GRPO training step, stock vs grpo_kernels | {where}\ntorch {env.get('torch')}, transformers "
                 f"{env.get('transformers')}, trl {env.get('trl')}, peft {env.get('peft')} | grpo_kernels {sha}",
                 fontsize=9)  # fmt: skip
    return save_figure(fig, path)


def write_report(rows: list[dict], out: Path, source: dict | None = None) -> dict:
    from .environment import git_info

    rep = report(rows, versions(), source or git_info())
    out.mkdir(parents=True, exist_ok=True)
    (out / "step.json").write_text(json.dumps(rep, indent=1) + "\n")
    plot(rep, out / "step.png")
    return rep


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_kernels.bench.step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)

    def shape_args(p, seqs=8, prompt=256, completion=1024):
        p.add_argument("--model", choices=sorted(MODELS), default="tiny")
        p.add_argument("--seqs", type=int, default=seqs)
        p.add_argument("--prompt", type=int, default=prompt)
        p.add_argument("--completion", type=int, default=completion)

    run = sub.add_parser("run", help="one family's parity check and timed steps")
    shape_args(run)
    run.add_argument("--family", choices=sorted(FAMILIES), required=True)
    run.add_argument("--steps", type=int, default=3)
    run.add_argument("--warmup", type=int, default=1)
    run.add_argument("--out", required=True, help="folder: rows appended to step.jsonl, step.json + step.png")
    wall = sub.add_parser("wall", help="one side's memory wall along one axis (each try its own process)")
    shape_args(wall)
    wall.add_argument("--side", choices=SIDES, required=True)
    wall.add_argument("--axis", choices=("length", "seqs"), required=True)
    wall.add_argument("--lo", type=int, required=True)
    wall.add_argument("--hi", type=int, required=True)
    wall.add_argument("--grid", type=int, default=256)
    wall.add_argument("--tries", type=int, default=5)
    wall.add_argument("--try-timeout", type=float, default=120)
    wall.add_argument("--out", required=True)
    one = sub.add_parser("try", help="(internal) one step at one shape; prints one JSON line")
    shape_args(one)
    one.add_argument("--side", choices=SIDES, required=True)
    rep = sub.add_parser("report", help="step.json + step.png from DIR/step.jsonl or a session's results.jsonl")
    rep.add_argument("folder")
    args = parser.parse_args(argv)
    if args.command == "try":
        print(json.dumps(one_try(args.side, args.model, Shape(args.seqs, args.prompt, args.completion))), flush=True)
        return 0
    if args.command == "report":
        folder = Path(args.folder)
        rows = read_jsonl(folder / "step.jsonl") or read_jsonl(folder / "results.jsonl")
        source = None  # a session's folder: the commit its last call verified, not this checkout's
        if (folder / "session.json").exists():
            source = (json.loads((folder / "session.json").read_text()).get("calls") or [{}])[-1].get("source")
        write_report(rows, folder, source)
        print(f"wrote {folder / 'step.json'} and {folder / 'step.png'}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = Shape(args.seqs, args.prompt, args.completion)
    if args.command == "run":
        row = run_family(args.family, args.model, shape, args.steps, args.warmup)
    else:
        guess = wall_guess(read_jsonl(out / "step.jsonl"), args.model, args.side, args.axis, shape)
        row = run_wall(args.side, args.model, args.axis, shape, args.lo, args.hi, args.grid, args.tries, guess,
                       args.try_timeout)  # fmt: skip
    append_row(out / "step.jsonl", row)
    write_report(read_jsonl(out / "step.jsonl"), out)
    print(json.dumps({k: row[k] for k in row if k in ("kind", "model", "family", "side", "largest_ok", "smallest_oom")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
