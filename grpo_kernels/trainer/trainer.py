"""The training loop, top to bottom: rollout -> reward -> advantage -> fused loss -> step.

    result = train(TrainConfig.from_preset("grpo"))        # the CLI: grpo-kernels train --preset grpo

One step:
  1. rollouts    G completions for each of `prompts_per_step` prompts (transformers generate, or vLLM)
  2. rewards     the reward function on the completion text; the hook may rewrite or drop rows; DAPO's
                 dynamic sampling keeps informative groups and samples again to refill
  3. no grad     old-policy log-probs (when one batch feeds several updates), reference log-probs (KL),
                 entropy (when the estimator needs it): gk.fused_linear_logprobs on the last hidden states
  4. advantages  gk.advantages.estimate(name, rewards, group_index, **options)
  5. updates     gk.fused_linear_grpo_loss on the completion hidden states and the LM-head weight,
                 micro-batched, normalised by the token / sequence counts of the whole optimizer step
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import random
import shlex
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import advantages as gk_advantages
from .._backend import resolve_backend
from ..advantages import registry as advantage_registry
from ..advantages.stateful import SmoothAdvantageStandardizer
from ..functional import fused_linear_grpo_loss, fused_linear_logprobs
from . import checkpoint as ckpt
from .config import EPISODE_OPTIONS, TrainConfig
from .distributed import DistContext, FSDPState, LossModule, ShardedSampler, init_from_env, launched_by_torchrun
from .hooks import HookContext, make_hook
from .model import EMBEDDED_VOCAB, eos_token_ids, lm_head_params, load_policy, logit_transform
from .multiturn import generate_episodes
from .plot import PlotInfo, plot_metrics, read_metrics
from .preflight import (
    PromptEncoder,
    PromptTooLong,
    check_model,
    check_task_examples,
    check_writable,
    describe_dropout,
    model_fingerprint,
    prompt_limit,
)
from .rollout import HFSampler, PaddedBatch, Rollouts, VLLMSampler, import_vllm, sampler_mismatch
from .runlock import RunLock
from .task import REWARDS, check_rewards, resolve_reward, resolve_task


class TrainingError(RuntimeError):
    """A failure during the run caused by user code or data (a reward function that raises or returns NaN).

    The message names the reward function, the offending prompt / completion and the run folder, which
    keeps every step completed before the failure (the CLI exits with status 1)."""


class TrainingDiverged(TrainingError):
    """The run diverged: a non-finite loss, gradient, hidden state or logit at step ``step``.

    The step's update is not applied (the weights stay those of the step before); the message names what
    went non-finite, the learning rate, the last checkpoint and the command that resumes from it with a
    lower learning rate (the CLI exits with status 1)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class _NonFinite(Exception):
    """Raised inside a step when a value went non-finite; the loop turns it into TrainingDiverged."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGUSR1 during a run (a ``KeyboardInterrupt``); ``signal`` is its number (the CLI
    exits with 128 + it: 130, 143, 138).

    After the first Ctrl-C the current step finishes and is checkpointed and plotted: ``step`` is that
    step and ``train(config, resume=True)`` on ``run_dir`` continues from it. After a second Ctrl-C the run
    stops at once and ``step`` is the last checkpoint's (0: none was written). SIGTERM / SIGUSR1 (a
    scheduler's preemption or warning) abandon the current step if none of its updates was applied yet (its
    sampling is redone on resume; the checkpoint of the step before is written if it was not), else finish
    the step's updates and checkpoint it. ``discarded``: the run was new and no step completed, so its
    folder was removed (the same command starts it again)."""

    def __init__(self, run_dir: str, step: int, signal: int = 2, discarded: bool = False):
        super().__init__(f"interrupted after step {step}")
        self.run_dir, self.step, self.signal, self.discarded = run_dir, step, signal, discarded


@dataclass
class TrainResult:
    """What ``train`` returns.

    ``run_dir`` the run folder, ``metrics`` one dict per step (as in metrics.jsonl), ``model`` the trained
    policy (fp32), ``tokenizer`` its tokenizer and ``random_reward`` the random-policy baseline of the plot
    (``random_policy_reward``; None for multi-turn tasks and reward functions of your own)."""

    run_dir: str
    metrics: list[dict]  # one dict per step, as in metrics.jsonl
    model: torch.nn.Module
    tokenizer: object
    random_reward: float | None = None


@dataclass(frozen=True)
class Compute:
    """Where the model runs and in which dtype: bf16 autocast on CUDA, fp32 on CPU (weights stay fp32)."""

    device: torch.device
    dtype: torch.dtype

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def train(
    config: TrainConfig, *, resume: bool = False, progress: bool = True, log: Callable[..., None] = print
) -> TrainResult:
    """Train a causal LM with a GRPO-family method (``grpo-kernels train`` calls this).

    Everything that can fail on bad input (task, reward functions, options, backend; the model, tokenizer,
    task lines and run folder together, trainer/preflight.py) is checked before the run folder is created.
    Started by torchrun, the ranks share each step's work (trainer/distributed.py); rank 0 logs and writes.

    Args:
        config: the run (``TrainConfig.from_preset("dapo", steps=100)``).
        resume: continue ``config.run_dir`` from its newest intact checkpoint (every file verified; a damaged
            one is named, moved aside and skipped; one of another model, config or tokenizer is refused).
        progress: show a progress bar with reward, KL, entropy and clip fraction.
        log: where the run's messages go (default ``print``).

    Returns:
        TrainResult: the run folder, the per-step metrics (as in metrics.jsonl), the model and tokenizer.

    Raises:
        ValueError, FileNotFoundError: bad input, before anything is written (on resume: no intact
            checkpoint, or one of another model).
        TrainingError: a reward function failed, or a write to the run folder failed, during the run.
        TrainingDiverged: a non-finite loss, gradient, hidden state or logit (a TrainingError).
        TrainingInterrupted: Ctrl-C (see its docstring).
    """
    if config.fsdp and not launched_by_torchrun():
        raise ValueError("--fsdp shards the policy over processes: start with torchrun --nproc_per_node=K")
    ctx = init_from_env(config.device)
    device = ctx.device if ctx is not None else _pick_device(config.device)
    compute = Compute(device, _pick_dtype(config.dtype, device))
    threads_before = torch.get_num_threads()
    if device.type == "cpu" and config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    if ctx is not None and not ctx.is_main:  # rank 0 speaks and writes; the others work quietly
        log, progress = (lambda *args, **kwargs: None), False
    engines = []  # a vLLM engine, shut down here whatever happens (before the process group, which it may use)
    locks = []  # the run folder's lock (rank 0), released here whatever happens
    # SIGTERM / SIGUSR1 from now on: before the first step nothing is kept, so they stop at once (one process;
    # under torchrun the launcher's signal handling applies); Ctrl-C is watched from the first step on
    stop = _StopAfterStep(enabled=ctx is None, log=log)
    stop.install(TERMINATION_SIGNALS)
    try:
        return _train(config, resume, progress, log, compute, ctx, engines, locks, stop)
    except _Abandon:  # a termination signal before the first step: nothing of the run is lost
        if stop.opened is None:  # not even the run folder was made or changed
            raise TrainingInterrupted(config.run_dir, 0, stop.signum) from None
        run_dir, start_step, new_run = stop.opened
        raise _interrupted(run_dir, start_step, stop.signum, new_run, locks) from None
    finally:
        stop.restore()
        for lock in locks:
            lock.release()
        for engine in engines:
            engine.close()
        torch.set_num_threads(threads_before)
        if ctx is not None:
            ctx.close()


