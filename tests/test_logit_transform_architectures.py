"""The one reader of a model's logit transform (grpo_kernels.hf.logit_transform) against every causal-LM
architecture of the pinned transformers (5.10.4) whose forward transforms the LM head's output or the last
hidden state, each built tiny here (random weights, a tiny config with non-default transform values):

* log-probs through the library (`fused_linear_logprobs` on the hidden states entering the model's LM head,
  with the reader's transform) equal `log_softmax(model(ids).logits)` to fp32 rounding (bound derived below);
* the trainer and every adapter give the same transform: the trainer's own path (`_token_logprobs`, end to
  end, against the model's forward on each row; not PaliGemma, whose prefix-LM mask its decoder alone
  lacks), OpenRLHF's `logit_transform` (model and config), SkyRL's FSDP head, TRL's heads (the model's
  transform wins over the one TRL passes) and Unsloth's kernel (likewise) compute the same log-probs. verl's
  `linear_cross_entropy` takes `softcap=` from its caller and torchtitan's models have no transform: neither
  reads a Hugging Face config;
* architectures whose config carries a transform attribute their forward never applies read as none;
* the one the library cannot score is refused by name with the reason;
* `test_every_transforming_architecture_is_in_the_table` scans the pinned transformers' modeling files and
  fails when a causal-LM forward transforms its logits (or the hidden states before the head) and is not
  in TABLE, or when a row's line no longer holds what it mirrors (a transformers upgrade is caught).
"""

from __future__ import annotations

import ast
import functools
import math
import pathlib
import re
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import hf

transformers = pytest.importorskip("transformers")

if transformers.__version__ != "5.10.4":  # the table mirrors these modeling files, line by line
    pytest.skip(f"the table mirrors transformers 5.10.4, found {transformers.__version__}", allow_module_level=True)

MODELS = pathlib.Path(transformers.__file__).parent / "models"
V, SEQ = 64, 8  # vocabulary, sequence length
TEXT = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
SIGLIP = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=8)  # fmt: skip
PER_LAYER = dict(vocab_size_per_layer_input=V, hidden_size_per_layer_input=8)  # Gemma 3n / 4 per-layer inputs
GEMMA3N = dict(TEXT, num_hidden_layers=2, intermediate_size=[64, 64], layer_types=["sliding_attention", "full_attention"],
               num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0], laurel_rank=4, sliding_window=8,
               **PER_LAYER)  # fmt: skip


class Row(NamedTuple):
    cls: str  # the transformers class
    file: str  # its modeling file (below transformers/models/)
    line: int  # the line of the forward the reader mirrors
    mirrors: str  # what that line holds
    config: object  # () -> a tiny config with non-default transform values, or None: not built
    expected: tuple | str  # (softcap, logit_scale) the reader must give, or the refusal's text


def _cfg(name, **kwargs):
    return lambda: getattr(transformers, name)(**kwargs)


def _text(name, **extra):
    return _cfg(name, **{**TEXT, **extra})


def _gemma4(name, text, **extra):
    return lambda: getattr(transformers, name)(
        text_config=getattr(transformers, text)(final_logit_softcapping=2.0, **TEXT, **PER_LAYER),
        vision_config=getattr(transformers, "Gemma4VisionConfig")(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)
        if text == "Gemma4TextConfig" else None, audio_config=None, **extra)  # fmt: skip


def _granite4_vision():
    t = transformers
    return t.Granite4VisionConfig(
        text_config=t.GraniteConfig(logits_scaling=0.5, **TEXT), vision_config=t.SiglipVisionConfig(**{**SIGLIP, "num_hidden_layers": 2}),
        image_token_index=63, deepstack_layer_map=[], spatial_target_layers=[], vision_feature_layer=-1, downsample_rate="1/2",
        qformer_config=dict(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32, encoder_hidden_size=16),
    )  # fmt: skip


