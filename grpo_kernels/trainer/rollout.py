"""Rollouts (sampled completions as token lists, group by group) and the samplers that produce them:
transformers' generate, or a colocated vLLM engine whose per-token log-probs feed the IS correction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch


@dataclass
class Rollouts:
    """Completions of one step, G per prompt, each group's rows consecutive, scored by the trainer.
    Multi-turn episodes add the turn structure (policy turns and environment replies in one completion).

    Token lists (not padded tensors) so that hooks can drop, add and rewrite rows; `tensors()` pads them.
    """

    prompts: list[str]  # [B] prompt text, repeated across a group
    answers: list[str]  # [B]
    groups: list[int]  # [B] group label; rows of one group are consecutive (renumbered 0..G-1 by group_index)
    prompt_tokens: list[list[int]]  # [B] prompt token ids
    completion_tokens: list[list[int]]  # [B] sampled ids, the first EOS included when one was sampled
    completions: list[str]  # [B] completion text before the first EOS (what the reward sees)
    truncated: list[bool]  # [B] no EOS within the generation budget
    rollout_logprobs: list[list[float]] | None = None  # [B] the sampler's log-prob of each completion token
    rewards: torch.Tensor | None = None  # [B] fp32 training reward (after shaping), set by scoring
    task_rewards: torch.Tensor | None = None  # [B] fp32 the first reward function's value (solved, logs)
    reward_components: torch.Tensor | None = None  # [B, K] fp32 each reward function (multi-reward methods)
    # multi-turn episodes (None for one-turn tasks): the completion interleaves policy turns and tool output
    turn_ids: list[list[int]] | None = None  # [B] per completion token: its turn 0..K-1, -1 for tool output
    turn_rewards: torch.Tensor | None = None  # [B, K] fp32 reward of each policy turn
    state_keys: list[list[str]] | None = None  # [B] per turn: the environment state the turn started from

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, rows: list[int]) -> Rollouts:
        """The rows `rows` (ascending), as a new Rollouts."""
        index = torch.as_tensor(rows, dtype=torch.long)

        def pick(value):
            if value is None:
                return None
            return value[index] if isinstance(value, torch.Tensor) else [value[i] for i in rows]

        return Rollouts(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        """The rows of every part, in order; group labels must already be distinct across parts."""

        def join(values):
            if values[0] is None:
                return None
            return (
                torch.cat(values) if isinstance(values[0], torch.Tensor) else [x for v in values for x in v]
            )

        return Rollouts(**{f.name: join([getattr(p, f.name) for p in parts]) for f in fields(Rollouts)})

    def with_completions(
        self, rows: list[int], tokens: list[list[int]], texts: list[str], truncated: list[bool]
    ):
        """A copy where rows `rows` have new completions (hooks that rewrite samples); rewards are cleared
        and sampler log-probs dropped (rewritten tokens were not sampled by the engine)."""
        completion_tokens, completions, flags = (
            list(self.completion_tokens),
            list(self.completions),
            list(self.truncated),
        )
        for row, new_tokens, text, flag in zip(rows, tokens, texts, truncated):
            completion_tokens[row], completions[row], flags[row] = new_tokens, text, flag
        return replace(
            self,
            completion_tokens=completion_tokens,
            completions=completions,
            truncated=flags,
            rollout_logprobs=None,
            rewards=None,
            task_rewards=None,
            reward_components=None,
        )

    @property
    def group_index(self) -> torch.Tensor:
        """int64 [B]: group labels renumbered 0..G-1 in order of appearance."""
        index, seen = [], {}
        for label in self.groups:
            index.append(seen.setdefault(label, len(seen)))
        return torch.tensor(index, dtype=torch.long)

    @property
    def prompt_keys(self) -> list[str]:
        """[G] the prompt text of each group (identifies a prompt across steps: DCPO's running statistics)."""
        keys, seen = [], set()
        for label, prompt in zip(self.groups, self.prompts):
            if label not in seen:
                seen.add(label)
                keys.append(prompt)
        return keys

    def tensors(self, pad_id: int, device) -> PaddedBatch:
        return PaddedBatch.build(self, pad_id, device)


@dataclass
class PaddedBatch:
    """Rollouts as tensors: prompts left-padded to P, completions right-padded to C; the trainer adds the
    per-sequence / per-token inputs of the loss before the update."""

    prompt_ids: torch.Tensor  # [B, P] int64
    prompt_mask: torch.Tensor  # [B, P] bool
    completion_ids: torch.Tensor  # [B, C] int64
    completion_mask: torch.Tensor  # [B, C] bool: the completion's tokens, its EOS included (attention)
    rollout_logprobs: torch.Tensor | None  # [B, C] fp32 (0 on padding) or None
    loss_mask: torch.Tensor | None = None  # [B, C] bool: the tokens the policy is trained on (see build)
    turn_ids: torch.Tensor | None = None  # [B, C] int64 turn of each token, -1 for tool output / padding
    advantages: torch.Tensor | None = None  # [B] or [B, C]
    old_logprobs: torch.Tensor | None = None  # [B, C]; None: on-policy (one update per batch)
    ref_logprobs: torch.Tensor | None = None  # [B, C]; None: no KL term

    @staticmethod
    def build(rollouts: Rollouts, pad_id: int, device) -> PaddedBatch:
        prompt_ids, prompt_mask = _pad(rollouts.prompt_tokens, pad_id, left=True)
        completion_ids, completion_mask = _pad(rollouts.completion_tokens, pad_id, left=False)
        logprobs = None
        if rollouts.rollout_logprobs is not None:
            logprobs = _pad(rollouts.rollout_logprobs, 0.0, left=False, dtype=torch.float32)[0].to(device)
        turn_ids, loss_mask = None, completion_mask  # one turn: every completion token is the policy's
        if rollouts.turn_ids is not None:  # tool output is attended to, but is not the policy's to learn
            turn_ids = _pad(rollouts.turn_ids, -1, left=False)[0]
            loss_mask = completion_mask & (turn_ids >= 0)
            turn_ids = turn_ids.to(device)
        return PaddedBatch(
            prompt_ids.to(device),
            prompt_mask.to(device),
            completion_ids.to(device),
            completion_mask.to(device),
            logprobs,
            loss_mask.to(device),
            turn_ids,
        )

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, rows: torch.Tensor) -> PaddedBatch:
        """The rows `rows` (int64 [b], ascending) of every per-row tensor (CPPO pruning)."""
        return PaddedBatch(
            **{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows] for f in fields(self)}
        )


