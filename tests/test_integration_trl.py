"""The TRL adapter (grpo_kernels.integrations.trl): real `trainer.train()` runs of TRL 1.16.0's
GRPOTrainer and of GRPOKernelsTrainer in both modes, on a tiny model and tokenizer built here, give
the same losses, gradients, parameters and logged metrics.

Approach: full training. Each case trains for two optimizer steps of two accumulated micro-batches
(max_steps=2, gradient_accumulation_steps=2) with num_iterations=2, so one generation batch (sampled
identically on both sides: generation does not touch the adapter) is trained on twice: the first
step on-policy, the second with old log-probs (computed by the adapter's LM head) and ratios far
from 1 (SGD with a large learning rate), which exercises the clipping regimes. Compared, per case
and mode, against TRL's own trainer on the same seed: every value TRL logs (loss, grad_norm, kl,
entropy, clip_ratio/*, cispo_clip_ratio, vespo/phi_seq_mean, policy_loss, entropy_coef, aux_loss,
rewards...), the gradients of every parameter before each optimizer step (a callback), and the
parameters after training. vLLM importance sampling is emulated here (this environment has no vLLM):
the sampler's log-probs are the old log-probs plus noise, and TRL's IS-ratio lines fill the inputs, on
both sides; tests/test_integration_trl_vllm.py trains both modes against TRL on a real vLLM CPU engine.

Tolerances: both sides compute in fp32 with different summation orders (tiled online logsumexp vs
TRL's chunked kernel, the fused loss head vs TRL's loss lines). Logged values agree to
1e-6 + 1e-5 |value|. Gradients: 1e-5 of the largest gradient element in the first step (measured
worst ~6e-7), and (1 + 2 s) times that in step s, whose parameters carry the earlier steps'
differences times the learning rate (`grad_tolerance` derives it from the stability of gradient
descent), far below any formula difference. Parameters after training: their own rounding plus the learning rate times the
gradient tolerance. Everything is seeded and single-threaded, so the numbers are reproducible.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import pytest
import torch
from checkout import CHECKOUT, PYTHON_PREAMBLE
from parity_helpers import require_peer, trl_vllm_is_ratio

trl = require_peer("trl", "trl")

import grpo_kernels.integrations.trl as gk_trl  # noqa: E402

pytestmark = pytest.mark.parity

assert Path(gk_trl.__file__).resolve().parent == CHECKOUT / "integrations", (
    f"grpo_kernels.integrations.trl was imported from {gk_trl.__file__}, not from this checkout "
    f"({CHECKOUT}); run the tests with PYTHONPATH=. from the checkout (tests/README.md)"
)

from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

GRPOKernelsTrainer = gk_trl.GRPOKernelsTrainer

VALUE_RTOL, VALUE_ATOL = 1e-5, 1e-6
GRAD_TOL = 1e-5  # first step: of the largest gradient element of the step (absolute), and relative


def grad_tolerance(step: int) -> float:
    """The gradient tolerance of optimizer step `step` (0-based). Step 0 starts from identical parameters:
    only the two sides' fp32 summation orders differ (measured worst ~6e-7 of the largest element: GRAD_TOL
    leaves a 16x margin). Step s starts from parameters that differ by LEARNING_RATE times the earlier
    steps' gradient differences; that moves the gradient by at most the loss curvature times it, and a
    stable gradient-descent step has LEARNING_RATE x curvature <= 2, so each earlier step adds at most
    twice its own tolerance: GRAD_TOL (1 + 2 s). (The granite case measured 1.2e-6 / 0.12 = 1.0e-5 at
    step 1 on one machine, at the edge of the former flat 1e-5.)"""
    return GRAD_TOL * (1 + 2 * step)
PARAM_TOL = 1e-6  # of the largest parameter magnitude, plus what the gradient tolerance allows
LEARNING_RATE = 0.2  # SGD, constant: large enough that the second step's ratios leave the clip range
# wall-clock timings: the only logged values that may differ
NOT_COMPARED = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second",
                "eval_runtime", "eval_samples_per_second", "eval_steps_per_second")  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# A tiny model and tokenizer, made here
# ---------------------------------------------------------------------------------------------------
WORDS = ["<pad>", "<eos>", "<unk>"] + [chr(ord("a") + i) for i in range(13)]


def make_tokenizer(words=WORDS, special_tokens=()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        additional_special_tokens=list(special_tokens),
    )


def text_config(vocab_size: int) -> dict:
    """The tiny language model's config: <pad> 0, <eos> 1, large initial weights (varied log-probs)."""
    return dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=None, initializer_range=0.3,
    )  # fmt: skip


