"""The trainer's vLLM sampler (grpo_kernels/trainer/rollout.py VLLMSampler) against a real engine (marker
`vllm`: .ci/run runs these in its vLLM environment, the CPU engine; skipped elsewhere with the install hint).

One engine per dtype for the whole module (starting one takes seconds), on the embedded default model, which
the engine must be able to serve as it is (2 heads of 32: vLLM's CPU attention takes no head size 16).

* Weight sync: after 5 AdamW steps of the training model, the engine's log-probs of fixed token sequences
  are far from the new weights' until `sync_weights`, then as close to the fp64 truth as PyTorch's own
  forward in the engine's dtype (at most 2x its error, plus the fp32 log-softmax's rounding): fp32 and bf16.
* Sampling: the sampled tokens' log-probs are those of softmax(z / T) (processed log-probs) at T != 1, and
  each row's sample depends on its own seed only (drawn from torch's generator), not on the batch around it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from vllm_support import require_vllm

from grpo_kernels.testing.compare import assert_no_worse_than

EOS = 2
# fixed token sequences over the embedded vocabulary (<bos>, then digits and symbols, then <eos>)
SEQUENCES = [[1] + torch.randint(4, 16, (20,), generator=torch.Generator().manual_seed(s)).tolist() + [EOS]
             for s in range(4)]  # fmt: skip
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# vLLM casts the logits to fp32 before its log-softmax (v1/sample/sampler.py), whatever the model's dtype:
# a few fp32 ulps of the largest |log-prob| on top of the error the logits bring (PyTorch's same-dtype error)
LOG_SOFTMAX_ULPS = 4 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from grpo_kernels.trainer.model import build_embedded_model

    folder = tmp_path_factory.mktemp("embedded")
    model, tokenizer = build_embedded_model(0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request, model_dir):
    require_vllm()
    from grpo_kernels.trainer.rollout import VLLMSampler

    sampler = VLLMSampler(model_dir, [EOS], temperature=1.0, seed=0, dtype=request.param, enforce_eager=True)
    yield sampler
    sampler.close()  # before the next dtype's engine: a late teardown would take its process groups


def engine_logprobs(sampler, sequences=SEQUENCES) -> torch.Tensor:
    """[S, L - 1] the engine's log-prob of each token after the first, given the ones before (prompt
    log-probs: the model's own softmax, no temperature)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outputs = sampler.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return torch.tensor(
        [[out.prompt_logprobs[i][seq[i]].logprob for i in range(1, len(seq))]
         for out, seq in zip(outputs, sequences)],  # fmt: skip
        dtype=torch.float64,
    )


@torch.no_grad()
def model_logprobs(model, dtype: torch.dtype, sequences=SEQUENCES, temperature: float = 1.0) -> torch.Tensor:
    """[S, L - 1] the transformers model's log-probs of the same tokens under softmax(z / T), its forward run
    in `dtype` (the softmax in fp64)."""
    ids = torch.tensor(sequences)
    logits = copy.deepcopy(model).to(dtype)(ids).logits[:, :-1].double()
    return (logits / temperature).log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0]


def trained_policy(steps: int = 5):
    """The embedded model after `steps` AdamW steps (lr 1e-2) of next-token loss on SEQUENCES."""
    from grpo_kernels.trainer.model import build_embedded_model

    model, _ = build_embedded_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor(SEQUENCES)
    for _ in range(steps):
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    return model


@pytest.mark.vllm
def test_engine_follows_the_training_weights_after_optimizer_steps(engine):
    require_vllm()
    from grpo_kernels.trainer.model import build_embedded_model

    initial, _ = build_embedded_model(0)
    engine.sync_weights(initial)  # the module's engine may have been synced by another test
    policy = trained_policy()
    truth = model_logprobs(policy, torch.float64)
    same_dtype = model_logprobs(policy, TORCH_DTYPES[engine.dtype])  # PyTorch's own error in this dtype
    floor = LOG_SOFTMAX_ULPS * truth.abs().max().item()
    tolerance = 2.0 * (same_dtype - truth).abs().max().item() + floor

    stale = (engine_logprobs(engine) - truth).abs().max().item()
    assert stale > 10 * tolerance, f"the optimizer steps should move the log-probs past tolerance: {stale}"

    engine.sync_weights(policy)
    assert engine.sync_call == "reload_weights"  # the worker API call (not the older model.load_weights)
    synced = engine_logprobs(engine)
    assert_no_worse_than(f"{engine.dtype} engine, synced", synced, same_dtype, truth, factor=2.0, floor=floor)
    stats = engine.take_stats()
    assert stats["vllm/sync_s"] > 0 and stats["vllm/generate_s"] == 0.0  # prompt scoring is not generate()


@pytest.mark.vllm
def test_sampled_logprobs_are_those_of_the_tempered_softmax(engine):
    require_vllm()
    from grpo_kernels.trainer.model import build_embedded_model

    policy, _ = build_embedded_model(0)
    engine.sync_weights(policy)
    temperature = 0.7
    engine.temperature = temperature
    try:
        torch.manual_seed(0)
        prompts = [seq[:6] for seq in SEQUENCES]
        completions, truncated, logprobs = engine.generate(prompts, max_new_tokens=8)
    finally:
        engine.temperature = 1.0
    assert len(completions) == len(truncated) == len(logprobs) == len(prompts)
    truths, same_dtypes, gots = [], [], []
    for prompt, tokens, sampled, cut in zip(prompts, completions, logprobs, truncated):
        assert len(sampled) == len(tokens) >= 1
        assert cut == (EOS not in tokens) and (cut or tokens[-1] == EOS)  # cut after the first EOS
        sequence, first = [prompt + tokens], len(prompt) - 1  # position `first` predicts the first sample
        truths.append(model_logprobs(policy, torch.float64, sequence, temperature)[0, first:])
        same_dtypes.append(model_logprobs(policy, TORCH_DTYPES[engine.dtype], sequence, temperature)[0, first:])
        gots.append(torch.tensor(sampled, dtype=torch.float64))
    # every sampled token at once: the largest error over a few tokens of one row is too noisy a statistic to
    # hold against another implementation's (two bf16 forwards with their own rounding), over all rows it is not
    truth, same_dtype, got = torch.cat(truths), torch.cat(same_dtypes), torch.cat(gots)
    floor = LOG_SOFTMAX_ULPS * truth.abs().max().item()
    assert_no_worse_than(f"{engine.dtype} sampled log-probs at T={temperature}", got, same_dtype, truth,
                         factor=2.0, floor=floor)  # fmt: skip


@pytest.mark.vllm
def test_each_row_samples_from_its_own_seed_whatever_the_batch(engine):
    require_vllm()
    from grpo_kernels.trainer.model import build_embedded_model

    policy, _ = build_embedded_model(0)
    engine.sync_weights(policy)
    prompt = SEQUENCES[0][:4]
    torch.manual_seed(7)
    alone, _, alone_logprobs = engine.generate([prompt] * 3, max_new_tokens=10)
    torch.manual_seed(7)
    batched, _, batched_logprobs = engine.generate([prompt] * 3 + [SEQUENCES[1][:5]] * 5, max_new_tokens=10)
    assert batched[:3] == alone, "a row's sample changed with the rows sampled beside it"
    assert len({tuple(c) for c in alone}) > 1, "rows of one group must not share a seed (identical samples)"
    torch.manual_seed(8)
    other, _, _ = engine.generate([prompt] * 3, max_new_tokens=10)
    assert other != alone, "another seed should give other samples"