MOE = dict(num_local_experts=4, num_experts_per_tok=2)
SOFTCAP = "logits = logits * self.config.final_logit_softcapping"
SOFTCAP_TEXT = "logits = logits * final_logit_softcapping"
GRANITE = "logits = logits / self.config.logits_scaling"
COHERE = "logits = logits * self.logit_scale"
# Every causal-LM class of transformers 5.10.4 whose forward transforms the LM head's output (the scan below
# finds exactly these), the line it mirrors, and the tiny config each is built from
TABLE = [
    Row("CohereForCausalLM", "cohere/modeling_cohere.py", 515, COHERE, _text("CohereConfig", logit_scale=0.37), (None, 0.37)),
    Row("Cohere2ForCausalLM", "cohere2/modeling_cohere2.py", 493, COHERE, _text("Cohere2Config", logit_scale=0.37), (None, 0.37)),
    Row("Cohere2MoeForCausalLM", "cohere2_moe/modeling_cohere2_moe.py", 642, COHERE,
        _text("Cohere2MoeConfig", logit_scale=0.37, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), (None, 0.37)),
    Row("FalconH1ForCausalLM", "falcon_h1/modeling_falcon_h1.py", 1225,
        "logits = self.lm_head(hidden_states[:, slice_indices, :]) * self.model.lm_head_multiplier",
        _text("FalconH1Config", lm_head_multiplier=0.6, mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8,
              mamba_n_groups=1, mamba_chunk_size=8), (None, 0.6)),
    Row("Gemma2ForCausalLM", "gemma2/modeling_gemma2.py", 540, SOFTCAP, _text("Gemma2Config", final_logit_softcapping=2.0), (2.0, 1.0)),
    Row("Gemma3ForCausalLM", "gemma3/modeling_gemma3.py", 650, SOFTCAP, _text("Gemma3TextConfig", final_logit_softcapping=2.0), (2.0, 1.0)),
    Row("Gemma3nForCausalLM", "gemma3n/modeling_gemma3n.py", 1892, SOFTCAP,
        _cfg("Gemma3nTextConfig", final_logit_softcapping=2.0, **GEMMA3N), (2.0, 1.0)),
    Row("Gemma3nForConditionalGeneration", "gemma3n/modeling_gemma3n.py", 2321, SOFTCAP_TEXT,
        None, (2.0, 1.0)),  # not built: its vision tower is timm's (not installed); the reader reads its config
    Row("Gemma4ForCausalLM", "gemma4/modeling_gemma4.py", 1893, SOFTCAP,
        _text("Gemma4TextConfig", final_logit_softcapping=2.0, **PER_LAYER), (2.0, 1.0)),
    Row("Gemma4ForConditionalGeneration", "gemma4/modeling_gemma4.py", 2536, SOFTCAP_TEXT,
        _gemma4("Gemma4Config", "Gemma4TextConfig"), (2.0, 1.0)),
    Row("Gemma4UnifiedForCausalLM", "gemma4_unified/modeling_gemma4_unified.py", 759, SOFTCAP,
        _text("Gemma4UnifiedTextConfig", final_logit_softcapping=2.0, **PER_LAYER), (2.0, 1.0)),
    Row("Gemma4UnifiedForConditionalGeneration", "gemma4_unified/modeling_gemma4_unified.py", 1279, SOFTCAP_TEXT,
        _gemma4("Gemma4UnifiedConfig", "Gemma4UnifiedTextConfig"), (2.0, 1.0)),
    Row("GraniteForCausalLM", "granite/modeling_granite.py", 504, GRANITE, _text("GraniteConfig", logits_scaling=0.5), (None, 2.0)),
    Row("GraniteMoeForCausalLM", "granitemoe/modeling_granitemoe.py", 698, GRANITE,
        _text("GraniteMoeConfig", logits_scaling=0.5, **MOE), (None, 2.0)),
    Row("GraniteMoeHybridForCausalLM", "granitemoehybrid/modeling_granitemoehybrid.py", 1379, GRANITE,
        _text("GraniteMoeHybridConfig", logits_scaling=0.5, layer_types=["attention"], mamba_n_heads=2, mamba_d_head=32,
              shared_intermediate_size=32, **MOE), (None, 2.0)),
    Row("GraniteMoeSharedForCausalLM", "granitemoeshared/modeling_granitemoeshared.py", 767, GRANITE,
        _text("GraniteMoeSharedConfig", logits_scaling=0.5, shared_intermediate_size=32, **MOE), (None, 2.0)),
    Row("Granite4VisionForConditionalGeneration", "granite4_vision/modeling_granite4_vision.py", 1161,
        "logits = logits / self.config.text_config.logits_scaling", _granite4_vision, (None, 2.0)),
    Row("HyperCLOVAXForCausalLM", "hyperclovax/modeling_hyperclovax.py", 511,
        "logits = self.lm_head(hidden_states[:, slice_indices, :]) * self.config.logits_scaling",
        _text("HyperCLOVAXConfig", logits_scaling=0.5), (None, 0.5)),
    Row("NanoChatForCausalLM", "nanochat/modeling_nanochat.py", 503, SOFTCAP,
        _text("NanoChatConfig", final_logit_softcapping=2.0), (2.0, 1.0)),
    Row("RecurrentGemmaForCausalLM", "recurrent_gemma/modeling_recurrent_gemma.py", 773,
        "logits = nn.functional.tanh(logits / cap) * cap",
        _text("RecurrentGemmaConfig", logits_soft_cap=2.0, num_hidden_layers=2, lru_width=32, attention_window_size=16,
              block_types=["recurrent", "attention"]), (2.0, 1.0)),
    Row("VaultGemmaForCausalLM", "vaultgemma/modeling_vaultgemma.py", 531, SOFTCAP,
        _text("VaultGemmaConfig", final_logit_softcapping=2.0), (2.0, 1.0)),
    Row("xLSTMForCausalLM", "xlstm/modeling_xlstm.py", 1575, "logits = soft_cap(logits, self.config.output_logit_soft_cap)",
        None, (2.0, 1.0)),  # not built: transformers' native (CPU) mLSTM kernel fails on every tiny shape tried
    Row("T5Gemma2ForConditionalGeneration", "t5gemma2/modeling_t5gemma2.py", 1290, "logits = logits * decoder_config.final_logit_softcapping",
        _cfg("T5Gemma2Config"), "an encoder-decoder model"),
]  # fmt: skip