def make_model(kind: str):
    import transformers

    common = text_config(len(WORDS))
    torch.manual_seed(0)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if kind == "granite":  # logits divided by logits_scaling: TRL's logit_scale = 1 / 4
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=4.0))
    if kind == "mixtral":  # MoE: TRL adds router_aux_loss_coef * load-balancing loss
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                            router_aux_loss_coef=0.05)  # fmt: skip
        return transformers.MixtralForCausalLM(config)
    if kind == "gemma2":  # final_logit_softcapping = 30
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, head_dim=8))
    raise ValueError(kind)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: thread start-up dominates every op; one thread halves this module's time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """kind -> a saved tiny model + tokenizer (a path, so TRL can load the reference model too)."""
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = make_tokenizer()
    dirs = {}
    for kind in ("qwen2", "granite", "mixtral", "gemma2"):
        path = root / kind
        make_model(kind).save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[kind] = str(path)
    return dirs


PROMPTS = ["a b c", "d e", "f g h i", "j k", "l m a", "b"]


def reward_letters(completions, **kwargs):
    return [float(c.count("a") + 0.5 * c.count("b")) - 0.1 * len(c.split()) for c in completions]


# ---------------------------------------------------------------------------------------------------
# Running a case
# ---------------------------------------------------------------------------------------------------
class GradientRecorder(TrainerCallback):
    """Every parameter's gradient just before each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )


class EmulatedVLLM:
    """Mixin: a sampler whose log-probs are the old log-probs plus noise (NaN for one token it
    'could not score'), and TRL's own IS-ratio lines (parity_helpers.trl_vllm_is_ratio); use_vllm is
    on for the loss only (generation stays HF generate)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        old = out["old_per_token_logps"]
        g = torch.Generator().manual_seed(int(out["completion_ids"].sum()))
        sampling = old + 0.3 * torch.randn(old.shape, generator=g)
        sampling[0, 0] = float("nan")
        mask = out["completion_mask"]
        out["sampling_per_token_logps"] = sampling
        out["importance_sampling_ratio"] = trl_vllm_is_ratio(
            old, sampling, mask, self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )  # fmt: skip
        return out

    def _compute_loss(self, model, inputs):
        self.use_vllm = True
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.use_vllm = False


def grpo_config(output_dir, **overrides) -> GRPOConfig:
    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=2, gradient_accumulation_steps=2, num_iterations=2, learning_rate=LEARNING_RATE,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, bf16=False, seed=0, disable_tqdm=True, loss_type="dapo", beta=0.04,
    )  # fmt: skip
    settings.update(overrides)
    return GRPOConfig(**settings)


def train(trainer_cls, model_dir, tmp_path, config, *, vllm=False, peft=False, evaluate=False, **kwargs):
    if vllm:
        trainer_cls = type(f"VLLM{trainer_cls.__name__}", (EmulatedVLLM, trainer_cls), {})
    extra = {}
    if peft:  # TRL takes PEFT adapters from the peft package, which the [test] extra lists
        pytest.importorskip("peft", reason="the PEFT cases need peft: pip install -e '.[test]' (or pip install peft)")
    if peft == "prompt_tuning":  # a prompt-learning adapter: 3 virtual tokens before every row
        from peft import PromptTuningConfig

        extra["peft_config"] = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    elif peft:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
        )
    if evaluate:
        extra["eval_dataset"] = Dataset.from_dict({"prompt": PROMPTS[:2]})
    recorder = GradientRecorder()
    trainer = trainer_cls(
        model=model_dir, reward_funcs=reward_letters, args=grpo_config(str(tmp_path), **config),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), callbacks=[recorder], **extra, **kwargs,
    )  # fmt: skip
    trainer.train()
    if evaluate:
        trainer.evaluate()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return copy.deepcopy(trainer.state.log_history), recorder.steps, params


