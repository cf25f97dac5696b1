"""The policy: the embedded tiny model (built here, nothing downloaded) or a local Hugging Face causal LM,
and the two handles the fused loss needs from it: the backbone's last hidden states and the LM-head weight.
"""

from __future__ import annotations

import os

import torch

from ..hf import logit_transform as logit_transform_of

# The embedded default: a 2-layer Llama small enough to learn the built-in tasks by RL on a 2-core CPU in
# minutes. Its vocabulary is digits and a few symbols, one token per whitespace-separated word.
EMBEDDED_VOCAB = ("<pad>", "<bos>", "<eos>", "<unk>", "=", "+", *(str(d) for d in range(10)))
EMBEDDED_MODEL = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    # 2 heads of 32: vLLM's CPU attention takes head sizes 32, 64, 80, ... (not 16), so the embedded model
    # can be served by a vLLM engine as it is (`--rollout-engine vllm`); the parameter count is unchanged
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
EMBEDDED_NAME = "embedded tiny Llama (2 layers, hidden 64, 2 heads of 32, vocab 16)"



def build_embedded_tokenizer():
    """A word-level tokenizer over EMBEDDED_VOCAB: "3 1 4 =" -> <bos> 3 1 4 =; decode joins with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(EMBEDDED_VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_embedded_model(seed: int):
    """The embedded default policy, randomly initialised from `seed` (fp32), and its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_embedded_tokenizer()
    config = LlamaConfig(
        vocab_size=len(EMBEDDED_VOCAB),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **EMBEDDED_MODEL,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model, tokenizer


def load_pretrained(path: str):
    """A local Hugging Face causal LM folder (config.json + weights + tokenizer) in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"--model {path!r}: no such directory (expected a local Hugging Face model folder)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--model {path!r}: no config.json there; is it a Hugging Face model folder?")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--model {path!r}: the tokenizer has no eos token; completions could never end")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    try:
        logit_transform(model)
    except ValueError as exc:
        raise ValueError(f"--model {path!r}: {exc}") from None
    return model, tokenizer


def logit_transform(model) -> dict:
    """The model's transform of the LM head's output before the softmax, as the fused functions' keywords
    ``softcap`` and ``logit_scale``, so that the loss's softmax is the one the sampler draws from: read by
    `grpo_kernels.hf.logit_transform` (per architecture; ValueError naming what it cannot express)."""
    return logit_transform_of(model)._asdict()


def load_policy(model_path: str | None, seed: int):
    """(model, tokenizer, description): the embedded default when model_path is None."""
    if model_path is None:
        model, tokenizer = build_embedded_model(seed)
        return model, tokenizer, EMBEDDED_NAME
    model, tokenizer = load_pretrained(model_path)
    return model, tokenizer, f"{type(model).__name__} from {model_path}"


def lm_head_params(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's weight [V, H] and bias [V] (or None)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"the model's output embeddings are a {type(head).__name__}, not a Linear LM head")
    return head.weight, head.bias


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion (the tokenizer's eos and the model's generation eos ids)."""
    ids = {tokenizer.eos_token_id}
    generation_eos = getattr(model.generation_config, "eos_token_id", None)
    if generation_eos is not None:
        ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return sorted(i for i in ids if i is not None)