# Classes whose config carries a transform attribute their forward never applies: the reader gives none (the
# attribute readers before grpo_kernels.hf applied these)
LOOKALIKES = [
    Row("Gemma3ForConditionalGeneration", "gemma3/modeling_gemma3.py", 0, "text_config.final_logit_softcapping unused",
        lambda: transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(final_logit_softcapping=2.0, **TEXT),
                                          vision_config=transformers.SiglipVisionConfig(**SIGLIP), mm_tokens_per_image=4,
                                          image_token_id=63, boi_token_id=61, eoi_token_id=62), (None, 1.0)),
    Row("PaliGemmaForConditionalGeneration", "paligemma/modeling_paligemma.py", 0, "text_config.final_logit_softcapping unused",
        lambda: transformers.PaliGemmaConfig(text_config=transformers.Gemma2Config(final_logit_softcapping=2.0, **TEXT),
                                             vision_config=transformers.SiglipVisionConfig(**SIGLIP), image_token_id=63,
                                             projection_dim=32), (None, 1.0)),
    Row("MptForCausalLM", "mpt/modeling_mpt.py", 0, "config.logit_scale unused",
        _cfg("MptConfig", vocab_size=V, d_model=32, n_heads=2, n_layers=1, logit_scale=2.0), (None, 1.0)),
]  # fmt: skip

BUILT = [r for r in TABLE + LOOKALIKES if r.config is not None and not isinstance(r.expected, str)]


@functools.lru_cache(maxsize=None)  # both tests of a row read the same model (never modified): built once
def _build(row: Row):
    config = row.config()
    torch.manual_seed(0)
    model = getattr(transformers, row.cls)(config).float().eval()
    torch.nn.init.normal_(model.get_output_embeddings().weight, std=0.5)  # logits large enough for the cap to bind
    return model