def close(a, b, rtol, atol) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return abs(a - b) <= atol + rtol * abs(b)


def compare(ctx, theirs, ours):
    """Every logged value, every gradient before each optimizer step, every parameter at the end."""
    logs_t, grads_t, params_t = theirs
    logs_o, grads_o, params_o = ours
    assert len(logs_o) == len(logs_t), f"{ctx}: {len(logs_o)} log entries, TRL {len(logs_t)}"
    for i, (entry_t, entry_o) in enumerate(zip(logs_t, logs_o, strict=True)):
        keys_t = {k for k in entry_t if k not in NOT_COMPARED}
        keys_o = {k for k in entry_o if k not in NOT_COMPARED}
        assert keys_o == keys_t, (
            f"{ctx} log {i}: keys differ: only TRL {sorted(keys_t - keys_o)}, "
            f"only ours {sorted(keys_o - keys_t)}"
        )
        bad = {
            k: (entry_o[k], entry_t[k])
            for k in keys_t
            if not close(entry_o[k], entry_t[k], VALUE_RTOL, VALUE_ATOL)
        }
        assert not bad, f"{ctx} log {i} (step {entry_t.get('step')}): (ours, TRL) differ: {bad}"
    assert len(grads_o) == len(grads_t), f"{ctx}: {len(grads_o)} optimizer steps, TRL {len(grads_t)}"
    for step, (g_t, g_o) in enumerate(zip(grads_t, grads_o, strict=True)):
        assert set(g_o) == set(g_t), f"{ctx} step {step}: parameters with gradients differ"
        scale = max(float(g.abs().max()) for g in g_t.values())
        tol = grad_tolerance(step)
        worst = max(g_t, key=lambda n: float(((g_o[n] - g_t[n]).abs() - tol * g_t[n].abs()).max()))
        err = (g_o[worst] - g_t[worst]).abs() - tol * g_t[worst].abs()
        flat = int(err.reshape(-1).argmax())
        assert float(err.reshape(-1)[flat]) <= tol * scale, (
            f"{ctx} step {step}: gradient of {worst} differs; worst element {flat}: ours "
            f"{g_o[worst].reshape(-1)[flat].item():.9g}, TRL {g_t[worst].reshape(-1)[flat].item():.9g} "
            f"(tolerance {tol:g} x (|TRL| + largest gradient {scale:.3g}))"
        )
    # SGD: parameters = initial - lr * sum of the step gradients, so they may differ by lr times the
    # gradient tolerance of each step, plus the rounding of the parameters themselves
    tolerance = PARAM_TOL * max(float(p.abs().max()) for p in params_t.values()) + LEARNING_RATE * sum(
        grad_tolerance(i) * 2 * max(float(g.abs().max()) for g in step.values()) for i, step in enumerate(grads_t)
    )
    for name, p_t in params_t.items():
        diff = (params_o[name] - p_t).abs()
        assert float(diff.max()) <= tolerance, (
            f"{ctx}: parameter {name} after training differs by {float(diff.max()):.3e} at element "
            f"{int(diff.reshape(-1).argmax())} (tolerance {tolerance:.3e})"
        )


