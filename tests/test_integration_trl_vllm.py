"""The TRL adapter with a real vLLM engine (TRL's colocate mode): `GRPOKernelsTrainer(use_vllm=True,
vllm_mode="colocate")` trains like TRL 1.16.0's `GRPOTrainer` on the same engine, in both modes, with TRL's
vLLM importance-sampling correction on (marker `vllm`: runs in the vLLM environment, tests/vllm_support.py).

Approach. One vLLM CPU engine (fp32, eager) serves every trainer of this module: TRL builds its engine with
`vllm.LLM(...)` inside `VLLMGeneration`; the module patches that name with a factory that builds the engine
once, with TRL's own arguments plus what the CPU needs (fp32: vLLM would serve an fp32 checkpoint in bf16;
eager: no compilation), and hands the same engine to every later trainer (one engine start, ~5 s). Each
trainer trains the tiny Qwen2 model of tests/test_integration_trl.py, resized to head size 32 (vLLM's CPU
attention takes 32, 64, 80, ... 512) and saved to a folder (vLLM loads from a path), for two optimizer
steps of two accumulated micro-batches, one generation round per step: the second round samples from the
weights of step 1, synced to the engine. Compared, per mode and IS setting, against TRL's GRPOTrainer on
the same engine: the completions, every logged value, every gradient before each optimizer step and the
parameters after training (test_integration_trl.compare).

The weight sync. TRL 1.16's colocate sync (`VLLMGeneration.sync_weights`) calls the model's
`load_weights` through private attributes of the engine, which fails on the CPU engine (`AttributeError:
'Parameter' object has no attribute 'weight_loader'`: the CPU backend prepacks its linear weights). It is
replaced, in both trainers alike (the class both use), by vLLM's public worker call that works there,
`llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`, fed by TRL's own parameter walk
(`_iter_named_params`), followed by TRL's prefix-cache reset. Each round checks that the engine then
samples from the trainer's current weights (below), so a sync that silently did nothing fails the test.

The same completions on both sides. The engine samples with the process's torch generator (it runs in
the trainer's process); each run reseeds it before `train()`, and both trainers consume it identically,
so they draw the same tokens; the test asserts it (completion ids equal) before comparing anything else.
The first round starts from identical weights: its log-probs are equal bit for bit (asserted). The second
samples from weights that differ by the fp32 rounding of one step, which moves the engine's log-probs by
measured 5e-6 .. 7e-6: a different token would need a uniform draw within that
distance of a boundary (never seen; the assertion would say so). An fp32 engine is what makes this
exact: a bf16 engine would round weights that differ in the last fp32 bit to different bf16 values.

A real mismatch on an fp32 engine. TRL's sampler returns vLLM's "processed" log-probs (after temperature
and top-k, `logprobs_mode="processed_logprobs"`), while the trainer scores the full distribution: with
top_k=4 of 16 tokens the sampler's log-probs exceed the trainer's by -log(top-4 mass) at every token,
so the IS ratios are far from 1 and the correction's clipping / masking binds (asserted). The sync check
uses the same relation: the engine's log-probs equal the log-softmax of the synced weights' top-4 logits.

Tolerances. Between the trainers: tests/test_integration_trl.py's `compare` (fp32 summation orders; the
second step's gradient tolerance grows as there) — the engine adds nothing of its own: its second
round's inputs differ only by those parameter differences, and each run's log-probs are tied to its own
weights by the sync check. Engine vs the synced weights: ENGINE_TOL (two implementations of the same fp32
network, see its comment).
"""

from __future__ import annotations

import copy
import os
from importlib import metadata

import pytest
import torch
from vllm_support import require_vllm

from grpo_kernels.integrations.trl import MODES  # importing the adapter does not import TRL

pytestmark = pytest.mark.vllm