def _forward(model):
    """(hidden states entering the LM head [N, H], the head, the model's log-softmax [N, V], ids [2, SEQ])."""
    head = model.get_output_embeddings()
    seen = {}
    hook = head.register_forward_pre_hook(lambda module, args: seen.__setitem__("hidden", args[0]))
    ids = torch.randint(0, 60, (2, SEQ), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
    finally:
        hook.remove()
    hidden = seen["hidden"].detach().float()
    return hidden.reshape(-1, hidden.shape[-1]), head, torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1]), ids


def _bound(hidden, head, transform) -> float:
    """fp32 rounding of log_softmax(f(hidden W^T + b)) computed two ways (u = 2^-24): each logit's dot product
    of H terms differs by at most 2 gamma_H sum_k |h_k w_k| (gamma_H = H u / (1 - H u)) plus |b| u; the
    transform f (scale s, then c tanh(. / c)) is s-Lipschitz and adds a few roundings of |z|; log-sum-exp over
    V terms adds (V + 4) u (max|z| + log V). The log-prob z - LSE carries both errors."""
    u = 2.0**-24
    w = head.weight.detach().float()
    h_count, v_count = w.shape[1], w.shape[0]
    gamma = h_count * u / (1 - h_count * u)
    bias = getattr(head, "bias", None)
    dx = 2 * gamma * (hidden.abs() @ w.abs().T).max().item() + (0.0 if bias is None else bias.abs().max().item() * u)
    scale = transform.logit_scale
    x_max = (hidden @ w.T).abs().max().item() * scale
    z_max = x_max if transform.softcap is None else min(x_max, transform.softcap)
    return 2 * scale * dx + 4 * u * z_max + 2 * (v_count + 4) * u * (z_max + math.log(v_count))


def _all_targets(hidden):
    """Every (row, token) pair: hidden rows repeated V times, targets 0..V-1 per row."""
    return hidden.repeat_interleave(V, 0), torch.arange(V).repeat(hidden.shape[0])


def _assert_close(ours, theirs, bound, what):
    diff = (ours - theirs).abs()
    worst = int(diff.argmax())
    assert diff.max().item() <= bound, (
        f"{what}: log-probs differ by {diff.max().item():.3e} > bound {bound:.3e} at flat index {worst} "
        f"(ours {ours.reshape(-1)[worst].item():.6f}, model {theirs.reshape(-1)[worst].item():.6f})"
    )


@pytest.mark.parametrize("row", BUILT, ids=lambda r: r.cls)
def test_library_logprobs_equal_the_models_forward(row):
    model = _build(row)
    transform = hf.logit_transform(model)
    cap, scale = row.expected
    assert (transform.softcap is None if cap is None else transform.softcap == pytest.approx(cap)) and (
        transform.logit_scale == pytest.approx(scale)
    ), f"{row.cls}: the reader gives {transform}, the forward applies {row.expected}"
    hidden, head, reference, _ = _forward(model)
    rows, targets = _all_targets(hidden)
    out = gk.fused_linear_logprobs(rows, head.weight.detach(), targets, getattr(head, "bias", None), backend="torch",
                                   **transform._asdict())  # fmt: skip
    _assert_close(out.logprobs.reshape(reference.shape), reference, _bound(hidden, head, transform), row.cls)


# The trainer runs model.get_decoder() on the batch; PaliGemma's forward builds a prefix-LM mask (the prompt
# attends both ways) that its decoder alone does not: the trainer's log-probs differ from its forward there
# (0.59 nats here) whatever the transform, so its trainer path is not compared (a trainer limitation).
TRAINER_PATH_UNSUPPORTED = {"PaliGemmaForConditionalGeneration"}
PROMPTS, COMPLETIONS = ["1 2 3 =", "4 5 6 =", "7 8 9 ="], ["1 2", "4 4 4", "5"]  # equal prompts: no padding