# ---------------------------------------------------------------------------------------------------
# Cases: every TRL loss_type, and every feature the brief names
# ---------------------------------------------------------------------------------------------------
CASES = {
    # every loss_type, with a reference model (beta > 0), GA 2 and num_iterations 2 (old log-probs)
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.3),  # a cap that binds
    "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    # features
    "delta": dict(loss_type="dapo", delta=1.5),
    # settings TRL accepts that the fused loss once refused: a delta inside the clip range, an entropy
    # penalty, VESPO with sequence-level ratios (they set only the KL correction's ratio, beta > 0 here)
    "delta-inside-clip-range": dict(loss_type="dapo", delta=1.1, epsilon_high=0.28),
    "entropy-penalty": dict(loss_type="dapo", entropy_coef=-0.05),
    "vespo-sequence-level": dict(loss_type="vespo", importance_sampling_level="sequence"),
    "gspo-sequence-level": dict(
        loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-2, epsilon_high=4e-2
    ),
    "off-policy-mask": dict(loss_type="dapo", off_policy_mask_threshold=0.05),
    "top-entropy-quantile": dict(loss_type="grpo", top_entropy_quantile=0.5),
    "entropy-bonus": dict(loss_type="dapo", entropy_coef=0.05),
    "entropy-bonus-quantile-grpo": dict(loss_type="grpo", entropy_coef=0.05, top_entropy_quantile=0.6),
    "no-kl-plain-kl": dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=False),
    "on-policy-GA1": dict(loss_type="dapo", num_iterations=1, gradient_accumulation_steps=1, beta=0.0),
    "steps-per-generation-4": dict(loss_type="dapo", steps_per_generation=4, num_iterations=1),
    "truncated-completions-masked": dict(loss_type="grpo", mask_truncated_completions=True),
    "temperature-cast-fp32-head": dict(loss_type="dapo", temperature=0.7, cast_lm_head_to_fp32=True),
}
# fmt: off
SPECIAL = {  # name -> (model kind, train() keywords, config)
    "vllm-sequence-mask": ("qwen2", dict(vllm=True), dict(loss_type="dapo")),
    "vllm-token-truncate-off-policy": ("qwen2", dict(vllm=True), dict(
        loss_type="grpo", vllm_importance_sampling_mode="token_truncate", off_policy_mask_threshold=0.05,
        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=1.5,
    )),
    "vllm-vespo-token-mask": (
        "qwen2", dict(vllm=True), dict(loss_type="vespo", vllm_importance_sampling_mode="token_mask")
    ),
    "peft-lora-ref-by-disabled-adapter": ("qwen2", dict(peft=True), dict(loss_type="dapo")),
    "peft-prompt-tuning": ("qwen2", dict(peft="prompt_tuning"), dict(loss_type="grpo")),
    "eval-mode": (
        "qwen2", dict(evaluate=True), dict(loss_type="grpo", entropy_coef=0.05, per_device_eval_batch_size=4)
    ),
    "granite-logit-scale-temperature": ("granite", {}, dict(loss_type="dapo", temperature=0.8)),
    "mixtral-moe-aux-loss": ("mixtral", {}, dict(loss_type="grpo")),
    # Gemma 2: final_logit_softcapping = 30 (TRL's transform, grpo_kernels' softcap in the kernels)
    "gemma2-softcap-temperature": ("gemma2", {}, dict(loss_type="dapo", temperature=0.8)),
}
# fmt: on
ALL_CASES = {name: ("qwen2", {}, config) for name, config in CASES.items()} | SPECIAL

_trl_runs: dict = {}


def trl_run(name, model_dirs, tmp_path):
    if name not in _trl_runs:
        kind, keywords, config = ALL_CASES[name]
        _trl_runs[name] = train(GRPOTrainer, model_dirs[kind], tmp_path / "trl", config, **keywords)
    return _trl_runs[name]


@pytest.mark.parametrize("mode", gk_trl.MODES)
@pytest.mark.parametrize("name", list(ALL_CASES))
def test_training_matches_trl(name, mode, model_dirs, tmp_path):
    kind, keywords, config = ALL_CASES[name]
    theirs = trl_run(name, model_dirs, tmp_path)
    ours = train(GRPOKernelsTrainer, model_dirs[kind], tmp_path / "ours", config, grpo_kernels_mode=mode,
                 **keywords)  # fmt: skip
    compare(f"[{name}, grpo_kernels_mode={mode}]", theirs, ours)