def _train(config, resume, progress, log, compute: Compute, ctx: DistContext | None,
           engines: list, locks: list, stop) -> TrainResult:  # fmt: skip
    device = compute.device
    main = ctx is None or ctx.is_main

    # ---- everything that can fail on bad input, before the run folder is touched --------------------
    task = resolve_task(config.task)
    if task.num_prompts < config.prompts_per_step:
        raise ValueError(
            f"task {task.name!r} has {task.num_prompts} distinct prompts, fewer than "
            f"prompts_per_step={config.prompts_per_step}"
        )
    reward_names = config.reward_names or [task.reward]
    reward_fns = [resolve_reward(name) for name in reward_names]
    reward_name = ",".join(reward_names)
    max_new_tokens = config.max_new_tokens or task.max_new_tokens  # DAPO's expected length with a cache
    budget = max_new_tokens + (config.overlong_cache or 0)  # tokens generated at most (per turn)
    loss_config = config.loss_config(budget)
    hook = make_hook(config.hook, config.hook_options)
    updates = hook.update_stages(loss_config) * config.num_iterations  # one optimizer step each
    _check_task(config, task)
    _check_advantage_options(config)
    if config.rollout_engine == "vllm":
        import_vllm()  # a missing or broken vLLM fails here, naming what to install, before the run folder
    backend_description = _describe_backend(config.backend, device)
    if main:
        check_writable(config.run_dir, resume)  # before the model loads: a read-only folder fails in a second

    def take_lock(run_dir):  # rank 0: one process per run folder (runlock.py), before anything is written there
        if not locks:
            lock = RunLock(run_dir, shlex.join(sys.argv))
            locks.append(lock)
            if lock.note:
                log(lock.note)

    def check_folder():  # an existing folder: its lock, and what it holds, before the model loads
        if config.run_dir is not None and os.path.isdir(config.run_dir):
            take_lock(config.run_dir)
            if resume and not ckpt.has_checkpoint(os.path.join(config.run_dir, "checkpoints")):
                raise ckpt.NoCheckpoint(ckpt.no_checkpoint_message(config.run_dir))
            if not resume:
                ckpt.check_new_run_folder(config.run_dir)

    if ctx is None:
        check_folder()
    else:  # every rank learns rank 0's outcome (a refusal is raised on each)
        ctx.from_main(check_folder)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    policy, tokenizer, model_description = load_policy(config.model, config.seed)
    policy.to(device)
    eos_ids = eos_token_ids(policy, tokenizer)
    # the model, tokenizer and task together (trainer/preflight.py): vocabulary, context, every task line
    model_where = f"--model {config.model!r}" if config.model is not None else "the embedded model"
    vocabulary = check_model(policy, tokenizer, eos_ids, model_where)
    turns = task.environment.turns if task.multi_turn else 1
    limit, why, context_line = prompt_limit(policy, budget, turns, model_where)
    encode_prompt = PromptEncoder(tokenizer, limit, config.truncate_prompts, why)
    if task.examples is not None:
        builtin = reward_fns[0] if reward_names[0] in REWARDS else None  # a user's reward may cost: not called
        context_line += check_task_examples(task.examples, tokenizer, vocabulary, encode_prompt, builtin)
    else:
        _check_drawn_prompts(task, encode_prompt, config.seed)
    dropout_line = describe_dropout(policy, config.keep_dropout)
    fingerprint = model_fingerprint(policy, tokenizer)
    if ctx is not None and config.prompts_per_step * config.group_size < ctx.world:
        raise ValueError(f"{ctx.world} processes need at least as many completions per step, got "
                         f"{config.prompts_per_step} x {config.group_size}")  # fmt: skip

    # ---- the training state: policy, reference, optimizer, estimator state, random generators --------
    reference = None
    if loss_config.needs_reference or config.kl_in_reward:  # a frozen copy of the initial policy (no grad)
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    betas = (config.adam_beta1, config.adam_beta2)

    def make_optimizer(model):
        return torch.optim.AdamW(model.parameters(), config.lr, betas, weight_decay=config.weight_decay)

    fsdp = FSDPState(policy, ctx, make_optimizer) if config.fsdp else None
    optimizer = fsdp.optimizer if fsdp is not None else make_optimizer(policy)
    saved_model = fsdp.mirror if fsdp is not None else policy  # what checkpoints hold (FSDP: the unsharded mirror)
    saved_optimizer = fsdp.mirror_optimizer if fsdp is not None else optimizer

    def choose_checkpoint(checkpoints_dir):  # the newest intact checkpoint of this model (checkpoint.py)
        def verify(folder):
            return ckpt.verify_checkpoint(folder, model=saved_model, reference=reference, optimizer=saved_optimizer,
                                          fingerprint=fingerprint)  # fmt: skip

        return ckpt.choose_checkpoint(checkpoints_dir, verify, log)

    def open_run_folder():
        try:
            return ckpt.open_run_folder(config, resume, choose_checkpoint, lock=take_lock)
        except OSError as exc:  # the probe passed, yet the folder could not be written (disk full, a race)
            where = exc.filename or config.run_dir
            raise ValueError(f"cannot write the run folder: {where}: {exc.strerror or exc}") from None

    if ctx is None:
        run_dir, start_step = open_run_folder()
    else:  # rank 0 makes (or reopens) the folder; every rank learns its path, or rank 0's error
        run_dir, start_step = ctx.from_main(open_run_folder)
    stop.opened = (run_dir, start_step, not resume)  # where a termination signal from here on leaves the run
    estimator_state = SmoothAdvantageStandardizer() if config.advantage == "dcpo" else None
    prompt_generator = torch.Generator().manual_seed(config.seed)
    hook_generator = torch.Generator().manual_seed(config.seed + 1)
    checkpoints_dir = os.path.join(run_dir, "checkpoints")
    if start_step > 0:
        folder = os.path.join(checkpoints_dir, ckpt.checkpoint_name(start_step))
        state, rng = ckpt.load_checkpoint(folder, model=saved_model, reference=reference, optimizer=saved_optimizer)
        if fsdp is not None:  # from the unsharded mirror onto the shards
            fsdp.push()
        ckpt.restore_rng(rng, state["python_rng"], prompt_generator, hook_generator)
        if estimator_state is not None:
            estimator_state.load_state_dict(state["estimator_state"])
        log(f"resumed {run_dir} at step {start_step}")
    engine_note = {}
    if config.rollout_engine == "vllm":
        sampler = _start_vllm(config, policy, tokenizer, eos_ids, run_dir, ctx, vocabulary)
        engines.append(sampler)
        log(sampler.describe())
        engine_note = {"vllm/engine_start_s": sampler.start_seconds}  # in the first step's record
    else:
        sampler = HFSampler(policy, tokenizer, eos_ids, config.temperature, compute.autocast,
                            vocab=vocabulary.limit if vocabulary.padded else None)  # fmt: skip
    loss_module = None
    # every group under its own seed (one seed, one run however it is launched); a single vLLM engine samples
    # the whole batch in one call (its requests seeded in turn from the run's generator), several engines
    # under torchrun their blocks of groups, each group under its own seed
    if config.rollout_engine != "vllm" or ctx is not None:
        sampler = ShardedSampler(sampler, ctx, config.group_size * hook.sample_multiplier, config.seed)
    if ctx is not None and fsdp is None:
        from torch.nn.parallel import DistributedDataParallel

        loss_module = DistributedDataParallel(
            LossModule(policy), device_ids=[device.index] if device.type == "cuda" else None
        )

    def decode(tokens: list[int]) -> str:  # the text the reward sees: the completion before its EOS
        return tokenizer.decode([t for t in tokens if t not in eos_ids], skip_special_tokens=False)

    def score_one(name, fn, rollouts: Rollouts) -> torch.Tensor:
        kept_note = f"the run folder {run_dir} keeps the steps completed before the failure"
        try:
            values = fn(prompts=rollouts.prompts, completions=rollouts.completions, answers=rollouts.answers)
            rewards = check_rewards(values, len(rollouts), name)
        except Exception as exc:
            message = f"reward function {name!r} failed: {type(exc).__name__}: {exc}\n{kept_note}"
            raise TrainingError(message) from exc
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            raise TrainingError(
                f"reward function {name!r} returned {rewards[i].item()} for {len(bad)} "
                f"completion(s), e.g. prompt {rollouts.prompts[i]!r}, completion "
                f"{rollouts.completions[i]!r}; rewards must be finite\n{kept_note}"
            )
        return rewards

    def score(rollouts: Rollouts) -> Rollouts:
        """Every reward function on the rows, then the shaping of the config (the training reward)."""
        components = torch.stack([score_one(n, fn, rollouts) for n, fn in zip(reward_names, reward_fns)], 1)
        task_rewards = components[:, 0]
        rewards = _shape_rewards(config, rollouts, components, budget)
        return dataclasses.replace(
            rollouts, rewards=rewards, task_rewards=task_rewards, reward_components=components
        )

    hook_context = HookContext(
        generate=sampler.generate,
        score=score,
        encode=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
        decode=decode,
        eos_id=eos_ids[0],
        max_new_tokens=budget,
        group_size=config.group_size,
        correct_reward=config.correct_reward,
        generator=hook_generator,
    )
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    plot_path = os.path.join(run_dir, "metrics.png")
    plot_info = PlotInfo(
        title=f"{model_description} | task {task.name} | preset {config.preset}",
        kl_estimator=loss_config.kl_estimator if loss_config.kl_coef > 0 else None,
        dynamic_sampling=config.dynamic_sampling,
        sampler_mismatch=config.rollout_engine == "vllm",
        random_reward=(  # built-in rewards only: a user's reward function may cost (a judge model, an API)
            random_policy_reward(task, reward_fns[0], tokenizer, eos_ids, budget, config.seed)
            if reward_names[0] in REWARDS else None
        ),
    )
    num_parameters = sum(p.numel() for p in policy.parameters())
    log(f"model: {model_description}, {num_parameters:,} parameters, on {device}")
    log(f"{context_line}; {vocabulary.describe()}")
    log(dropout_line)
    log(f"task: {task.name} ({task.description}); reward: {reward_name}; preset: {config.preset}")
    dtype_name = str(compute.dtype).removeprefix("torch.")
    log(f"loss: {backend_description}; compute dtype {dtype_name}")
    log(_describe_processes(ctx, config))
    log(f"run folder: {run_dir}")
    started = time.time()
    bar = _progress_bar(start_step, config.steps, progress)

    last_saved = start_step
    vocab = vocabulary.limit if vocabulary.padded else None  # a padded vocabulary: its first rows only

    def resume_hint(lr: float | None = None) -> str:
        """Where the run can continue from: the last checkpoint and the command (with a learning rate), quoted
        for the shell so that it can be pasted whatever the folder's name."""
        lower = f" --lr {lr:g}" if lr is not None else ""
        if last_saved == 0:
            return (f"no checkpoint was written yet: start a new run{' with' + lower if lower else ''} (remove this "
                    f"folder first, rm -r {shlex.quote(run_dir)}, or give another --run-dir)")  # fmt: skip
        folder = os.path.join(checkpoints_dir, ckpt.checkpoint_name(last_saved))
        return (f"the last checkpoint is step {last_saved} ({folder}); continue from it with: "
                f"{resume_command(run_dir)}{lower}")  # fmt: skip

    def write_failed(what: str, exc: Exception) -> TrainingError:
        """A write to the run folder failed (permission, disk full): what was being written, where, why."""
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return TrainingError(f"cannot write {what}{where}: {reason}; {resume_hint()}")

    def save(step: int, snapshot=None) -> None:  # every rank calls it (FSDP gathers); rank 0 writes
        """The checkpoint of `step`; `snapshot` (RNG, estimator state) taken at the start of step + 1 when that
        step is abandoned before its first update (the weights and optimizer are still those of `step`)."""
        if fsdp is not None:
            fsdp.pull()  # every rank: the full model and optimizer state into the mirror
        if main:
            (rng_tensors, python_rng), estimator_dict = snapshot or (
                ckpt.capture_rng(prompt_generator, hook_generator),
                None if estimator_state is None else estimator_state.state_dict())  # fmt: skip
            state = {
                "step": step,
                "python_rng": python_rng,
                "estimator_state": estimator_dict,
                "config": config.to_json_dict(),
                "model": fingerprint,  # a resume on another model, config or tokenizer is refused by name
            }
            folder = os.path.join(checkpoints_dir, ckpt.checkpoint_name(step))
            errors = _write_errors()
            try:
                ckpt.save_checkpoint(folder, model=saved_model, reference=reference, optimizer=saved_optimizer,
                                     rng_tensors=rng_tensors, state=state)  # fmt: skip
            except errors as exc:
                raise write_failed(f"the checkpoint of step {step} to {folder}", exc) from exc
            try:
                ckpt.prune_checkpoints(checkpoints_dir, config.keep_checkpoints)
            except errors as exc:
                raise write_failed(f"(delete) the checkpoints older than step {step} in {checkpoints_dir}", exc) from exc
            try:
                plot_metrics(metrics_path, plot_path, plot_info)
            except errors as exc:
                raise write_failed(f"the plot {plot_path}", exc) from exc
        if ctx is not None:
            ctx.barrier()  # the checkpoint is on disk before any rank goes on (or resumes from it)

    # a termination signal before a step's first update abandons the step: nothing of it was applied
    optimizer.register_step_pre_hook(lambda *args: setattr(stop, "abandonable", False))
    with stop.watching_interrupts():
        for step in range(start_step + 1, config.steps + 1):
            # what a checkpoint of step - 1 needs beyond the weights and optimizer (which only the updates change)
            snapshot = (ckpt.capture_rng(prompt_generator, hook_generator),
                        None if estimator_state is None else copy.deepcopy(estimator_state.state_dict()))  # fmt: skip
            try:
                stop.abandonable = True
                record = _train_step(
                    step, config, task, tokenizer, sampler, hook, hook_context, prompt_generator, policy,
                    reference, optimizer, updates, compute, ctx, loss_module, estimator_state, vocab=vocab,
                    encode_prompt=encode_prompt,
                )  # fmt: skip
                stop.abandonable = False
            except _NonFinite as exc:  # stop with what went non-finite, the rate, and where to resume from
                stop.abandonable = False
                bar.close()
                lr = optimizer.param_groups[0]["lr"]
                warmup = f" (rising to --lr {config.lr:g} over the warmup)" if lr != config.lr else ""
                advice = None
                if main and last_saved > 0:  # is the last checkpoint itself past the blow-up?
                    advice = _blow_up_advice(config, checkpoints_dir, run_dir, last_saved, metrics_path)
                raise TrainingDiverged(
                    f"training diverged at step {step}: {exc}, at learning rate {lr:g}{warmup}. The update that "
                    f"produced it was not applied and nothing of step {step} was saved; "
                    + (advice or f"{resume_hint(config.lr / 10)} (a lower learning rate, e.g. a tenth)"), step
                ) from None
            except _Abandon:  # SIGTERM / SIGUSR1 before this step's first update: the state is that of step - 1
                stop.abandonable = False
                bar.close()
                with stop.deferred():
                    if last_saved < step - 1:
                        save(step - 1, snapshot)
                        last_saved = step - 1
                log(f"stopped in step {step} by {signal.Signals(stop.signum).name} before its first update: the step "
                    f"is abandoned (resume redoes it)" + (f"; checkpoint of step {last_saved} written"
                                                          if last_saved == step - 1 and last_saved > start_step
                                                          else ""))  # fmt: skip
                raise _interrupted(run_dir, last_saved, stop.signum, not resume, locks) from None
            except KeyboardInterrupt:  # the second Ctrl-C: stop now, mid-step (nothing of it is kept)
                stop.abandonable = False
                bar.close()
                if os.path.isfile(metrics_path) and main:
                    plot_metrics(metrics_path, plot_path, plot_info)
                raise _interrupted(run_dir, last_saved, stop.signum or signal.SIGINT, not resume, locks) from None
            if config.ref_reset_interval and step % config.ref_reset_interval == 0 and reference is not None:
                if fsdp is not None:
                    fsdp.pull()
                # ProRL: the reference becomes the current policy,
                reference.load_state_dict((fsdp.mirror if fsdp is not None else policy).state_dict())
                optimizer.state.clear()  # and the optimizer starts afresh
                record["ref_reset"] = 1
            record.update(engine_note)
            engine_note = {}
            record["lr"] = optimizer.param_groups[0]["lr"]
            record["elapsed_s"] = time.time() - started
            if ctx is not None:
                record["processes"] = ctx.world
            if main:
                try:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                except OSError as exc:
                    raise write_failed(f"the metrics of step {step} to {metrics_path}", exc) from exc
            if "skip_reason" in record:
                log(f"step {step} skipped (no update): {record['skip_reason']}")
            shown = {"reward": "reward", "kl": "kl", "entropy": "entropy", "clip_ratio/region_mean": "clip",
                     "sampling/sampling_logp_difference/mean": "lp_diff", "is_weight/mean": "is_w"}
            bar.set_postfix({n: f"{record[k]:.1e}" if n == "lp_diff" else f"{record[k]:.3f}"  # fp32: ~1e-7
                             for k, n in shown.items() if k in record}, refresh=False)  # fmt: skip
            bar.update(1)
            if step % config.save_every == 0 or step == config.steps or stop.requested:
                with stop.deferred():  # a checkpoint is written whole
                    save(step)
                last_saved = step
            if stop.requested and step < config.steps:
                bar.close()
                log(f"stopped after step {step} ({stop.describe()}); checkpoint and plot written")
                raise TrainingInterrupted(run_dir, step, stop.signum)
        bar.close()

    final_dir = os.path.join(run_dir, "final_model")
    if main:
        try:
            _save_pretrained(saved_model, tokenizer, final_dir)  # for --model; complete or absent
        except _write_errors() as exc:
            raise write_failed(f"the final model to {final_dir}", exc) from exc
    if ctx is not None:
        ctx.barrier()
    metrics = read_metrics(metrics_path)
    if metrics:
        first, last, window = metrics[0], metrics[-1], metrics[-10:]
        window_mean = sum(m["reward"] for m in window) / len(window)
        solved_mean = sum(m["solved"] for m in window) / len(window)
        log(
            f"reward {first['reward']:.3f} at step {first['step']} -> {last['reward']:.3f} at step "
            f"{last['step']} (mean of the last {len(window)} steps {window_mean:.3f}); solved "
            f"{first['solved']:.2f} -> {last['solved']:.2f} (last {len(window)}: {solved_mean:.2f}); "
            f"{time.time() - started:.0f} s"
        )
        log(f"plot: {plot_path}\nmetrics: {metrics_path}\nmodel: {final_dir}")
    return TrainResult(run_dir, metrics, policy, tokenizer, plot_info.random_reward)


