"""TrainConfig: every setting of a training run, with named presets (GRPO, DAPO, Dr. GRPO, GSPO, ...).

A preset fills the algorithm fields (the PolicyLossConfig preset and overrides, the advantage estimator,
the rollout hook, sampling tricks); the rest are shared defaults tuned so that the embedded tiny model
solves the built-in "copy" task on a 2-core CPU in a few minutes. Validation happens here, once, so a run
never starts with a setting it would ignore.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from ..advantages import registry as advantage_registry
from ..config import PolicyLossConfig
from .hooks import make_hook
from .rollout import VLLM_DTYPES

ROLLOUT_ENGINES = ("hf", "vllm")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")
BACKENDS = ("auto", "torch", "triton")
HOOKS = (None, "edge_gec", "gfpo", "lopti", "two_rollouts")  # see hooks.py
# Estimator options the trainer fills from the batch; a user cannot also set them.
BATCH_OPTIONS = ("entropy", "mask", "lengths", "state", "prompt_keys", "correct", "completion_ids")
# Options filled from a multi-turn task's episodes (trainer/multiturn.py): turns are MT-GRPO's turns and
# GiGPO's steps, the context a turn started from is its anchor state.
EPISODE_OPTIONS = ("turn_rewards", "turn_ids", "step_rewards", "state_ids", "step_ids")
# REINFORCE++'s KL-in-reward: the sampling policy's and the reference's log-probs, filled when kl_coef > 0.
KL_REWARD_OPTIONS = ("logprobs", "ref_logprobs")


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run, validated on construction (a bad value raises ``ValueError``).

    ``TrainConfig.from_preset("dapo", steps=100)`` starts from a named preset (``PRESETS``); each field's
    comment below is its help text in ``grpo-kernels train --help``, where every field is an option
    (``--max-new-tokens``, ``--loss-option KEY=VALUE`` for the dict fields).
    """

    # --- model and task -------------------------------------------------------------------------------
    model: str | None = None  # local Hugging Face causal LM folder; None: the embedded tiny Llama
    task: str = "copy"  # copy, reverse, max, lookup (two turns, a tool), a .jsonl file, or module:make_task
    reward: str | None = None  # REWARDS name or module:function; a,b: several (the first decides solved)
    truncate_prompts: bool = False  # cut prompts too long for the model's context from the left (else refused)
    keep_dropout: bool = False  # keep the model's dropout in the training forward (else off in policy and reference)
    # --- algorithm (what a preset sets) --------------------------------------------------------------
    preset: str = "grpo"  # the preset these fields started from (recorded in config.json)
    loss: str = "grpo"  # PolicyLossConfig preset
    loss_options: dict = field(default_factory=dict)  # PolicyLossConfig field overrides
    advantage: str = "grpo"  # gk.advantages estimator
    advantage_options: dict = field(default_factory=dict)  # estimator options (the batch fills the rest)
    hook: str | None = None  # rollout hook between scoring and the update (see hooks.py)
    hook_options: dict = field(default_factory=dict)  # the hook's options (see hooks.py)
    dynamic_sampling: bool = False  # DAPO: drop groups with equal rewards and sample more to refill
    max_sampling_rounds: int | None = None  # dynamic sampling: sampling rounds per step at most (None: 4)
    ref_reset_interval: int | None = None  # ProRL: every N steps the reference becomes the current policy
    correct_reward: float = 1.0  # a completion counts as correct (solved) when its reward >= this
    # --- reward shaping and pruning (applied to the task reward before the advantages) -----------------
    overlong_cache: int | None = None  # DAPO soft overlong punishment over N extra budget tokens
    overlong_filter: bool = False  # DAPO overlong filtering: truncated completions (no EOS) get no loss
    lead_length_alpha: float | None = None  # GRPO-LEAD reward: exp(-alpha z_length) if correct, else -1
    diversity_coef: float | None = None  # DIVER: + coef x group textual diversity, correct completions
    prune_fraction: float | None = None  # CPPO: drop this fraction of each group, smallest |advantage|
    # --- sampling -------------------------------------------------------------------------------------
    prompts_per_step: int = 32  # groups per optimizer step
    group_size: int = 8  # completions per prompt (GFPO samples more, then keeps group_size)
    temperature: float = 1.0  # sampling temperature, also the loss's (PolicyLossConfig.temperature)
    max_new_tokens: int | None = None  # None: the task's own budget
    rollout_engine: str = "hf"  # "hf": transformers generate; "vllm": a colocated vLLM engine (README)
    vllm_dtype: str = "auto"  # the vLLM engine's dtype: auto = bfloat16 on a GPU, float32 on a CPU
    # --- optimisation ---------------------------------------------------------------------------------
    steps: int = 200  # optimizer steps = rollout batches
    lr: float = 1e-3  # AdamW, constant after warmup (so a resumed run can be extended exactly)
    warmup_steps: int = 10  # the learning rate rises linearly over these first steps
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    adam_beta1: float = 0.9  # AdamW first-moment decay
    adam_beta2: float = 0.99  # AdamW second-moment decay
    grad_clip: float | None = 1.0  # max global grad norm; None: no clipping
    num_iterations: int = 2  # updates per rollout batch (>1: old-policy log-probs, ratios, clipping)
    micro_batch_size: int = 64  # sequences per forward / backward (gradient accumulation within a step)
    # --- runtime --------------------------------------------------------------------------------------
    device: str = "auto"  # cuda when available
    dtype: str = "auto"  # compute dtype: bfloat16 on CUDA, float32 on CPU (weights stay fp32)
    backend: str = "auto"  # grpo_kernels backend: Triton on CUDA, PyTorch elsewhere
    seed: int = 0  # model initialisation (embedded default), prompts, sampling
    cpu_threads: int | None = 1  # torch threads on CPU (a tiny model runs fastest on 1); None: torch's
    fsdp: bool = False  # under torchrun: shard the policy with FSDP2 (per decoder layer) instead of DDP
    batch_invariant: bool = False  # each token's log-prob bitwise independent of its micro-batch
    # --- output ---------------------------------------------------------------------------------------
    run_dir: str | None = None  # None: runs/<timestamp>
    save_every: int = 50  # checkpoint (and plot) every N steps; the last step is always saved
    keep_checkpoints: int = 2  # how many checkpoints to keep (oldest deleted first)

    def __post_init__(self) -> None:
        def check(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(f"TrainConfig: {message}")

        for name in (
            "prompts_per_step",
            "group_size",
            "steps",
            "num_iterations",
            "micro_batch_size",
            "save_every",
            "keep_checkpoints",
        ):
            value = getattr(self, name)
            check(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name} must be an int >= 1, got {value!r}",
            )
        check(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("lr", "temperature"):
            value = getattr(self, name)
            check(
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
                f"{name} must be > 0, got {value!r}",
            )
        check(self.weight_decay >= 0, "weight_decay must be >= 0")
        check(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "adam betas must be in [0, 1)")
        check(
            self.grad_clip is None or self.grad_clip > 0,
            f"grad_clip must be > 0 or None, got {self.grad_clip}",
        )
        check(
            self.group_size >= 2, "group_size must be >= 2 (group-relative advantages need two completions)"
        )
        check(self.max_new_tokens is None or self.max_new_tokens >= 1, "max_new_tokens must be >= 1")
        check(
            self.overlong_cache is None or (isinstance(self.overlong_cache, int) and self.overlong_cache >= 1),
            f"overlong_cache must be an int >= 1 (tokens) or None, got {self.overlong_cache!r}",
        )
        check(
            self.lead_length_alpha is None or self.lead_length_alpha > 0,
            f"lead_length_alpha must be > 0 or None, got {self.lead_length_alpha!r}",
        )
        check(
            self.diversity_coef is None or self.diversity_coef >= 0,
            f"diversity_coef must be >= 0 or None, got {self.diversity_coef!r}",
        )
        check(
            self.prune_fraction is None or 0 <= self.prune_fraction < 1,
            f"prune_fraction must be in [0, 1) or None, got {self.prune_fraction!r}",
        )
        check(
            not (self.lead_length_alpha is not None and self.diversity_coef is not None),
            "lead_length_alpha replaces the reward of correct completions; combine it with diversity_coef in "
            "your own reward function",
        )
        if self.max_sampling_rounds is not None:
            check(self.dynamic_sampling, "max_sampling_rounds is only used with dynamic_sampling")
            check(self.max_sampling_rounds >= 1, "max_sampling_rounds must be >= 1")
        check(
            self.ref_reset_interval is None or self.ref_reset_interval >= 1, "ref_reset_interval must be >= 1"
        )
        check(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads must be >= 1 or None")
        check(self.rollout_engine in ROLLOUT_ENGINES, f"rollout_engine must be one of {ROLLOUT_ENGINES}")
        check(self.vllm_dtype in VLLM_DTYPES, f"vllm_dtype must be one of {VLLM_DTYPES}, not {self.vllm_dtype!r}")
        check(
            self.vllm_dtype == "auto" or self.rollout_engine == "vllm",
            f"vllm_dtype={self.vllm_dtype!r} sets the vLLM engine's dtype: it needs --rollout-engine vllm",
        )
        check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        check(self.hook in HOOKS, f"unknown hook {self.hook!r}; known: {HOOKS[1:]}")
        if self.hook is None:
            check(not self.hook_options, f"hook_options {self.hook_options} given but no hook is set")
        check(
            self.loss in PolicyLossConfig.PRESETS,
            f"unknown loss preset {self.loss!r}; known: {PolicyLossConfig.PRESETS}",
        )
        for reserved in ("temperature", "max_completion_length"):
            check(
                reserved not in self.loss_options,
                f"loss_options may not set {reserved!r}: the trainer sets it from "
                + ("--temperature" if reserved == "temperature" else "--max-new-tokens"),
            )
        loss = self.loss_config(max_new_tokens=self.max_new_tokens or 1)  # raises on an unknown / bad field
        check(
            self.ref_reset_interval is None or loss.needs_reference,
            "ref_reset_interval resets the KL reference, but this loss has none (kl_coef = 0)",
        )
        if loss.loss_type == "group_dpo":
            check(
                self.micro_batch_size % self.group_size == 0,
                f"loss_type='group_dpo' compares completions within a group, so a micro-batch holds whole "
                f"groups: micro_batch_size={self.micro_batch_size} must be a multiple of group_size="
                f"{self.group_size}",
            )
            check(self.prune_fraction is None, "prune_fraction breaks the groups group_dpo compares")
        if loss.uses_rollout_logprobs:
            check(
                self.rollout_engine == "vllm",
                "is_level / is_gate / ratio_anchor='rollout' / off_policy_mask_threshold need the sampler's log-probs "
                "(--rollout-engine vllm) "
                "(transformers' generate samples with the training weights: no mismatch to correct)",
            )
        spec = advantage_registry.get(self.advantage)  # raises on an unknown name
        unknown = sorted(set(self.advantage_options) - set(spec.options))
        check(
            not unknown,
            f"advantage {self.advantage!r} has no option(s) {unknown}; its options: {list(spec.options)}",
        )
        filled = BATCH_OPTIONS + EPISODE_OPTIONS + KL_REWARD_OPTIONS
        supplied = sorted(set(self.advantage_options) & set(filled))
        check(not supplied, f"advantage_options {supplied} are filled by the trainer from the batch")
        rewards = self.reward_names
        check(
            spec.rewards_shape != "[B, S]",
            f"advantage {self.advantage!r} needs [B, S] step rewards from a process reward model; the trainer "
            "has outcome rewards (for per-turn rewards use mt_grpo or gigpo on a multi-turn task)",
        )
        if spec.rewards_shape == "[B, K]":
            check(
                len(rewards) >= 2,
                f"advantage {self.advantage!r} combines several rewards: pass them comma-separated, e.g. "
                "--reward exact_match,length_match",
            )
        else:
            check(
                len(rewards) <= 1,
                f"{len(rewards)} reward functions {rewards} need a multi-reward estimator (mo_grpo, gdpo); "
                f"{self.advantage!r} takes one reward per sample",
            )
        if self.prune_fraction is not None:
            check(
                spec.output == "[B]",
                f"prune_fraction (CPPO) ranks completions by |advantage| [B]; {self.advantage!r} gives "
                f"{spec.output} advantages",
            )
        parameters = inspect.signature(spec.fn).parameters
        required = [n for n in spec.options if parameters[n].default is inspect.Parameter.empty]
        missing = sorted(set(required) - set(filled) - set(self.advantage_options))
        check(
            not missing,
            f"advantage {self.advantage!r} needs option(s) {missing}: pass --advantage-option KEY=VALUE",
        )
        make_hook(self.hook, self.hook_options)  # raises on unknown or bad hook options
        check(
            self.hook != "two_rollouts" or self.group_size == 2,
            f"the two_rollouts hook is the 2-GRPO setting: group_size must be 2, got {self.group_size}",
        )
        check(
            not (self.hook == "edge_gec" and self.rollout_engine == "vllm"),
            "edge_gec rewrites completions, which then have no sampler log-probs for the vLLM IS correction",
        )

    @property
    def reward_names(self) -> list[str]:
        """The reward function names of --reward (empty: the task's own)."""
        return [] if self.reward is None else [name.strip() for name in self.reward.split(",")]

    @property
    def kl_in_reward(self) -> bool:
        """REINFORCE++ with its KL folded into the token rewards (needs the reference and sampler log-probs)."""
        return self.advantage == "reinforce_plus_plus" and float(self.advantage_options.get("kl_coef", 0)) > 0

    def loss_config(self, max_new_tokens: int) -> PolicyLossConfig:
        """The PolicyLossConfig of this run: the preset, the overrides, the sampling temperature, and the
        generation budget as the Dr. GRPO constant when the aggregation uses it. With rollout_engine="vllm"
        and no sampler correction chosen, token-level truncated IS (cap 2) corrects the sampler mismatch."""
        options = dict(self.loss_options)
        options["temperature"] = float(self.temperature)
        if self.rollout_engine == "vllm" and "is_level" not in options:
            options.update(is_level="token", is_mode="truncate")
        base = PolicyLossConfig.from_preset(self.loss)
        aggregations = (
            options.get("loss_agg_mode", base.loss_agg_mode),
            options.get("entropy_agg_mode", base.entropy_agg_mode),
        )
        options["max_completion_length"] = (
            max_new_tokens if "seq-mean-token-sum-norm" in aggregations else None
        )
        if options.get("loss_type", base.loss_type) == "group_dpo":
            options["group_size"] = self.group_size  # a group's rows are consecutive in every batch
        try:
            return base.replace(**options)
        except TypeError as exc:  # dataclasses.replace with an unknown field name
            known = [f.name for f in dataclasses.fields(PolicyLossConfig)]
            raise ValueError(
                f"TrainConfig: bad loss_options {self.loss_options}: {exc}; PolicyLossConfig fields: {known}"
            ) from None

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_json_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json_dict(cls, data: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"config.json has unknown field(s) {unknown} (written by another grpo_kernels version?)"
            )
        return cls(**data)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> TrainConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        return cls(preset=name, **{**PRESETS[name], **overrides})


# Each preset: the algorithm fields it sets (everything else keeps the TrainConfig defaults).
PRESETS: dict[str, dict[str, Any]] = {
    # GRPO (DeepSeekMath): PPO clip 0.2, k3 KL to the reference with beta 0.04, group-normalised advantages.
    "grpo": dict(loss="grpo", advantage="grpo"),
    # DAPO: clip-higher, token-level mean, no KL, dynamic sampling of informative groups, soft overlong
    # punishment (the paper: 16384 expected + 4096 cache tokens; here the task's budget + 2 at toy scale).
    "dapo": dict(loss="dapo", advantage="grpo", dynamic_sampling=True, overlong_cache=2),
    # Dr. GRPO: no std in the advantage, token sums over a constant (the generation budget).
    "dr_grpo": dict(loss="dr_grpo", advantage="dr_grpo"),
    # GSPO: length-normalised sequence-level ratio with its tight clip range.
    "gspo": dict(loss="gspo", advantage="grpo"),
    "bnpo": dict(loss="bnpo", advantage="grpo"),
    "cispo": dict(loss="cispo", advantage="grpo"),
    "gpg": dict(loss="gpg", advantage="gpg"),
    "gmpo": dict(loss="gmpo", advantage="grpo"),
    "sapo": dict(loss="sapo", advantage="grpo"),
    "rloo": dict(loss="bnpo", advantage="rloo"),
    # DCPO: dynamic clip bounds and the stateful smooth advantage standardisation (kept in checkpoints).
    "dcpo": dict(loss="dcpo", advantage="dcpo"),
    # EDGE-GRPO: entropy-driven advantage, and guided error correction of wrong completions (hook).
    # The paper's split of the corrections: 50% reflection (the policy continues), 25% reflection and the
    # correct answer, 25% the reference solution; the reflection text is "+" in the embedded vocabulary.
    "edge_grpo": dict(
        loss="grpo",
        advantage="edge_grpo",
        hook="edge_gec",
        hook_options={"reflection": "+", "hint": "{completion} + {answer}"},
    ),
    # GFPO: sample twice the group, keep the group_size shortest completions (hook), advantages over them.
    "gfpo": dict(
        loss="grpo", advantage="grpo", hook="gfpo", hook_options={"oversample": 2, "metric": "length"}
    ),
    # Lopti: update on low-probability tokens first, then on the rest (hook: two update stages per batch).
    "lopti": dict(
        loss="grpo", advantage="grpo", hook="lopti", hook_options={"threshold": 0.5}, num_iterations=1
    ),
    # Olmo 3 RL-Zero / Think (AI2): clip-higher 0.2 / 0.272, token-mean, no KL, advantages centred without
    # the std, active sampling (dynamic sampling). Its truncated IS against the inference engine's log-probs
    # needs vLLM: add --rollout-engine vllm --loss-option is_level=token.
    "olmo3": dict(loss="olmo3", loss_options={"is_level": None}, advantage="dr_grpo", dynamic_sampling=True),
    # Lite PPO ("Tricks or Traps?"): group-mean / batch-std advantages, token-level loss, no KL.
    "lite_ppo": dict(
        loss="grpo", loss_options={"kl_coef": 0.0, "loss_agg_mode": "token-mean"}, advantage="lite_ppo"
    ),
    # REINFORCE++: the KL to the reference folded into the token rewards (k1, coefficient 0.01: a toy-scale
    # choice, set yours), discounted returns whitened over the batch's tokens, PPO clip, no KL loss term.
    "reinforce_pp": dict(
        loss="grpo",
        loss_options={"kl_coef": 0.0, "loss_agg_mode": "token-mean"},
        advantage="reinforce_plus_plus",
        advantage_options={"kl_coef": 0.01},
    ),
    # GRPO-lambda: the eligibility-trace (discounted prefix) ratio, negative advantages clamped. The clamp
    # value could not be read from the paper's accessible text; -1 is this preset's choice.
    "grpo_lambda": dict(
        loss="grpo",
        loss_options={"ratio_level": "prefix"},
        advantage="grpo_lambda_clamp",
        advantage_options={"min_advantage": -1.0},
    ),
    # 2-GRPO ("It Takes Two"): groups of two, tied pairs dropped; 4x the prompts keep 256 completions a step.
    "two_rollouts": dict(
        loss="grpo", advantage="grpo", group_size=2, prompts_per_step=128, hook="two_rollouts"
    ),
    # CPPO: half of each group (the smallest |advantage|) pruned before the forward and backward of the loss.
    "cppo": dict(loss="grpo", advantage="grpo", prune_fraction=0.5),
    # GRPO-LEAD: length-dependent accuracy reward with the -1 penalty, difficulty-aware advantage weights.
    "grpo_lead": dict(loss="grpo", advantage="grpo_lead", lead_length_alpha=0.05),
    # DIVER: a textual-diversity bonus for correct completions (coefficient a toy-scale choice).
    "diver": dict(loss="grpo", advantage="grpo", diversity_coef=0.1),
    # MO-GRPO: each reward function normalised in its group, then summed (two objectives: answer, format).
    "mo_grpo": dict(loss="grpo", advantage="mo_grpo", reward="exact_match,length_match"),
    # MT-GRPO on the two-turn tool task: the call turn gets the outcome plus its own turn advantage.
    "mt_grpo": dict(loss="grpo", advantage="mt_grpo", task="lookup"),
    # GiGPO on the two-turn tool task: episode advantages plus step advantages within equal-state anchors.
    "gigpo": dict(loss="grpo", advantage="gigpo", task="lookup"),
    # GTPO / GRPO-S: entropy-shaped token / sequence rewards, standardised per polarity.
    "gtpo": dict(loss="grpo", advantage="gtpo"),
    "grpo_s": dict(loss="grpo", advantage="grpo_s"),
    # lambda-GRPO (GRPO as a process reward model): each token's advantage over its shared-prefix set.
    # (no KL term: the paper divides the whole token term by |lambda|, which dividing A equals only without KL)
    "lambda_grpo": dict(loss="grpo", loss_options={"kl_coef": 0.0}, advantage="lambda_grpo"),
    # Group DPO: DPO between the best and the worst completion of each group, against the reference.
    "group_dpo": dict(loss="grpo", loss_options={"loss_type": "group_dpo", "kl_coef": 0.0}, advantage="grpo"),
    "pspo": dict(loss="pspo", advantage="grpo"),
    "tic_grpo": dict(loss="tic_grpo", advantage="grpo"),
    "vespo": dict(loss="vespo", advantage="grpo"),
    # DPPO: a binary trust region on the sampled token's probability change instead of PPO's ratio clip (here
    # against the old policy of the two updates per batch; with vLLM add --loss-option ratio_anchor=rollout).
    "dppo": dict(loss="dppo", advantage="grpo"),
    # ProRL: DAPO's clip-higher and dynamic sampling, a small KL (1e-4) to a reference that is reset to the
    # current policy periodically (the paper resets on stalls; here on a fixed interval), optimizer reset too.
    "prorl": dict(
        loss="dapo",
        loss_options={"kl_coef": 1e-4},
        advantage="grpo",
        dynamic_sampling=True,
        ref_reset_interval=50,
    ),
}