@contextlib.contextmanager
def rows_compacted_as_on_gpu():
    """On CUDA, TRL's forward passes the LM head only the scored rows (shifted label != -100); on
    CPU every position. Make its forward compact here (its own kernel is not involved: the adapter's
    head replaces it), so the CPU suite covers the layout GPUs get, all-masked micro-batches (no row
    at all) included."""
    import trl.trainer.utils as trl_utils

    saved = trl_utils._use_triton
    trl_utils._use_triton = lambda device: True
    try:
        yield
    finally:
        trl_utils._use_triton = saved


COMPACTED = ("dapo", "gspo-sequence-level", "truncated-completions-masked", "vllm-token-truncate-off-policy",
             "peft-prompt-tuning")


@pytest.mark.parametrize("mode", gk_trl.MODES)
@pytest.mark.parametrize("name", COMPACTED)
def test_training_on_compacted_rows_matches_trl(name, mode, model_dirs, tmp_path):
    kind, keywords, config = ALL_CASES[name]
    theirs = trl_run(name, model_dirs, tmp_path)  # TRL on CPU: every row
    with rows_compacted_as_on_gpu():
        ours = train(GRPOKernelsTrainer, model_dirs[kind], tmp_path / "ours", config, grpo_kernels_mode=mode,
                     **keywords)  # fmt: skip
    compare(f"[{name}, compacted rows, grpo_kernels_mode={mode}]", theirs, ours)


def test_cases_exercise_the_features(model_dirs, tmp_path):
    """The cases reach the regimes they are named for (else a parity pass would prove little)."""

    def logged(name, key, step=1):
        return trl_run(name, model_dirs, tmp_path)[0][step][key]

    assert logged("dapo", "clip_ratio/low_mean") > 0 and logged("dapo", "clip_ratio/high_mean") > 0
    assert logged("dapo", "kl") > 0
    assert logged("cispo", "cispo_clip_ratio") > 0
    assert 0 < logged("vespo", "vespo/phi_seq_mean") < 1
    assert logged("gspo-sequence-level", "clip_ratio/region_mean") > 0
    assert logged("entropy-bonus", "policy_loss") != logged("entropy-bonus", "loss")
    assert logged("mixtral-moe-aux-loss", "aux_loss") > 0
    assert logged("truncated-completions-masked", "completions/clipped_ratio", step=0) > 0


# ---------------------------------------------------------------------------------------------------
# Refusals and the version gate
# ---------------------------------------------------------------------------------------------------
def build(model_dir, tmp_path, **kwargs):
    config = {k: kwargs.pop(k) for k in list(kwargs) if k != "grpo_kernels_mode"}
    return GRPOKernelsTrainer(
        model=model_dir, reward_funcs=reward_letters, args=grpo_config(str(tmp_path), **config),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), **kwargs,
    )  # fmt: skip