def _train_step(step, config, task, tokenizer, sampler, hook, hook_context, prompt_generator, policy, reference,
                optimizer, updates, compute, ctx, loss_module, estimator_state, *, vocab: int | None = None,
                encode_prompt=None) -> dict:  # fmt: skip
    """One step: rollouts, rewards, log-probs, advantages, the updates. Returns the step's metrics (a skipped
    step has "skipped": 1 and its "skip_reason"). `vocab`: the token ids the run samples and scores (a padded
    vocabulary's first rows); `encode_prompt`: prompt text -> ids within the model's context."""
    device = compute.device
    step_started = time.time()
    warmup = min(1.0, step / config.warmup_steps) if config.warmup_steps else 1.0
    for group in optimizer.param_groups:  # linear warmup, then constant
        group["lr"] = config.lr * warmup

    # 1-2. rollouts and rewards (the hook and dynamic sampling act here)
    if isinstance(sampler, ShardedSampler):
        sampler.begin_step(step)
    sampler.sync_weights(policy)
    ckpt.test_pause("sample", step)  # tests only (GRPO_KERNELS_TEST_PAUSE): a signal while the step samples
    try:
        rollouts, sampled_rewards, rollout_stats = _collect_rollouts(
            config, task, tokenizer, sampler, hook, hook_context, prompt_generator, encode_prompt=encode_prompt
        )
    except PromptTooLong as exc:  # a task without a list of examples drew a prompt too long for the context
        raise TrainingError(f"step {step}: {exc}") from None
    except TrainingError:  # a reward function's failure, already explained
        raise
    except RuntimeError:  # e.g. generate's "probability tensor contains inf / nan": did the logits overflow?
        _check_logits_finite(policy, tokenizer, compute)
        raise
    if getattr(encode_prompt, "truncate", False):
        rollout_stats["prompts_truncated"] = encode_prompt.take_count()
    engine = getattr(sampler, "inner", sampler)  # under torchrun the ShardedSampler wraps it
    if hasattr(engine, "take_stats"):  # the vLLM engine: seconds in weight sync and generation
        rollout_stats.update(engine.take_stats())
    record = {
        "step": step,
        "reward": sampled_rewards.mean().item(),  # the task reward of the policy's own samples
        "reward_std": sampled_rewards.std().item(),
        "solved": (sampled_rewards >= config.correct_reward).float().mean().item(),
        **rollout_stats,
    }
    if rollouts is None:
        record["skipped"] = 1
        record["skip_reason"] = (f"dynamic sampling found no group with unequal rewards in {record['sampling_rounds']} "
                                 "sampling round(s)")  # fmt: skip
        record["step_time_s"] = time.time() - step_started
        return record
    batch = rollouts.tensors(tokenizer.pad_token_id, device)
    rewards = rollouts.rewards.to(device)  # [B] training reward (shaped)
    lengths = batch.loss_mask.sum(1)  # [B] the policy's completion tokens, EOS included
    record.update(
        reward_trained=rewards.mean().item(),
        sequences=len(rollouts),
        tokens=int(lengths.sum()),
        completion_length=lengths.float().mean().item(),
        truncated=sum(rollouts.truncated) / len(rollouts),
    )
    if rollouts.reward_components.shape[1] > 1:
        for k, name in enumerate(config.reward_names):
            record[f"reward/{name}"] = rollouts.reward_components[:, k].mean().item()
    if rollouts.turn_rewards is not None:
        for k in range(rollouts.turn_rewards.shape[1]):
            record[f"turn_reward/{k}"] = rollouts.turn_rewards[:, k].mean().item()

    # 3. per-token log-probs [B, C] without grad: old policy, reference, entropy for the estimator
    spec = gk_advantages.get(config.advantage)
    need_old, need_entropy = len(updates) > 1, "entropy" in spec.options
    entropy = sampling_logprobs = None
    if need_old or need_entropy or config.kl_in_reward or batch.rollout_logprobs is not None:
        sampling_logprobs, entropy = _token_logprobs(policy, batch, config, compute, need_entropy, ctx, vocab=vocab)
        batch.old_logprobs = sampling_logprobs if need_old else None
    if batch.rollout_logprobs is not None:  # the sampler (vLLM) against the trainer on the same tokens
        record.update(sampler_mismatch(sampling_logprobs, batch.rollout_logprobs, batch.loss_mask))
    if reference is not None:
        batch.ref_logprobs, _ = _token_logprobs(reference, batch, config, compute, False, ctx, vocab=vocab)

    # 4. advantages from the registry, [B] or [B, C]; the batch fills the options an estimator takes
    group_index = rollouts.group_index.to(device)
    from_batch = {
        "entropy": entropy,
        "mask": batch.loss_mask,
        "lengths": lengths.float(),
        "correct": rollouts.task_rewards.to(device) >= config.correct_reward,
        "prompt_keys": rollouts.prompt_keys,
        "state": estimator_state,
        "completion_ids": batch.completion_ids,
        "logprobs": sampling_logprobs,
        "ref_logprobs": batch.ref_logprobs,
        **_episode_options(rollouts, batch),
    }
    options = _estimator_options(spec, config, from_batch)
    estimator_rewards = rollouts.reward_components.to(device) if spec.rewards_shape == "[B, K]" else rewards
    batch.advantages = gk_advantages.estimate(config.advantage, estimator_rewards, group_index, **options)

    # CPPO: only the completions of each group with the largest |advantage| reach the loss
    if config.prune_fraction is not None:
        kept = gk_advantages.cppo(batch.advantages, group_index, prune_fraction=config.prune_fraction).kept
        record["cppo/kept_fraction"] = len(kept) / len(batch)
        record["cppo/tokens_saved_fraction"] = 1 - float(lengths[kept].sum()) / max(float(lengths.sum()), 1)
        batch = batch.select(kept)
    # DAPO overlong filtering: truncated completions stay in the batch (their group's advantages used
    # them) but have no loss, and do not count in the token normalizers
    if config.overlong_filter:
        truncated = torch.tensor(rollouts.truncated, device=device)
        if config.prune_fraction is not None:
            truncated = truncated[kept]
        batch.loss_mask = batch.loss_mask & ~truncated[:, None]
        record["overlong/filtered_fraction"] = truncated.float().mean().item()

    # 5. the updates (num_iterations x the hook's stages), each one AdamW step on the whole batch
    if int(batch.loss_mask.sum()) == 0:  # the loss would normalise by 0 tokens: no update this step
        record["skipped"] = 1
        record["skip_reason"] = _all_masked_reason(config, rollouts)
    else:
        update_metrics = []
        for stage in updates:
            update_metrics.append(_update(policy, optimizer, batch, stage, config, compute, ctx, loss_module,
                                          vocab=vocab))  # fmt: skip
            ckpt.test_pause("update", step)  # tests only: a signal between two updates of the step
        for key in update_metrics[0]:
            record[key] = sum(m[key] for m in update_metrics) / len(update_metrics)
    record["step_time_s"] = time.time() - step_started
    return record