TRL_VERSION = "1.16.0"
TOP_K = 4  # of 16 tokens: the sampler's processed log-probs differ from the trainer's (a real mismatch)
TEMPERATURE = 0.9
# Engine (vLLM CPU kernels, fp32) vs transformers on the same fp32 weights: the same network computed
# by two implementations (other GEMM blockings, fused RMSNorm / rotary / attention kernels), on logits of a
# few units (initializer_range 0.3); measured worst 9.1e-6 over every round of this module, so 1e-4 leaves a
# margin of 11, while a stale engine (no sync) misses by the weights' change: asserted >= 100x larger
# (measured 0.88, or a token leaving the top 4: infinite).
ENGINE_TOL = 1e-4
# head size 32 (2 heads of 32, one KV head), the smallest vLLM's CPU attention accepts
SERVABLE = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
# one schedule for every run (the engine's max_num_seqs follows from it): one generation round per optimizer
# step of two micro-batches, two steps, so the second round samples from the weights of step 1
SCHEDULE = dict(max_steps=2, gradient_accumulation_steps=2, num_iterations=1)
IS_SETTINGS = {
    # TRL's default mode; sequences whose ratio falls under 0.4 are masked (ratio 0), the others kept
    "sequence_mask": dict(
        vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_min=0.4
    ),
    # per-token ratios truncated into [0.8, 3]
    "token_truncate": dict(
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.8
    ),
}