# A vision-language model: LLaVA (a CLIP vision tower, a projector, a Llama language model), tiny, with a
# processor built here. Each 28 x 28 image is 4 patches + the CLS feature ("full" selection): 5 image
# tokens in the prompt, which are prompt positions for the loss like any other.
VLM_WORDS = WORDS + ["<image>", "user:", "assistant:"]
VLM_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}:"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}{% endfor %} "
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    import transformers

    tokenizer = make_tokenizer(VLM_WORDS, special_tokens=["<image>"])
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 28},
                                                      crop_size={"height": 28, "width": 28})  # fmt: skip
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=VLM_TEMPLATE, patch_size=14,
        vision_feature_select_strategy="full", image_token="<image>", num_additional_image_tokens=1,
    )  # fmt: skip
    text = dict(text_config(len(VLM_WORDS)), model_type="llama")
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, model_type="clip_vision_model")  # fmt: skip
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=VLM_WORDS.index("<image>"),
                                      vision_feature_select_strategy="full", vision_feature_layer=-1)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_vlm") / "llava"
    transformers.LlavaForConditionalGeneration(config).save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def image_prompts() -> Dataset:
    """PROMPTS as conversational prompts, each with one 28 x 28 image of its own."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)) for _ in PROMPTS]
    prompts = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p}]}] for p in PROMPTS]
    return Dataset.from_dict({"prompt": prompts, "image": images})


def reward_letters_chat(completions, **kwargs):  # conversational completions: [{"role", "content"}]
    return reward_letters([c[0]["content"] for c in completions])


def train_vlm(trainer_cls, model_dir, tmp_path, **kwargs):
    import transformers

    recorder = GradientRecorder()
    trainer = trainer_cls(
        model=model_dir, reward_funcs=reward_letters_chat, args=grpo_config(str(tmp_path)),
        train_dataset=image_prompts(), processing_class=transformers.AutoProcessor.from_pretrained(model_dir),
        callbacks=[recorder], **kwargs,
    )  # fmt: skip
    assert trainer._is_vlm
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return copy.deepcopy(trainer.state.log_history), recorder.steps, params


@pytest.mark.parametrize("mode", gk_trl.MODES)
def test_vision_language_training_matches_trl(mode, vlm_dir, tmp_path):
    """Images in the prompts (pixel_values reach the forward as in TRL's _compute_loss): both modes train
    like TRL's trainer, the vision tower's and projector's gradients included."""
    theirs = train_vlm(GRPOTrainer, vlm_dir, tmp_path / "trl")
    ours = train_vlm(GRPOKernelsTrainer, vlm_dir, tmp_path / "ours", grpo_kernels_mode=mode)
    vision_grads = [n for n in theirs[1][0] if "vision_tower" in n or "projector" in n]
    assert vision_grads and all(bool(theirs[1][0][n].abs().max() > 0) for n in vision_grads)
    compare(f"[llava, grpo_kernels_mode={mode}]", theirs, ours)


@pytest.mark.parametrize("mode", ["logprobs", "fused"])
@pytest.mark.parametrize("target", [5.0, 0.5])  # entropy under the target (the bonus grows) / above it (gated off)
def test_adaptive_entropy_matches_trl(mode, target, model_dirs, tmp_path):
    config = dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=target,
                  entropy_coef_delta=0.005)  # fmt: skip
    theirs = train(GRPOTrainer, model_dirs["qwen2"], tmp_path / "trl", config)
    ours = train(GRPOKernelsTrainer, model_dirs["qwen2"], tmp_path / "ours", config, grpo_kernels_mode=mode)
    compare(f"[adaptive entropy {target}, {mode}]", theirs, ours)
    coefs = [row["entropy_coef"] for row in ours[0] if "entropy_coef" in row]
    assert len(set(coefs)) > 1, f"the controller never moved the coefficient: {coefs}"


def test_unknown_mode_is_refused(model_dirs, tmp_path):
    with pytest.raises(ValueError, match="grpo_kernels_mode must be one of"):
        build(model_dirs["qwen2"], tmp_path, grpo_kernels_mode="liger")


def test_other_trl_versions_are_refused(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError, match=r"supports TRL 1\.16\.0 .*found trl 1\.17\.0"):
        gk_trl._build_trainer_class()


def test_forward_that_bypasses_the_seam_is_an_error(model_dirs, tmp_path):
    """If something replaces the forward TRL installs, the adapter says so instead of silently
    training on TRL's kernel."""
    trainer = build(model_dirs["qwen2"], tmp_path, beta=0.0, grpo_kernels_mode="logprobs")
    original = trainer.model.forward

    def forward(*args, fused_lm_head=False, labels=None, **kwargs):  # TRL's fields, TRL's kernel gone
        out = original(*args, labels=labels, **kwargs)
        return type(
            "Out",
            (),
            {"log_probs": out.logits[:, :-1, 0], "entropy": out.logits[:, :-1, 0], "aux_loss": None},
        )

    trainer.model.forward = forward
    ids = torch.tensor([[3, 4, 5, 6]])
    with pytest.raises(RuntimeError, match="did not reach the LM-head seam"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 2)