def _all_masked_reason(config, rollouts: Rollouts) -> str:
    """Why every token of a step's batch is masked out of the loss (the step is skipped, not the run)."""
    if config.overlong_filter and all(rollouts.truncated):
        return (f"every token is masked: overlong filtering removed all {len(rollouts)} completions (none ended "
                "within the generation budget)")  # fmt: skip
    return f"every token of the {len(rollouts)} completions is masked out of the loss"


@torch.no_grad()
def _check_logits_finite(policy, tokenizer, compute: Compute) -> None:
    """After a sampling failure: _NonFinite when the policy's logits on a short input are not finite (its
    weights overflow: the run diverged); nothing otherwise (the caller re-raises the original error)."""
    device = next(policy.parameters()).device
    ids = tokenizer("0")["input_ids"] or [tokenizer.eos_token_id]
    was_training = policy.training
    policy.eval()
    with compute.autocast():
        logits = policy(input_ids=torch.tensor([ids], device=device)).logits
    policy.train(was_training)
    bad = int((~torch.isfinite(logits)).sum())
    if bad:
        raise _NonFinite(f"the policy's logits hold {bad} non-finite value(s) of {logits.numel()} (sampling failed)")


def _check_drawn_prompts(task, encode_prompt, seed: int) -> None:
    """For a task without a list of examples: up to 64 of its prompts, drawn aside (the run's random state is
    left as it was), through the prompt encoder, so a prompt too long for the model's context, or with text
    its tokenizer cannot encode, is refused before the run folder exists; during the run each prompt's
    length is checked as it is encoded."""
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            generator = torch.Generator().manual_seed(seed + 3)
            prompts, _ = task.sample(generator, min(64, task.num_prompts), exclude=set())
    finally:
        random.setstate(state)
    unk = encode_prompt.tokenizer.unk_token_id
    for prompt in prompts:
        if unk is not None and unk in encode_prompt(prompt):
            raise ValueError(f"task {task.name!r}: the prompt {prompt!r} has text the model's tokenizer cannot encode "
                             f"(it becomes {encode_prompt.tokenizer.unk_token})")  # fmt: skip
    encode_prompt.take_count()