def _trainer_logprobs(model):
    """The trainer's own path (`_token_logprobs`: backbone, LM head, `**logit_transform(model)`) on three
    completions, and each completion's log-probs from the model's forward on its row alone."""
    from grpo_kernels.trainer import trainer as trainer_module
    from grpo_kernels.trainer.config import TrainConfig
    from grpo_kernels.trainer.model import build_embedded_tokenizer
    from grpo_kernels.trainer.rollout import Rollouts

    tokenizer = build_embedded_tokenizer()
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    completion_ids = [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for c in COMPLETIONS]
    batch = Rollouts(prompts=PROMPTS, answers=["0"] * 3, groups=[0, 0, 1], prompt_tokens=prompt_ids,
                     completion_tokens=completion_ids, completions=COMPLETIONS,
                     truncated=[False] * 3).tensors(tokenizer.pad_token_id, torch.device("cpu"))  # fmt: skip
    compute = trainer_module.Compute(torch.device("cpu"), torch.float32)
    with torch.no_grad():
        ours, _ = trainer_module._token_logprobs(model, batch, TrainConfig(micro_batch_size=4), compute, False)
    pairs = []
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1].double()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0]
        pairs.append((ours[i, : len(c)].double(), expected))
    return pairs


@pytest.mark.parametrize("row", BUILT, ids=lambda r: r.cls)
def test_the_trainer_and_every_adapter_read_the_same_transform(row):
    """Each call site of the reader, on the same model, computes the model's own log-probs."""
    import grpo_kernels.integrations.openrlhf as gk_openrlhf
    import grpo_kernels.integrations.skyrl as gk_skyrl
    import grpo_kernels.integrations.trl as gk_trl
    import grpo_kernels.integrations.unsloth as gk_unsloth
    from grpo_kernels.trainer.model import logit_transform as trainer_transform

    model = _build(row)
    transform = hf.logit_transform(model)
    # the trainer (trainer.py passes **logit_transform(policy)), OpenRLHF's actor forward (model and config)
    assert trainer_transform(model) == transform._asdict()
    assert gk_openrlhf.logit_transform(model) == transform
    assert gk_openrlhf.logit_transform(model.config) == transform, "a bare config reads as its model"

    hidden, head, reference, ids = _forward(model)
    weight, bias = head.weight.detach(), getattr(head, "bias", None)
    bound = _bound(hidden, head, transform)
    at_ids = reference.reshape(2, SEQ, V)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # next-token log-probs

    # the trainer's path end to end: its hidden states come from another call of the same backbone (batched,
    # with an attention mask and positions), so beyond the head's bound they carry the backbone's own fp32
    # differences: 1e-5, as tests/test_trainer.py's check of this path (measured here: <= 3e-6)
    if row.cls not in TRAINER_PATH_UNSUPPORTED:
        for ours, expected in _trainer_logprobs(model):
            torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5, msg=lambda m: f"{row.cls} through the trainer: {m}")

    # SkyRL's FSDP head: the LM head's forward inside the model's, on [B, S, H] hidden states
    call = gk_skyrl._HeadCall(SimpleNamespace(model=model, _gk_backend="torch"), ids, SEQ - 1,
                              torch.ones_like(ids), 1.0, False, False, None)  # fmt: skip
    assert (call.softcap, call.logit_scale) == tuple(transform)
    with torch.no_grad():
        call.head(head, hidden.reshape(2, SEQ, -1))
    _assert_close(call.logprobs[:, :-1], at_ids, bound, f"{row.cls} through SkyRL's head")

    # TRL's head: the model's transform wins over what TRL passes (here: none)
    trl_head = gk_trl.LogProbsHead(gk_trl.KernelOptions(backend="torch", model_transform=transform))
    rows, targets = _all_targets(hidden)
    with torch.no_grad():
        logprobs = trl_head.apply(rows, weight, bias, targets, 1.0, 64, None, 1.0)[0]
    _assert_close(logprobs.reshape(reference.shape), reference, bound, f"{row.cls} through TRL's head")

    # Unsloth's kernel: likewise over what Unsloth passes
    kernel = gk_unsloth.UnslothLogProbsKernel(gk_unsloth.KernelOptions(backend="torch"), model_transform=transform)
    with torch.no_grad():
        logprobs = kernel(rows, weight, targets, bias=bias)
    _assert_close(logprobs.reshape(reference.shape), reference, bound, f"{row.cls} through Unsloth's kernel")