def test_the_seam_is_restored_after_each_call(model_dirs, tmp_path):
    import trl.trainer.utils as trl_utils

    kernel = trl_utils._ChunkedLogProbFunction
    trainer = build(model_dirs["qwen2"], tmp_path, beta=0.0, grpo_kernels_mode="logprobs")
    ids = torch.tensor([[3, 4, 5, 6]])
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 2)
    assert trl_utils._ChunkedLogProbFunction is kernel


def test_module_imports_without_trl():
    """Importing the adapter does not import TRL (the trainer class is built on first use)."""
    import subprocess
    import sys

    code = PYTHON_PREAMBLE + (
        "import grpo_kernels.integrations.trl as adapter\n"
        "assert 'trl' not in sys.modules, 'importing the adapter imported trl'\n"
        "print(adapter.SUPPORTED_TRL)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == gk_trl.SUPPORTED_TRL


def test_bf16_autocast_trains_close_to_trl(model_dirs, tmp_path):
    """bf16=True (autocast) runs the projection in bf16 on both sides, as TRL's kernel does; TRL
    rounds each logits tile to bf16, grpo_kernels accumulates in fp32, so the two agree at bf16
    resolution only: the on-policy first step is compared loosely."""
    config = dict(loss_type="dapo", bf16=True)
    logs_t, grads_t, _ = train(GRPOTrainer, model_dirs["qwen2"], tmp_path / "trl", config)
    for mode in gk_trl.MODES:
        logs_o, grads_o, _ = train(GRPOKernelsTrainer, model_dirs["qwen2"], tmp_path / mode, config,
                                   grpo_kernels_mode=mode)  # fmt: skip
        for key in ("loss", "entropy", "grad_norm"):
            assert close(logs_o[0][key], logs_t[0][key], 1e-2, 1e-3), (
                mode,
                key,
                logs_o[0][key],
                logs_t[0][key],
            )
        scale = max(float(g.abs().max()) for g in grads_t[0].values())
        worst = max(float((grads_o[0][n] - g).abs().max()) for n, g in grads_t[0].items())
        assert worst <= 2e-2 * scale, (mode, worst, scale)


class FakeZero3:
    """A stand-in for ZeRO-3 on one parameter: its data is empty except inside the gather context,
    as trl.trainer.utils.maybe_gather_lm_head_ctx gives it (patched to this)."""

    def __init__(self, full: torch.Tensor):
        self.full = full
        self.param = torch.nn.Parameter(torch.empty(0))
        self.gathers = 0

    @contextlib.contextmanager
    def gather(self, *params):
        self.gathers += 1
        self.param.data = self.full
        try:
            yield
        finally:
            self.param.data = torch.empty(0)


def test_logprobs_head_regathers_the_weight_for_its_backward(monkeypatch):
    """Under ZeRO-3 the weight is only materialised inside TRL's gather context; the backward
    recomputes the logits, so it must gather again (TRL's own kernel does): with the weight empty
    outside the context, the gradients still equal those of the full weight."""
    import trl.trainer.utils as trl_utils

    torch.manual_seed(0)
    vocab, hidden_size, tokens = 37, 16, 11
    zero3 = FakeZero3(torch.randn(vocab, hidden_size))
    monkeypatch.setattr(trl_utils, "maybe_gather_lm_head_ctx", zero3.gather)
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with zero3.gather(zero3.param):  # what TRL's forward does around the kernel call
        logprobs, entropy, *_ = gk_trl.LogProbsHead("torch").apply(
            hidden, zero3.param, None, targets, 0.7, 32768, None, 1.0, ("log_probs", "entropy")
        )
    assert zero3.param.numel() == 0
    grads = torch.autograd.grad(logprobs.sum() + 0.3 * entropy.sum(), [hidden, zero3.param])
    assert zero3.gathers == 2, "the backward did not enter maybe_gather_lm_head_ctx"
    h, w = hidden.detach().double().requires_grad_(), zero3.full.double().requires_grad_()
    log_p = torch.log_softmax(h @ w.T / 0.7, -1)
    expected = log_p.gather(-1, targets[:, None]).sum() - 0.3 * (log_p.exp() * log_p).sum()
    for name, got, want in zip(
        ("hidden", "weight"), grads, torch.autograd.grad(expected, [h, w]), strict=True
    ):
        err = float((got.double() - want).abs().max())
        assert err <= 1e-5 * float(want.abs().max()), f"d/d{name}: {err:.3e}"


def test_deepspeed_zero3_with_a_reference_model_trains_like_trl(tmp_path):
    """Under ZeRO-3 TRL wraps the reference model in a DeepSpeed engine (whose .config is the DeepSpeed
    dict): the adapter looks through it. One process started as torchrun would (gloo, DeepSpeed's CPU
    accelerator), beta > 0, two optimizer steps of two micro-batches, both modes, against TRL's GRPOTrainer
    under the same ZeRO-3 config: the same losses and parameters, to within 16 ulp of the largest parameter
    (fp32 sums in another order, SGD steps). The LM head is partitioned outside the forward (numel 0) and
    its update is real: TRL's ZeRO-3 run moves it as far as TRL without DeepSpeed, far beyond the tolerance,
    so a lost or partial head gradient would fail. In "logprobs" mode the adapter's head computes its
    gradients in its backward: each one (one per training micro-batch) reads the whole weight. DeepSpeed
    has gathered the head again before that backward starts (its hooks on the model's output), so the
    adapter's own gather (maybe_gather_lm_head_ctx, as TRL's kernel) is a no-op here; the path where the
    weight is still partitioned then is test_logprobs_head_regathers_the_weight_for_its_backward's."""
    pytest.importorskip("deepspeed", reason="the ZeRO-3 case needs deepspeed: the [parity] extra")
    import json
    import os
    import subprocess
    import sys

    from grpo_kernels.testing.distributed import free_port

    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONPATH=str(CHECKOUT))  # fmt: skip
    proc = subprocess.run([sys.executable, str(CHECKOUT / "tests" / "_trl_zero3_case.py")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    tolerance = 16 * 2**-23 * report["fused"]["param_scale"]
    assert report["trl_head_partitioned"], report
    assert report["trl_plain_head_diff"] <= tolerance and report["trl_head_moved"] > 1000 * tolerance, report
    for mode in gk_trl.MODES:
        ours = report[mode]
        assert len(ours["losses"]) == len(report["trl_losses"]) == 2, (mode, report)
        for a, b in zip(ours["losses"], report["trl_losses"]):
            assert abs(a - b) <= 1e-6 * (1 + abs(b)), (mode, a, b)
        assert ours["param_diff"] <= tolerance, (mode, ours)
        assert ours["head_partitioned"] and ours["head_moved"] > 1000 * tolerance, (mode, ours)
    backwards = report["logprobs"]["gathered_backwards"]
    assert len(backwards) == 4 and all(inside == 32 * len(WORDS) for _, inside in backwards), backwards
    assert report["fused"]["gathered_backwards"] == []  # the fused head computes its gradients in the forward


@pytest.mark.parametrize("mode", gk_trl.MODES)
def test_batch_invariant_switch_trains_like_trl(mode, model_dirs, tmp_path):
    """grpo_kernels_batch_invariant=True changes reduction orders, not formulas: training equals TRL's."""
    name = "dapo"
    kind, keywords, config = ALL_CASES[name]
    theirs = trl_run(name, model_dirs, tmp_path)
    ours = train(gk_trl.GRPOKernelsTrainer, model_dirs[kind], tmp_path / mode, config, grpo_kernels_mode=mode,
                 grpo_kernels_batch_invariant=True, **keywords)  # fmt: skip
    compare(f"[{name}, {mode}, batch-invariant]", theirs, ours)