def _estimator_options(spec, config: TrainConfig, available: dict) -> dict:
    """The options the estimator takes, from the batch, then the user's --advantage-option values."""
    options = {k: v for k, v in available.items() if k in spec.options}
    if spec.name == "gdpo" and config.advantage_options.get("batch_normalization", "sequence") != "token":
        options.pop("mask")  # gdpo reads the token mask only for token-level batch statistics
    return options | config.advantage_options


def _episode_options(rollouts: Rollouts, batch: PaddedBatch) -> dict:
    """The multi-turn estimators' options from the episodes (empty for one-turn rollouts).

    MT-GRPO: turn k's tokens get A_outcome + turn_coef * A_turn(k); the last turn's reward is the outcome
    itself, so its turn column is 0 (the paper's two-turn case: turn 1 A^T + A^O, final turn A^O).
    GiGPO: turns are steps; the step rewards are the turn rewards; the context a turn started from is its
    anchor state (equal contexts within a group share a step baseline)."""
    if rollouts.turn_ids is None:
        return {}
    turn_rewards = rollouts.turn_rewards.to(batch.completion_ids.device)
    outcome_zeroed = turn_rewards.clone()
    outcome_zeroed[:, -1] = 0
    states: dict[str, int] = {}
    state_ids = torch.tensor(
        [[states.setdefault(key, len(states)) for key in row] for row in rollouts.state_keys],
        device=turn_rewards.device,
    )
    return {
        "turn_rewards": outcome_zeroed,
        "turn_ids": batch.turn_ids,
        "step_rewards": turn_rewards,
        "state_ids": state_ids,
        "step_ids": batch.turn_ids,
    }


def _shape_rewards(config, rollouts: Rollouts, components: torch.Tensor, budget: int):
    """The training reward [B] from the reward functions' values [B, K]: their sum, then the shaping the
    config asks for (DAPO soft overlong punishment, GRPO-LEAD length reward, DIVER diversity bonus)."""
    task_rewards = components[:, 0]
    rewards = components.sum(1)
    correct = task_rewards >= config.correct_reward
    lengths = torch.tensor([len(t) for t in rollouts.completion_tokens], dtype=torch.float32)
    if config.lead_length_alpha is not None:  # replaces the task reward: exp(-alpha z) correct, -1 wrong
        lead = gk_advantages.lead_length_reward(
            correct, lengths, rollouts.group_index, alpha=config.lead_length_alpha
        )
        rewards = rewards - task_rewards + lead
    if config.diversity_coef is not None:
        rewards = gk_advantages.diver_rewards(
            rewards, rollouts.group_index, rollouts.completions, coef=config.diversity_coef, correct=correct,
            direction="one_way",  # the paper: o_i scored against the other completions of its group
        )
    if config.overlong_cache is not None:  # L_max = the budget, expected length L_max - L_cache
        rewards = rewards + gk_advantages.dapo_overlong_penalty(
            lengths, max_length=budget, cache_length=config.overlong_cache
        )
    return rewards.float()


RANDOM_POLICY_SAMPLES = (256, 16)  # prompts, uniformly random completions per prompt


def random_policy_reward(task, reward_fn, tokenizer, eos_ids, budget: int, seed: int) -> float | None:
    """The random-policy baseline, the one definition the plot's dashed line and the README's figure use: the
    mean task reward of 16 completions for each of 256 prompts, each completion drawn uniformly from the
    vocabulary token by token until an EOS or the budget (the chance level a learning curve starts from).
    4,096 completions: a standard error of about 0.002 on `copy` (its expectation is 0.046; the 256
    completions this used to take gave 0.034 to 0.057 by seed). One-turn tasks only: None else."""
    if task.multi_turn:
        return None
    prompt_count, per_prompt = RANDOM_POLICY_SAMPLES
    generator = torch.Generator().manual_seed(seed + 2)
    drawn, drawn_answers = task.sample(generator, prompt_count, exclude=set())
    prompts = [p for p in drawn for _ in range(per_prompt)]
    answers = [a for a in drawn_answers for _ in range(per_prompt)]
    rows = torch.randint(len(tokenizer), (len(prompts), budget), generator=generator).tolist()
    cut = [next((row[:i] for i, t in enumerate(row) if t in eos_ids), row) for row in rows]
    texts = tokenizer.batch_decode(cut, skip_special_tokens=False)
    try:
        values = reward_fn(prompts=prompts, completions=texts, answers=answers)
        return float(check_rewards(values, len(prompts), "random baseline").mean())
    except Exception:  # the baseline is a plot decoration: a reward function that fails here fails at step 1
        return None


def _check_task(config: TrainConfig, task) -> None:
    """Refuse a task the run cannot train on, before anything is built."""
    if config.model is None and task.words is not None:
        unknown = sorted(task.words - set(EMBEDDED_VOCAB))
        if unknown:
            shown = ", ".join(repr(w) for w in unknown[:12]) + (" ..." if len(unknown) > 12 else "")
            raise ValueError(
                f"task {task.name!r} uses {len(unknown)} word(s) outside the embedded model's vocabulary "
                f"({' '.join(EMBEDDED_VOCAB[4:])}): {shown}; they would all read as <unk> (reward 0 for "
                "ever). Use words of that vocabulary, separated by spaces, or --model a folder whose "
                "tokenizer knows them"
            )
    spec = gk_advantages.get(config.advantage)
    episode = sorted(set(spec.options) & set(EPISODE_OPTIONS))
    if episode and not task.multi_turn:
        raise ValueError(
            f"advantage {config.advantage!r} needs turn-structured episodes ({', '.join(episode)}): use a "
            "multi-turn task (--task lookup, or your own Task with an environment)"
        )
    if task.multi_turn:
        for name, reason in (
            ("edge_gec", "rewrites whole completions"),
            ("gfpo", "ranks whole completions by length"),
        ):
            if config.hook == name:
                raise ValueError(f"hook {name!r} {reason}; it is not defined for multi-turn episodes")
        if config.rollout_engine == "vllm":
            raise ValueError("multi-turn tasks sample with the transformers engine (--rollout-engine hf)")
        if config.diversity_coef is not None or config.lead_length_alpha is not None:
            raise ValueError("diversity_coef / lead_length_alpha shape one-turn completions, not episodes")