def test_the_unscorable_architecture_is_refused_by_name():
    for row in (r for r in TABLE if isinstance(r.expected, str)):
        with pytest.raises(ValueError, match=f"{row.cls}: {row.expected}"):
            hf.logit_transform(row.config())


def test_unbuilt_rows_read_from_their_config():
    """Rows not built on CPU are read from their config: Gemma 3n's vision-language model (its vision tower
    needs timm; text_config's cap) and xLSTM (transformers' native mLSTM kernel fails on the tiny shapes
    tried: "The expanded size of the tensor (16) must match the existing size (32)")."""
    config = transformers.Gemma3nConfig(text_config=transformers.Gemma3nTextConfig(final_logit_softcapping=2.0, **GEMMA3N))
    assert hf.logit_transform(config) == (2.0, 1.0)
    assert hf.logit_transform(transformers.xLSTMConfig(output_logit_soft_cap=2.0)) == (2.0, 1.0)
    unbuilt = {row.cls for row in TABLE if row.config is None}
    assert unbuilt == {"Gemma3nForConditionalGeneration", "xLSTMForCausalLM"}, unbuilt


def test_a_bad_value_is_refused_naming_the_attribute():
    with pytest.raises(ValueError, match="GraniteForCausalLM's logits_scaling is 0.0"):
        hf.logit_transform(transformers.GraniteConfig(logits_scaling=0.0))
    with pytest.raises(ValueError, match="Gemma2ForCausalLM's final_logit_softcapping is inf"):
        hf.logit_transform(transformers.Gemma2Config(final_logit_softcapping=float("inf")))


# ---------------------------------------------------------------------------------------------------------
# The scan of the pinned transformers' modeling files
# ---------------------------------------------------------------------------------------------------------

_CLASS = re.compile(r"^class (\w+)\((.*?)\):", re.M | re.S)  # a header may span lines
_TOP_LEVEL = re.compile(r"^\S", re.M)


def _causal_lm_classes() -> set[str]:
    """Every causal-LM class: AutoModelForCausalLM's and AutoModelForImageTextToText's (vision-language models
    TRL trains), and every class named *ForCausalLM or *LMHeadModel."""
    from transformers.models.auto import modeling_auto

    return set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) | set(
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values()
    )


def _transforms(forward: ast.FunctionDef, first_line: int) -> list[tuple[int, str]]:
    """The statements of a forward that scale, divide or cap the logits, or scale the hidden states: an
    assignment to a *logits name (not shift_ / router_ / flat_) whose value multiplies, divides or calls
    tanh / soft_cap on the logits or the head's output, an in-place *= / /= on one, or hidden_states = ... * / ..."""
    found = []
    for node in ast.walk(forward):
        if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Mult, ast.Div)) and isinstance(node.target, ast.Name):
            if "logits" in node.target.id or node.target.id in ("hidden_states", "last_hidden_state"):
                found.append((first_line + node.lineno - 1, ast.unparse(node)))
            continue
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        target, value = node.targets[0].id, node.value
        parts = list(ast.walk(value))
        arithmetic = any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Div)) for n in parts)
        capped = any(isinstance(n, ast.Call) and re.search(r"tanh|soft_?cap", ast.unparse(n.func)) for n in parts)
        on_logits = any(isinstance(n, ast.Name) and "logits" in n.id for n in parts) or any(
            isinstance(n, ast.Call) and "head" in ast.unparse(n.func) for n in parts)  # fmt: skip
        if "logits" in target and not target.startswith(("shift", "router", "flat")) and (arithmetic or capped) and on_logits:
            found.append((first_line + node.lineno - 1, ast.unparse(node)))
        elif target in ("hidden_states", "last_hidden_state") and arithmetic:
            found.append((first_line + node.lineno - 1, ast.unparse(node)))
    return found