@pytest.fixture(scope="module")
def harness():
    """tests/test_integration_trl.py (tiny model, tokenizer, config and comparison helpers), imported once
    vLLM is known to be there; in the vLLM environment TRL is required as well."""
    require_vllm()
    version = None
    try:
        version = metadata.version("trl")
    except metadata.PackageNotFoundError:
        pass
    if version != TRL_VERSION:
        message = f"needs trl=={TRL_VERSION} beside vLLM (found {version}): pip install trl=={TRL_VERSION}"
        if os.environ.get("GRPO_KERNELS_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    import test_integration_trl

    return test_integration_trl


class SharedEngine:
    """One vLLM engine for every trainer of the module, the weight sync that works on it, and a record
    of what each run synced and generated."""

    def __init__(self):
        self.llm = None
        self.llm_kwargs = None
        self.syncs = []  # per sync: {name: fp32 tensor} as pushed to the engine
        self.rounds = []  # per generate call: (prompt ids, completion ids, sampler log-probs)
        self.trl_sync_weights = None  # TRL's own VLLMGeneration.sync_weights (replaced while the module runs)

    def build(self, **trl_kwargs):
        """Stands in for `vllm.LLM` in trl.generation.vllm_generation: TRL's arguments, + fp32 and eager."""
        if self.llm is None:
            import vllm

            self.llm_kwargs = trl_kwargs
            self.llm = vllm.LLM(**trl_kwargs, dtype="float32", enforce_eager=True)
        assert trl_kwargs == self.llm_kwargs, "a trainer asked for another engine configuration"
        return self.llm

    def sync_weights(self, generation):
        """VLLMGeneration.sync_weights for the CPU engine: the same parameter walk as TRL's, into vLLM's
        `reload_weights` worker call (public API; works on CPU and GPU engines), then TRL's cache reset."""
        weights = [(name, param.detach().clone()) for name, param in generation._iter_named_params()]
        generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        generation.llm.reset_prefix_cache()
        self.syncs.append(dict(weights))

    def record(self, generate):
        def recorded(generation, prompts, *args, **kwargs):
            out = generate(generation, prompts, *args, **kwargs)
            prompt_ids, completion_ids, logprobs, _ = out
            self.rounds.append((
                [list(p) for p in prompt_ids], [list(c) for c in completion_ids],
                [[lp[0] for lp in seq] for seq in logprobs],
            ))  # fmt: skip
            return out

        return recorded


@pytest.fixture(scope="module")
def engine(harness):
    import trl.generation.vllm_generation as trl_vllm

    shared = SharedEngine()
    shared.trl_sync_weights = trl_vllm.VLLMGeneration.sync_weights
    threads = torch.get_num_threads()
    # TRL's colocate mode sets the first five for vLLM; vLLM's external launcher sets the last (in-process
    # engines): restored afterwards, so that the next module's engines start as they would alone
    env_keys = (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "VLLM_ENABLE_V1_MULTIPROCESSING"
    )  # fmt: skip
    saved_env = {k: os.environ.get(k) for k in env_keys}
    patch = pytest.MonkeyPatch()
    patch.setattr(trl_vllm, "LLM", shared.build)
    patch.setattr(trl_vllm.VLLMGeneration, "sync_weights", lambda generation: shared.sync_weights(generation))
    patch.setattr(trl_vllm.VLLMGeneration, "generate", shared.record(trl_vllm.VLLMGeneration.generate))
    try:
        yield shared
    finally:
        patch.undo()
        torch.set_num_threads(threads)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shared.llm = None


@pytest.fixture(scope="module")
def model_dir(harness, tmp_path_factory):
    import transformers

    config = transformers.Qwen2Config(**dict(harness.text_config(len(harness.WORDS)), **SERVABLE))
    assert config.hidden_size // config.num_attention_heads == 32
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_vllm") / "qwen2"
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    harness.make_tokenizer().save_pretrained(path)
    return str(path)


def build_trainer(harness, trainer_cls, model_dir, tmp_path, is_setting, **kwargs):
    from datasets import Dataset

    recorder = harness.GradientRecorder()
    config = harness.grpo_config(
        str(tmp_path), use_vllm=True, vllm_mode="colocate", vllm_importance_sampling_correction=True,
        top_k=TOP_K, temperature=TEMPERATURE, **SCHEDULE, **IS_SETTINGS[is_setting],
    )  # fmt: skip
    trainer = trainer_cls(
        model=model_dir, reward_funcs=harness.reward_letters, args=config,
        train_dataset=Dataset.from_dict({"prompt": harness.PROMPTS}), callbacks=[recorder], **kwargs,
    )  # fmt: skip
    return trainer, recorder


def train(harness, engine, trainer_cls, model_dir, tmp_path, is_setting, **kwargs):
    """One vLLM colocate run: (log history, gradients per optimizer step, final parameters), and (the
    weights synced to the engine, what it generated) per round."""
    engine.syncs, engine.rounds = [], []
    trainer, recorder = build_trainer(harness, trainer_cls, model_dir, tmp_path, is_setting, **kwargs)
    assert trainer.vllm_generation.llm is engine.llm
    torch.set_num_threads(1)  # tiny model: thread start-up dominates (the engine may have changed it)
    torch.manual_seed(1234)  # the engine samples with this process's generator
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return (copy.deepcopy(trainer.state.log_history), recorder.steps, params), (engine.syncs, engine.rounds)


_trl_runs: dict = {}


def trl_run(harness, engine, model_dir, tmp_path, is_setting):
    if is_setting not in _trl_runs:
        from trl import GRPOTrainer

        _trl_runs[is_setting] = train(harness, engine, GRPOTrainer, model_dir, tmp_path / "trl", is_setting)
    return _trl_runs[is_setting]


def engine_logprobs_of(model_dir, weights, prompt_ids, completion_ids):
    """What an engine holding `weights` returns for these tokens: log-softmax of the top-k of logits / T."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights)
    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompt_ids, completion_ids, strict=True):
            ids = torch.tensor([prompt + completion])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
            kth = logits.topk(TOP_K, dim=-1).values[:, -1:]
            logp = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
            out.append(logp.gather(-1, torch.tensor(completion)[:, None])[:, 0])
    return out


def check_engine_served_synced_weights(model_dir, syncs, rounds):
    """Each generation round sampled from the weights synced just before it (within ENGINE_TOL), and not
    from the previous round's (the sync had an effect)."""
    assert len(syncs) == len(rounds) == 2, f"{len(syncs)} syncs, {len(rounds)} generation rounds (expected 2)"
    for i, (weights, (prompts, completions, sampled)) in enumerate(zip(syncs, rounds, strict=True)):
        expected = engine_logprobs_of(model_dir, weights, prompts, completions)
        err = max(float((torch.tensor(s) - e).abs().max()) for s, e in zip(sampled, expected, strict=True))
        assert err <= ENGINE_TOL, f"round {i}: engine log-probs differ from the synced weights' by {err:.3e}"
        if i:
            stale = engine_logprobs_of(model_dir, syncs[i - 1], prompts, completions)
            moved = max(float((s - e).abs().max()) for s, e in zip(stale, expected, strict=True))
            assert moved >= 100 * ENGINE_TOL, f"round {i}: the weights barely moved ({moved:.3e}): weak check"


def compare_rounds(ctx, theirs, ours, first_step_gap):
    """Both trainers' engines drew the same completions. Round 0 starts from the same weights on the same
    engine: the same log-probs, bit for bit. Later rounds sample from weights that differ by the trainers'
    rounding (measured 5e-6 .. 7e-6 apart on these log-probs); each run's own check ties them to its weights
    (check_engine_served_synced_weights), and `compare` holds everything computed from them."""
    assert len(ours) == len(theirs), f"{ctx}: {len(ours)} generation rounds, TRL {len(theirs)}"
    for i, ((p_t, c_t, l_t), (p_o, c_o, l_o)) in enumerate(zip(theirs, ours, strict=True)):
        assert p_o == p_t, f"{ctx} round {i}: different prompts"
        assert c_o == c_t, (
            f"{ctx} round {i}: the engine sampled different completions: ours {c_o}, TRL {c_t} (the first "
            f"optimizer step's gradients differ by {first_step_gap:.2e} of their largest element; measured "
            "<= 4e-7 when the trainers agree)"
        )
        if i == 0:
            assert l_o == l_t, f"{ctx} round 0: same weights and tokens, log-probs differ: {l_o}, TRL {l_t}"


@pytest.mark.parametrize("is_setting", list(IS_SETTINGS))
@pytest.mark.parametrize("mode", MODES)
def test_vllm_colocate_training_matches_trl(mode, is_setting, harness, engine, model_dir, tmp_path):
    from grpo_kernels.integrations.trl import GRPOKernelsTrainer

    theirs, (syncs_t, rounds_t) = trl_run(harness, engine, model_dir, tmp_path, is_setting)
    ours, (syncs_o, rounds_o) = train(harness, engine, GRPOKernelsTrainer, model_dir, tmp_path / "ours",
                                      is_setting, grpo_kernels_mode=mode)  # fmt: skip
    ctx = f"[vLLM colocate, {is_setting}, grpo_kernels_mode={mode}]"
    check_engine_served_synced_weights(model_dir, syncs_o, rounds_o)
    grads_t, grads_o = theirs[1][0], ours[1][0]
    first_step_gap = max(float((grads_o[n] - g).abs().max()) for n, g in grads_t.items()) / max(
        float(g.abs().max()) for g in grads_t.values()
    )
    compare_rounds(ctx, rounds_t, rounds_o, first_step_gap)
    harness.compare(ctx, theirs, ours)


@pytest.mark.parametrize("is_setting", list(IS_SETTINGS))
def test_vllm_colocate_cases_exercise_the_correction(is_setting, harness, engine, model_dir, tmp_path):
    """TRL's own run: the engine served the synced weights each round, and the IS correction did bind
    (ratios far from 1, some masked or truncated), so the comparison above tests the correction."""
    (logs, _, _), (syncs, rounds) = trl_run(harness, engine, model_dir, tmp_path, is_setting)
    check_engine_served_synced_weights(model_dir, syncs, rounds)
    generation_logs = [row for row in logs if "sampling/importance_sampling_ratio/min" in row]
    assert generation_logs
    low = min(row["sampling/importance_sampling_ratio/min"] for row in generation_logs)
    if is_setting == "sequence_mask":
        assert low == 0.0, "no sequence was masked"
        assert max(row["sampling/importance_sampling_ratio/max"] for row in generation_logs) > 0.4
    else:
        assert low == pytest.approx(0.8), "no token ratio was truncated"



def test_trl_own_colocate_sync_fails_on_the_cpu_engine(harness, engine, model_dir, tmp_path):
    """Why the module replaces TRL's sync: TRL 1.16's colocate `sync_weights` calls the model's
    `load_weights` through `llm_engine.model_executor.driver_worker.model_runner.model`, which the CPU
    engine cannot take (its linear weights are prepacked; their parameters have no `weight_loader`). If
    this fails, TRL's sync works on the CPU engine and the replacement (and the integrations README's
    note) can go. Last in the module: the failed load may leave the engine half-updated."""
    from trl import GRPOTrainer
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the failure is the CPU engine's (prepacked linear weights)")
    trainer, _ = build_trainer(harness, GRPOTrainer, model_dir, tmp_path, "sequence_mask")
    assert trainer.vllm_generation.llm is engine.llm
    with pytest.raises(AttributeError, match="weight_loader"):
        engine.trl_sync_weights(trainer.vllm_generation)