def _check_advantage_options(config: TrainConfig) -> None:
    """Run the estimator once on a tiny synthetic batch with the run's options, so a bad option value
    (--advantage-option scale=bogus) fails before the run folder exists, not at step 1."""
    spec = gk_advantages.get(config.advantage)
    rows, tokens, turns = 4, 3, 2
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    group_index = torch.tensor([0, 0, 1, 1])
    turn_ids = torch.tensor([[0, -1, 1]] * rows)
    synthetic = {
        "entropy": torch.full((rows, tokens), 0.5),
        "mask": torch.ones(rows, tokens, dtype=torch.bool),
        "lengths": torch.full((rows,), float(tokens)),
        "correct": rewards >= 1.0,
        "prompt_keys": ["a", "b"],
        "state": SmoothAdvantageStandardizer() if config.advantage == "dcpo" else None,
        "completion_ids": torch.tensor([[1, 2, 3], [1, 2, 4], [5, 6, 7], [5, 8, 9]]),
        "logprobs": torch.full((rows, tokens), -1.0),
        "ref_logprobs": torch.full((rows, tokens), -1.1),
        "turn_rewards": torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [1.0, 0.0]]),
        "turn_ids": turn_ids,
        "step_rewards": torch.ones(rows, turns),
        "state_ids": torch.tensor([[0, 1], [0, 2], [3, 4], [3, 4]]),
        "step_ids": turn_ids,
    }
    options = _estimator_options(spec, config, synthetic)
    values = torch.stack([rewards] * max(len(config.reward_names), 1), 1)
    estimator_rewards = values if spec.rewards_shape == "[B, K]" else rewards
    try:
        advantage_registry.estimate(config.advantage, estimator_rewards, group_index, **options)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"advantage {config.advantage!r} with {config.advantage_options}: {exc}") from None


TERMINATION_SIGNALS = ("SIGTERM", "SIGUSR1")  # what schedulers send before a kill (SLURM, Kubernetes, systemd)


class _Abandon(BaseException):
    """Raised by the signal handler to abandon a step before its first update (a BaseException: no `except
    Exception` in a reward function or sampler may swallow it)."""


class _StopAfterStep:
    """How a run stops on a signal. Only in one process, on the main thread (signal handlers live there).

    Ctrl-C (SIGINT, watched from the first step on): the current step finishes, then the loop checkpoints and
    stops; a second Ctrl-C stops at once. SIGTERM / SIGUSR1 (watched from the start of train()): while nothing
    of the current step is applied (`abandonable`: sampling, scoring, log-probs, up to its first optimizer
    step; and before the first step) the step is abandoned at once (_Abandon); once an update was applied,
    the step's remaining updates finish and the loop checkpoints and stops. A signal during a checkpoint write
    (`deferred`) waits for the write to end. `signum`: the signal that asked for the stop (a termination signal
    takes precedence over Ctrl-C: the exit status follows the scheduler's signal)."""

    def __init__(self, enabled: bool, log):
        import threading

        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested, self.log, self._defer = False, log, False
        self.signum = None
        self.abandonable = True  # no update of the current step applied (and none of this run before step 1)
        self.opened = None  # (run folder, its start step, new run) once the folder is open
        self._previous = {}

    def install(self, names) -> None:
        if not self.enabled:
            return
        for name in names:
            number = getattr(signal, name, None)
            if number is not None and number not in self._previous:
                self._previous[number] = signal.signal(number, self._handle)

    def restore(self, names=None) -> None:
        for number in list(self._previous):
            if names is None or number.name in names:
                signal.signal(number, self._previous.pop(number))

    @contextlib.contextmanager
    def watching_interrupts(self):
        self.install(("SIGINT",))
        try:
            yield self
        finally:
            self.restore(("SIGINT",))

    def describe(self) -> str:
        return "Ctrl-C" if self.signum in (None, signal.SIGINT) else signal.Signals(self.signum).name

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            if self.requested and not self._defer:
                raise KeyboardInterrupt
            self.requested = True
            self.signum = self.signum or signum
            self.log("\nCtrl-C: finishing this step, then a checkpoint (Ctrl-C again to stop at once)")
            return
        first = self.signum in (None, signal.SIGINT)
        self.requested, self.signum = True, signum if first else self.signum
        if self.abandonable and not self._defer:
            raise _Abandon
        if first:
            what = "the checkpoint being written" if self._defer else "this step's updates, then a checkpoint"
            self.log(f"\n{signal.Signals(signum).name}: finishing {what}, then stopping")

    @contextlib.contextmanager
    def deferred(self):
        self._defer = True
        try:
            yield
        finally:
            self._defer = False


def resume_command(run_dir: str) -> str:
    """The command that continues `run_dir`, quoted for a POSIX shell."""
    return f"grpo-kernels train --resume {shlex.quote(run_dir)}"