def scan_modeling_files() -> dict[str, tuple[str, list[tuple[int, str]]]]:
    """class -> (modeling file, its forward's transforming statements) for every causal-LM class defined with a
    forward of its own in transformers/models/*/modeling_*.py (each class's source parsed alone: ~1 s)."""
    wanted = _causal_lm_classes()
    result = {}
    for path in sorted(MODELS.glob("*/modeling_*.py")):
        text = path.read_text()
        for match in _CLASS.finditer(text):
            name = match.group(1)
            if name not in wanted and not name.endswith(("ForCausalLM", "LMHeadModel")):
                continue
            end = _TOP_LEVEL.search(text, match.end())
            body = text[match.start() : end.start() if end else len(text)]
            tree = ast.parse(body).body[0]
            forward = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
            if forward is not None:
                first_line = text.count("\n", 0, match.start()) + 1
                result[name] = (path.relative_to(MODELS).as_posix(), _transforms(forward, first_line))
    return result


def test_every_transforming_architecture_is_in_the_table():
    scanned = scan_modeling_files()
    transforming = {name: hits for name, (_, hits) in scanned.items() if hits}
    table = {row.cls: row for row in TABLE}
    missing = sorted(set(transforming) - set(table))
    assert not missing, (
        "causal-LM forwards of this transformers that transform their logits (or the hidden states before the "
        "head) and are not in TABLE / grpo_kernels.hf.RULES: "
        + "; ".join(f"{name} ({scanned[name][0]}: {transforming[name]})" for name in missing)
    )
    stale = sorted(set(table) - set(transforming))
    assert not stale, f"TABLE rows whose forward no longer transforms its logits: {stale}"
    for row in TABLE:
        file, hits = scanned[row.cls]
        assert file == row.file, f"{row.cls} lives in {file}, TABLE says {row.file}"
        assert (row.line, row.mirrors) in hits, f"{row.cls}: {row.file}:{row.line} no longer holds {row.mirrors!r}: {hits}"
        assert row.cls in hf.RULES or row.cls in hf.REFUSED, f"{row.cls} is in TABLE but not in grpo_kernels.hf's"
    assert set(hf.RULES) | set(hf.REFUSED) == set(table), "grpo_kernels.hf's RULES / REFUSED and TABLE disagree"
    for row in LOOKALIKES:
        assert row.cls in scanned and not scanned[row.cls][1], f"{row.cls} now transforms its logits: {scanned[row.cls]}"


def test_the_scan_finds_a_transform_it_has_not_seen():
    """The pattern is not vacuous: a forward that scales its logits under a new name is found."""
    source = (
        "class NewForCausalLM(PreTrainedModel):\n"
        "    def forward(self, input_ids):\n"
        "        hidden_states = self.model(input_ids)[0]\n"
        "        logits = self.lm_head(hidden_states)\n"
        "        logits = logits * self.config.brand_new_multiplier\n"
        "        return logits\n"
    )
    forward = ast.parse(source).body[0].body[0]
    assert _transforms(forward, 1) == [(5, "logits = logits * self.config.brand_new_multiplier")]


def test_wrappers_and_classes_outside_transformers():
    """The reader sees through PEFT, torch.compile and FSDP2's swapped-in FSDP<name> class (defined in torch) to
    the transformers class; a class from outside transformers (remote code) is read as TRL reads configs."""
    peft = pytest.importorskip("peft")
    model = transformers.HyperCLOVAXForCausalLM(transformers.HyperCLOVAXConfig(logits_scaling=0.5, **TEXT))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj"]))
    assert hf.logit_transform(wrapped) == (None, 0.5)
    assert hf.logit_transform(torch.compile(wrapped)) == (None, 0.5)
    fsdp_class = type("FSDPHyperCLOVAXForCausalLM", (type(model),), {"__module__": "torch.distributed.fsdp._fully_shard"})
    model.__class__ = fsdp_class
    assert hf.logit_transform(model) == (None, 0.5), "FSDP2's class swap hides the architecture"

    class RemoteCode(torch.nn.Module):  # e.g. a trust_remote_code model dividing by logits_scaling
        config = transformers.PretrainedConfig(logits_scaling=4.0, final_logit_softcapping=30.0)

    assert hf.logit_transform(RemoteCode()) == (30.0, 0.25)