def _pad(rows: list[list], value, left: bool, dtype=torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(r) for r in rows)
    out = torch.full((len(rows), length), value, dtype=dtype)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        if not r:
            continue
        span = slice(length - len(r), length) if left else slice(0, len(r))
        out[i, span] = torch.tensor(r, dtype=dtype)
        mask[i, span] = True
    return out, mask


def cut_at_eos(tokens: list[int], eos_ids: list[int], budget: int) -> tuple[list[int], bool]:
    """(tokens up to and including the first EOS, truncated: no EOS within the budget)."""
    for i, token in enumerate(tokens[:budget]):
        if token in eos_ids:
            return tokens[: i + 1], False
    return tokens[:budget], True


class HFSampler:
    """Samples with transformers' generate from the training weights (so no sampler mismatch to correct)."""

    def __init__(self, model, tokenizer, eos_ids: list[int], temperature: float, autocast):
        from transformers import GenerationConfig

        self.model, self.tokenizer, self.eos_ids, self.autocast = model, tokenizer, eos_ids, autocast
        # Every processor that would change the distribution the loss assumes (softmax(z / T)) is set to its
        # neutral value explicitly, so the model's own generation_config (top_k, top_p, ...) cannot apply.
        self.generation_config = lambda max_new_tokens: GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            typical_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_new_tokens=0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos_ids,
        )

    def sync_weights(self, model) -> None:
        pass  # generate uses the training model itself

    @torch.no_grad()
    def generate(self, prompt_tokens: list[list[int]], max_new_tokens: int):
        """([B] completion token lists cut after the first EOS, [B] truncated flags, None: no sampler
        log-probs)."""
        device = next(self.model.parameters()).device
        ids, mask = _pad(prompt_tokens, self.tokenizer.pad_token_id, left=True)
        was_training = self.model.training
        self.model.eval()
        with self.autocast():
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.long().to(device),
                generation_config=self.generation_config(max_new_tokens),
            )
        self.model.train(was_training)
        completions, truncated = [], []
        for row in out[:, ids.shape[1] :].tolist():
            tokens, cut = cut_at_eos(row, self.eos_ids, max_new_tokens)
            completions.append(tokens)
            truncated.append(cut)
        return completions, truncated, None


class VLLMSampler:
    """A colocated vLLM engine (the `vllm` extra; CUDA only). Weights are pushed from the training model
    before each step's sampling; the sampled tokens' log-probs (after temperature, "processed_logprobs")
    become rollout_logprobs for the truncated-IS correction (PolicyLossConfig.is_level)."""

    def __init__(
        self, model_dir: str, eos_ids: list[int], temperature: float, seed: int, gpu_memory_utilization=0.3
    ):
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ValueError(
                f"rollout_engine='vllm' needs vLLM: pip install 'grpo-kernels[vllm]' ({exc})"
            ) from None
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine must live in this process
        self.eos_ids, self.temperature, self.seed = eos_ids, temperature, seed
        self.llm = LLM(
            model=model_dir,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            dtype="bfloat16",
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
        )

    def sync_weights(self, model) -> None:
        engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for name, tensor in model.state_dict().items():
            engine_model.load_weights([(name, tensor)])
        self.llm.reset_prefix_cache()

    def generate(self, prompt_tokens: list[list[int]], max_new_tokens: int):
        from vllm import SamplingParams

        params = SamplingParams(
            n=1,
            temperature=self.temperature,
            top_p=1.0,
            top_k=-1,
            min_p=0.0,
            max_tokens=max_new_tokens,
            logprobs=0,
            stop_token_ids=self.eos_ids,
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompt_tokens], sampling_params=params, use_tqdm=False
        )
        completions, truncated, logprobs = [], [], []
        for output in outputs:
            sample = output.outputs[0]
            tokens, cut = cut_at_eos(list(sample.token_ids), self.eos_ids, max_new_tokens)
            completions.append(tokens)
            truncated.append(cut)
            # sample.logprobs: one {token_id: Logprob} per generated token, the sampled token always in it
            logprobs.append([step[token].logprob for step, token in zip(sample.logprobs, tokens)])
        return completions, truncated, logprobs