def _interrupted(run_dir: str, step: int, signum: int, new_run: bool, locks: list) -> TrainingInterrupted:
    """The TrainingInterrupted of a stop after `step` (the last checkpoint). A new run stopped before any step
    was recorded keeps nothing: its folder (config.json, an empty metrics.jsonl, its lock) is removed, so the
    command that started it starts it again (a scheduler's requeue runs the same command)."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    empty = not os.path.isfile(metrics) or os.path.getsize(metrics) == 0
    if step > 0 or not new_run or not empty or ckpt.list_checkpoints(os.path.join(run_dir, "checkpoints")):
        return TrainingInterrupted(run_dir, step, signum)
    for lock in locks:
        lock.release()
    shutil.rmtree(run_dir, ignore_errors=True)
    return TrainingInterrupted(run_dir, 0, signum, discarded=not os.path.exists(run_dir))


# a step that moves the weights by more than this share of their norm is a blow-up, not learning: AdamW moves each
# weight by about lr per update, a few percent of the norm per step for the embedded model at its default rate
BLOW_UP_MOVE = 0.1


def _blow_up_advice(config, checkpoints_dir: str, run_dir: str, last_saved: int, metrics_path: str) -> str | None:
    """After a divergence: None when the checkpoints look sound (resume from the last one, with a lower rate);
    else where to go instead. A checkpoint is past the blow-up when its weights moved more than BLOW_UP_MOVE of
    their norm per step since the checkpoint before it (the first kept one: since the initial model); the advice
    names the newest checkpoint before the first such one (the later ones are moved aside by the command), or,
    when there is none, says to start over."""
    folders = ckpt.list_checkpoints(checkpoints_dir)
    if not folders:
        return None
    steps = [int(os.path.basename(f)[len(ckpt.STEP_PREFIX):]) for f in folders]
    initial, _, _ = load_policy(config.model, config.seed)
    previous, previous_step, moves = initial.state_dict(), 0, []
    first_bad = None
    for folder, step in zip(folders, steps):
        distance, norm = ckpt.model_distance(folder, previous)
        per_step = distance / max(norm, 1e-30) / max(step - previous_step, 1)
        moves.append((step, distance, norm, previous_step, per_step))
        if per_step > BLOW_UP_MOVE and first_bad is None:
            first_bad = len(moves) - 1
        previous, previous_step = folder, step
    if first_bad is None:
        return None
    step, distance, norm, since, per_step = moves[first_bad]
    records = [m for m in read_metrics(metrics_path) if since < m.get("step", 0) <= step]
    logged = max((m["grad_norm"] for m in records if isinstance(m.get("grad_norm"), (int, float))), default=None)
    # AdamW moves each weight by about lr per update whatever the gradient's size, so the move is about
    # proportional to the rate: the rate that would have moved the weights 1% of their norm per step
    rate = max((m["lr"] for m in records if isinstance(m.get("lr"), (int, float))), default=config.lr)
    lower = f"--lr {float(f'{rate * (BLOW_UP_MOVE / 10) / per_step:.0e}'):g}"
    origin = f"the checkpoint of step {since}" if since else "the initial model"
    why = (f"the checkpoint of step {step} is itself past the blow-up: its weights are {distance:.3g} from {origin} "
           f"(whose norm is {norm:.3g}), {per_step:.0%} of it per step, where a sound step moves them a few percent "
           "at most" + (f"; the gradient norm logged up to it reached {logged:.3g}" if logged is not None else ""))
    if first_bad == 0:
        return (f"{why}, at learning rate {rate:g}; no kept checkpoint is before it: start over with a learning rate "
                f"that moves them about 1% per step ({lower}) in a new run folder (or remove this one first: rm -r "
                f"{shlex.quote(run_dir)})")  # fmt: skip
    good, good_step = folders[first_bad - 1], steps[first_bad - 1]
    later = " ".join(shlex.quote(f) for f in folders[first_bad:])
    # the rate that reached the sound checkpoint (the highest logged up to it), unless a tenth of the run's is lower
    sound = [m["lr"] for m in read_metrics(metrics_path) if m.get("step", 0) <= good_step and "lr" in m]
    lower = f"--lr {min(config.lr / 10, max(sound, default=config.lr)):g}"
    return (f"{why}, at learning rate {rate:g}; the last sound checkpoint is step {good_step} ({good}): move the "
            f"later ones aside and continue from it at the rate that reached it (or a tenth of this run's, if lower): "
            f"for c in {later}; do mv \"$c\" \"$c.diverged\"; done && {resume_command(run_dir)} {lower}")  # fmt: skip


def _collect_rollouts(config, task, tokenizer, sampler, hook, hook_context, prompt_generator, encode_prompt=None):
    """Sample, score, let the hook act, and (dynamic sampling) keep informative groups until the step has
    prompts_per_step of them. Returns (rollouts or None, every sampled reward [fp32], statistics).
    `encode_prompt`: prompt text -> ids (preflight.PromptEncoder: within the model's context); default the
    tokenizer."""
    if encode_prompt is None:
        encode_prompt = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    per_prompt = config.group_size * hook.sample_multiplier
    rounds = (config.max_sampling_rounds or 4) if config.dynamic_sampling else 1
    parts, sampled, stats, seen = [], [], {}, set()
    next_label = 0  # group labels run on across rounds: a later round's groups never share a label
    for round_index in range(rounds):
        prompts, answers = task.sample(prompt_generator, config.prompts_per_step, exclude=seen)
        if not prompts:
            break  # dynamic sampling has drawn every prompt of the task this step
        seen.update(prompts)
        prompt_tokens = [encode_prompt(p) for p in prompts]
        rows = [g for g in range(len(prompts)) for _ in range(per_prompt)]  # a group's rows are consecutive
        row_prompts, row_answers = [prompts[g] for g in rows], [answers[g] for g in rows]
        row_prompt_tokens = [prompt_tokens[g] for g in rows]
        episode = {}
        if task.multi_turn:  # policy turns and environment replies (trainer/multiturn.py)
            episodes = generate_episodes(
                sampler.generate, task.environment, row_prompts, row_prompt_tokens, hook_context.encode,
                hook_context.decode, hook_context.max_new_tokens,
            )  # fmt: skip
            completions, truncated, logprobs = episodes.completion_tokens, episodes.truncated, None
            texts = episodes.final_texts
            turn_rewards = [task.environment.turn_rewards(p, a, t)
                            for p, a, t in zip(row_prompts, row_answers, episodes.turn_texts)]  # fmt: skip
            episode = dict(
                turn_ids=episodes.turn_ids,
                turn_rewards=_check_turn_rewards(turn_rewards, task.environment.turns),
                state_keys=episodes.state_keys,
            )
        else:
            completions, truncated, logprobs = sampler.generate(row_prompt_tokens, hook_context.max_new_tokens)
            texts = [hook_context.decode(c) for c in completions]
        rollouts = hook_context.score(
            Rollouts(
                prompts=row_prompts,
                answers=row_answers,
                groups=[next_label + g for g in rows],
                prompt_tokens=row_prompt_tokens,
                completion_tokens=completions,
                completions=texts,
                truncated=truncated,
                rollout_logprobs=logprobs,
                **episode,
            )
        )
        next_label += len(prompts)
        sampled.append(rollouts.rewards if rollouts.task_rewards is None else rollouts.task_rewards)
        rollouts, hook_stats = hook.after_scoring(rollouts, hook_context)
        for key, value in hook_stats.items():
            stats[key] = stats.get(key, 0.0) + value / rounds
        if config.dynamic_sampling:
            kept = gk_advantages.dynamic_sampling(rollouts.rewards, rollouts.group_index).kept
            rollouts = rollouts.select(kept.tolist())
        if len(rollouts):
            parts.append(rollouts)
        if sum(len(set(p.groups)) for p in parts) >= config.prompts_per_step:
            break
    stats["sampling_rounds"] = len(sampled)
    if not parts:
        return None, torch.cat(sampled), stats
    rollouts = Rollouts.concat(parts)
    if config.dynamic_sampling:  # the first prompts_per_step informative groups
        first_groups = (rollouts.group_index < config.prompts_per_step).nonzero().flatten()
        rollouts = rollouts.select(first_groups.tolist())
    return rollouts, torch.cat(sampled), stats


def _check_turn_rewards(values: list, turns: int) -> torch.Tensor:
    rewards = torch.tensor(values, dtype=torch.float32)
    if rewards.shape != (len(values), turns) or not bool(torch.isfinite(rewards).all()):
        raise TrainingError(f"the environment's turn_rewards must give {turns} finite floats per episode")
    return rewards


def _completion_hidden(model, batch: PaddedBatch, rows: slice) -> torch.Tensor:
    """Last hidden states that predict the completion tokens, [b, C, H]. The one-token shift: the state at
    position t predicts token t + 1, so prompt position P - 1 predicts the first completion token."""
    input_ids = torch.cat([batch.prompt_ids[rows], batch.completion_ids[rows]], dim=1)  # [b, P + C]
    attention = torch.cat([batch.prompt_mask[rows], batch.completion_mask[rows]], dim=1).long()
    positions = (attention.cumsum(1) - 1).clamp(min=0)  # left-padded prompts: count from the first token
    backbone = model.get_decoder()
    hidden = backbone(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False)
    return hidden.last_hidden_state[:, batch.prompt_ids.shape[1] - 1 : -1]


def _micro_batches(size: int, micro_batch_size: int) -> list[slice]:
    return [slice(start, min(start + micro_batch_size, size)) for start in range(0, size, micro_batch_size)]


def _lm_head(model, dtype, vocab: int | None = None):
    """The LM head's weight [V', H] and bias [V'] (or None) in `dtype`; V' = `vocab` first rows when given: a
    vocabulary padded beyond its tokenizer trains on the rows the samplers draw from (preflight.Vocabulary),
    so the loss's softmax is theirs. Row slices are views; cast copies stay differentiable."""
    weight, bias = lm_head_params(model)  # [V, H], [V] or None
    if vocab is not None and vocab < weight.shape[0]:
        weight, bias = weight[:vocab], None if bias is None else bias[:vocab]
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _fused(fn, hidden, *args, what: str, **kwargs):
    """`fn(hidden, ...)` (a fused function); its refusal of a non-finite hidden state (the model's forward
    overflowed: the run diverged) becomes _NonFinite, any other error passes."""
    try:
        return fn(hidden, *args, **kwargs)
    except ValueError:
        bad = int((~torch.isfinite(hidden)).sum())
        if bad:
            raise _NonFinite(f"{bad} non-finite value(s) in the last hidden states of the {what}") from None
        raise


@torch.no_grad()
def _token_logprobs(model, batch: PaddedBatch, config, compute: Compute, need_entropy: bool, ctx=None, *,
                    vocab: int | None = None):  # fmt: skip
    """Per-token log-probs [B, C] (and entropy [B, C], or None) of `model` on the batch's completions, over the
    first `vocab` tokens when given. Several processes: each computes its block of rows, then every rank gets
    all of them."""
    model.eval()
    logprobs = torch.zeros(batch.completion_ids.shape, device=compute.device)
    entropy = torch.zeros_like(logprobs) if need_entropy else None
    block = ctx.block(len(batch)) if ctx is not None else slice(0, len(batch))
    for local in _micro_batches(block.stop - block.start, config.micro_batch_size):
        rows = slice(block.start + local.start, block.start + local.stop)
        with compute.autocast():
            hidden = _completion_hidden(model, batch, rows)  # [b, C, H]
        weight, bias = _lm_head(model, compute.dtype, vocab)
        out = _fused(
            fused_linear_logprobs, hidden.to(compute.dtype), weight, batch.completion_ids[rows], bias,
            config.temperature, mask=batch.loss_mask[rows], compute_entropy=need_entropy, backend=config.backend,
            batch_invariant=config.batch_invariant, what="log-prob forward", **logit_transform(model),
        )  # fmt: skip
        logprobs[rows] = out.logprobs
        if need_entropy:
            entropy[rows] = out.entropy
    if ctx is not None:
        logprobs = ctx.gather_rows(logprobs[block], len(batch))
        entropy = ctx.gather_rows(entropy[block], len(batch)) if need_entropy else None
    return logprobs, entropy


def _micro_batch_loss(policy, batch, rows, loss_config, config, compute, normalizers, rollout_logprobs,
                      vocab=None):  # fmt: skip
    """The fused loss of one micro-batch (rows of the batch), over the first `vocab` tokens when given:
    (loss, metrics)."""

    def rows_of(x):
        return None if x is None else x[rows]

    with compute.autocast():
        hidden = _completion_hidden(policy, batch, rows)  # [b, C, H]
    weight, bias = _lm_head(policy, compute.dtype, vocab)
    out = _fused(
        fused_linear_grpo_loss, hidden.to(compute.dtype), weight, batch.completion_ids[rows],
        batch.advantages[rows], batch.loss_mask[rows], old_logprobs=rows_of(batch.old_logprobs),
        ref_logprobs=rows_of(batch.ref_logprobs), rollout_logprobs=rows_of(rollout_logprobs), bias=bias,
        config=loss_config, backend=config.backend, batch_invariant=config.batch_invariant, what="training forward",
        **normalizers, **logit_transform(policy),
    )  # fmt: skip
    return out.loss, out.metrics


def _update(policy, optimizer, batch: PaddedBatch, loss_config, config, compute: Compute, ctx=None,
            loss_module=None, *, vocab: int | None = None) -> dict[str, float]:  # fmt: skip
    """One optimizer step on the whole batch, accumulated over micro-batches. With the step's global token
    and sequence counts as normalizers, the micro-batch losses sum to the loss of the whole batch.
    Variants that select tokens by batch statistics (top-entropy quantile, Clip-Cov, KL-Cov) select within
    each micro-batch, as TRL and verl do; micro_batch_size >= the batch makes the selection batch-wide.
    The training forward runs in eval mode (no dropout: the policy trained is the one sampled and scored)
    unless config.keep_dropout. A non-finite loss or gradient raises _NonFinite before the optimizer step,
    so the weights are never updated with it."""
    policy.train(config.keep_dropout)
    mask = batch.loss_mask
    # several processes: this rank's block of rows; the normalizers stay those of the whole batch, with
    # dp_size = K so that DDP's average of the ranks' gradients is the gradient of the batch's loss
    block = ctx.block(len(batch)) if ctx is not None else slice(0, len(batch))
    world = ctx.world if ctx is not None else 1
    slices = [slice(block.start + s.start, block.start + s.stop)
              for s in _micro_batches(block.stop - block.start, config.micro_batch_size)]  # fmt: skip
    local_only = loss_config.loss_type == "group_dpo" or "length-pow" in (
        loss_config.loss_agg_mode, loss_config.entropy_agg_mode)  # fmt: skip
    if local_only:  # these normalise by the micro-batch's own counts (group_dpo: its pairs)
        normalizers = {"grad_accum_steps": len(slices), "dp_size": world}
    else:
        normalizers = {"num_tokens": float(mask.sum()), "num_sequences": float(len(batch)), "dp_size": world}
    uses_rollout = loss_config.uses_rollout_logprobs
    rollout_logprobs = batch.rollout_logprobs if uses_rollout else None
    args = (batch, loss_config, config, compute, normalizers, rollout_logprobs, vocab)

    optimizer.zero_grad(set_to_none=True)
    loss_total, sums, tokens, extremes = 0.0, {}, {}, {}
    for i, rows in enumerate(slices):
        if loss_module is None:
            loss, metrics = _micro_batch_loss(policy, batch, rows, *args[1:])
            loss.backward()
        else:  # DDP averages the gradients once, after the last micro-batch of this rank
            sync = contextlib.nullcontext() if i == len(slices) - 1 else loss_module.no_sync()
            with sync:
                loss, metrics = loss_module(_micro_batch_loss, batch, rows, *args[1:])
                loss.backward()
        loss_total += loss.item()
        micro_tokens = float(mask[rows].sum())
        for key, value in metrics.items():  # token-weighted means across micro-batches,
            if key.endswith(("/min", "_min", "/max", "_max")):  # extremes of extremes (ratio/max, is_weight/min)
                if micro_tokens > 0:  # an all-masked micro-batch reports placeholder extremes
                    pick = min if key.endswith("min") else max
                    extremes[key] = pick(extremes.get(key, float(value)), float(value))
                continue
            sums[key] = sums.get(key, 0.0) + float(value) * micro_tokens
            tokens[key] = tokens.get(key, 0.0) + micro_tokens
    if ctx is not None:  # the whole batch's values: each rank's loss carries the factor dp_size = K
        loss_total = ctx.sum(loss_total) / world
        for key in sorted(sums):
            sums[key], tokens[key] = ctx.sum(sums[key]), ctx.sum(tokens[key])
        ranks = ctx.all_gather_objects(extremes)
        extremes = {key: (min if key.endswith("min") else max)(r[key] for r in ranks if key in r)
                    for key in sorted({k for r in ranks for k in r})}  # fmt: skip
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor norm over the sharded gradients
        grad_norm = grad_norm.full_tensor()
    if not (math.isfinite(loss_total) and math.isfinite(float(grad_norm))):  # every rank sees the same values
        raise _NonFinite(_describe_non_finite(policy, loss_total, float(grad_norm)))
    optimizer.step()
    means = {key: sums[key] / max(tokens[key], 1.0) for key in sums}
    return {"loss": loss_total, "grad_norm": float(grad_norm), **means, **extremes}


def _describe_non_finite(policy, loss: float, grad_norm: float) -> str:
    """What went non-finite in an update: the loss, the gradient norm, the parameters with such gradients."""
    names = []
    for name, parameter in policy.named_parameters():
        grad = parameter.grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad  # FSDP2: a sharded gradient
        if grad is not None and not bool(torch.isfinite(grad).all()):
            names.append(name)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    parts = [f"the loss is {loss:g}" if not math.isfinite(loss) else f"the loss is finite ({loss:g})",
             f"the gradient norm is {grad_norm:g}"]  # fmt: skip
    if names:
        parts.append(f"non-finite gradients in {shown}")
    return ", ".join(parts)


def _start_vllm(config: TrainConfig, policy, tokenizer, eos_ids, run_dir: str, ctx, vocabulary=None) -> VLLMSampler:
    """A colocated vLLM engine on the initial policy, which it reads from <run>/vllm_init (written by rank 0);
    under torchrun every rank starts its own (TRL's colocate mode) on the trainer's process group."""
    folder = os.path.join(run_dir, "vllm_init")
    if ctx is None or ctx.is_main:
        _save_pretrained(policy, tokenizer, folder)
    if ctx is not None:
        ctx.barrier()
    vocab = vocabulary.limit if vocabulary is not None and vocabulary.padded else None
    return VLLMSampler(folder, eos_ids, config.temperature, config.seed, dtype=config.vllm_dtype,
                       distributed=ctx is not None, vocab=vocab)  # fmt: skip


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but torch sees no CUDA device; use --device cpu or auto")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _save_pretrained(model, tokenizer, folder: str) -> str:
    """A Hugging Face model folder, written like a checkpoint: under `<folder>.partial`, files set to the
    user's umask, then renamed, so `folder` is complete or absent (a killed write never looks like a model)."""
    from transformers.utils import logging as hf_logging

    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar under ours
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        ckpt.apply_umask(partial)
        ckpt.swap_in(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        hf_logging.enable_progress_bar()
    return folder


def _write_errors() -> tuple[type[Exception], ...]:
    """The exceptions of a failed write: OSError, and safetensors' own (an I/O error it wraps)."""
    from safetensors import SafetensorError

    return (OSError, SafetensorError)


def _describe_backend(backend: str, device: torch.device) -> str:
    """Which grpo_kernels implementation the loss runs on, said once here rather than as a warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            resolved = resolve_backend(backend, device, "fused_linear_grpo_loss")
            resolve_backend(backend, device, "fused_linear_logprobs")
        except RuntimeError as exc:  # e.g. backend="triton" without CUDA: a configuration error
            raise ValueError(str(exc)) from None
    reasons = "; ".join(str(w.message).removeprefix("grpo_kernels: ") for w in caught)
    return f"grpo_kernels backend {resolved!r}" + (f" ({reasons})" if reasons else "")


def _describe_processes(ctx: DistContext | None, config: TrainConfig) -> str:
    """The startup line on processes, parallelism and the communication backend."""
    seeds = ("each prompt group sampled under its own seed (the same batches with any number of processes)"
             if config.rollout_engine != "vllm" or ctx is not None
             else "the vLLM engine samples the whole batch under the run's seed")  # fmt: skip
    if ctx is None:
        return f"processes: 1 (not under torchrun), no data parallelism; {seeds}"
    import torch.distributed as dist

    parallelism = "FSDP2 (fully_shard per decoder layer)" if config.fsdp else "DDP"
    return (f"processes: {ctx.world} (torchrun), data parallel with {parallelism}, "
            f"{dist.get_backend()} backend; {seeds}")  # fmt: skip


def _progress_bar(start: int, total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", disable=not enabled, dynamic_ncols=True)
