"""Parity with TRL 1.16.0: `GRPOTrainer._compute_loss` itself, called on our inputs, against
grpo_kernels' loss configured by the TRL adapter's mapping.

`_compute_loss(self, model, inputs)` reads only attributes of `self`, so it is called unbound on a
stand-in (`trl_trainer`) that provides exactly those attributes: the loss settings, `args`, an
accelerator of one process whose gather / reduce / pad are identities, `model.training`, `_metrics`,
TRL's own `get_high_entropy_mask` (bound), `get_off_policy_mask` / `get_gamma_weights` (static), and a
`_get_per_token_logps_and_entropies` that returns our leaf tensors. Compared: the returned loss, its
gradient w.r.t. the per-token log-probs and entropies, and every value logged in
`_metrics["train"|"eval"]`.

Our side is configured exactly as GRPOKernelsTrainer configures its fused loss, by the adapter's
functions applied to the same stand-in (grpo_kernels.integrations.trl): `policy_loss_config` (TRL's
settings -> PolicyLossConfig), `loss_normalizers` (TRL's divisions -> num_tokens / num_sequences /
dp_size / grad_accum_steps) and `log_trl_metrics` (our metrics -> the entries TRL appends to
`_metrics`, with TRL's cross-process reductions). Their docstrings give the mapping; this module
proves it, and test_integration_trl.py runs it inside real training.

TRL computes the vLLM importance-sampling ratio in `_generate_and_score_completions`, not in the
loss; `parity_helpers.trl_vllm_is_ratio` reproduces those lines (trl/trainer/grpo_trainer.py:2659-2707
in 1.16.0) and feeds the result as inputs["importance_sampling_ratio"]; ours gets the sampler's
log-probs (rollout_logprobs) and is_level / is_mode / is_min / is_max. The IS-ratio statistics TRL
logs there (sampling/importance_sampling_ratio/*) are compared with ours (is_weight/*) for the
token-level modes.
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from grpo_kernels.testing.peers import AcceleratorStandIn
from parity_helpers import (
    EMPTY_ROW,
    HOLE,
    LENGTHS,
    SEED,
    assert_close,
    grad_scale,
    leaf,
    make_mask,
    make_token_inputs,
    require_peer,
    trl_vllm_is_ratio,
)

require_peer("trl", "trl")

import grpo_kernels.integrations.trl as gk_trl
from trl import GRPOTrainer

import grpo_kernels as gk

pytestmark = pytest.mark.parity

B, T = len(LENGTHS), 9
MAX_COMPLETION_LENGTH = 12
LOSS_TYPES = gk_trl.TRL_LOSS_TYPES
EPSILON, EPSILON_HIGH, CISPO_CAP = 0.2, 0.28, 2.0  # cap 2: the ratios here reach ~7, so it binds
# the vLLM IS clip range: both bounds are hit at token and at sequence level (test_inputs_visit_every_regime)
IS_CLIP_MIN, IS_CLIP_MAX = 0.7, 1.3
OFF_POLICY_THRESHOLD = 0.1


# ---------------------------------------------------------------------------------------------------
# TRL side
# ---------------------------------------------------------------------------------------------------
class _RecordingAccelerator(AcceleratorStandIn):
    """Rank 1 of two processes: records what it contributes to each collective, in call order (the
    values it logs itself are discarded)."""

    def __init__(self):
        super().__init__(num_processes=2)
        self.sent = []

    def gather(self, x):
        self.sent.append(x.detach().clone())
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        self.sent.append(x.detach().clone())
        return x


class _ReplayAccelerator(AcceleratorStandIn):
    """Rank 0 of two processes: each collective combines this rank's tensor with what rank 1 sent to
    the same call (accelerate: reduce sums; gather concatenates along dim 0, a 0-d tensor as one row)."""

    def __init__(self, sent):
        super().__init__(num_processes=2)
        self.sent = iter(sent)

    def gather(self, x):
        return torch.cat([torch.atleast_1d(x), torch.atleast_1d(next(self.sent)).to(x)])

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x + next(self.sent).to(x)


def trl_case(loss_type, **overrides) -> dict:
    """The TRL settings of one case (GRPOConfig names where there is one)."""
    case = dict(
        loss_type=loss_type,
        importance_sampling_level="token",
        beta=0.0,
        use_bias_correction_kl=True,
        delta=None,
        epsilon=EPSILON,
        epsilon_high=CISPO_CAP if loss_type == "cispo" else EPSILON_HIGH,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        grad_accum=1,
        steps_per_generation=None,
        num_processes=1,
        vllm_mode=None,
        clip_min=None,
        clip_max=IS_CLIP_MAX,
        off_policy_mask_threshold=None,
        top_entropy_quantile=1.0,
        entropy_coef=0.0,
        training=True,
        advantages="seq",
        items_elsewhere=None,  # valid tokens of the generation batch outside this slice; None: see below
    )
    case.update(overrides)
    if case["steps_per_generation"] is None:  # GRPOConfig default: steps_per_generation = GA
        case["steps_per_generation"] = case["grad_accum"]
    return case


def trl_trainer(case: dict, per_token_logps, entropies, accelerator=None):
    """A stand-in for `self` with exactly the attributes `_compute_loss` reads."""
    args = types.SimpleNamespace(
        delta=case["delta"],
        use_bias_correction_kl=case["use_bias_correction_kl"],
        sapo_temperature_pos=case["sapo_temperature_pos"],
        sapo_temperature_neg=case["sapo_temperature_neg"],
        steps_per_generation=case["steps_per_generation"],
        entropy_target=0.2,
        vespo_k_pos=2.0,
        vespo_lambda_pos=3.0,
        vespo_k_neg=3.0,
        vespo_lambda_neg=2.0,
    )
    trainer = types.SimpleNamespace(
        args=args,
        loss_type=case["loss_type"],
        beta=case["beta"],
        epsilon_low=case["epsilon"],
        epsilon_high=case["epsilon_high"],
        importance_sampling_level=case["importance_sampling_level"],
        top_entropy_quantile=case["top_entropy_quantile"],
        off_policy_mask_threshold=case["off_policy_mask_threshold"],
        use_vllm=case["vllm_mode"] is not None,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=case["vllm_mode"],
        vllm_importance_sampling_clip_min=case["clip_min"],
        vllm_importance_sampling_clip_max=case["clip_max"],
        max_completion_length=MAX_COMPLETION_LENGTH,
        current_gradient_accumulation_steps=case["grad_accum"],
        aux_loss_enabled=False,
        _entropy_bonus_enabled=case["entropy_coef"] != 0.0,
        entropy_coef=case["entropy_coef"],
        use_adaptive_entropy=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        model=types.SimpleNamespace(training=case["training"]),
        accelerator=accelerator or AcceleratorStandIn(case["num_processes"]),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (per_token_logps, entropies, None),
    )
    trainer.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, trainer)
    return trainer


def completion_and_tool_masks():
    """TRL's completion_mask (right padding; row EMPTY_ROW all zero) and a tool_mask that masks one
    tool-output token inside row HOLE[0]: mask = completion_mask * tool_mask = make_mask()."""
    completion_mask = make_mask(hole=None).int()
    tool_mask = torch.ones(B, T, dtype=torch.int32)
    tool_mask[HOLE] = 0
    return completion_mask, tool_mask


def num_items_in_batch(case) -> int:
    """Valid tokens of the whole generation batch: this slice plus steps_per_generation - 1 others
    (and those of the other processes), deliberately not a multiple of the local count; or this slice
    plus case["items_elsewhere"]."""
    local = int(make_mask().sum())
    if case["items_elsewhere"] is not None:
        return local + case["items_elsewhere"]
    return local * case["steps_per_generation"] * case["num_processes"] + 5


def run_trl(case: dict, x: dict, accelerator=None):
    lp, ent = leaf(x["logp"]), leaf(x["entropy"])
    completion_mask, tool_mask = completion_and_tool_masks()
    adv = x["adv_seq"] if case["advantages"] == "seq" else x["adv_tok"]
    inputs = dict(
        prompt_ids=torch.ones(B, 1, dtype=torch.long),
        prompt_mask=torch.ones(B, 1, dtype=torch.int32),
        completion_ids=torch.ones(B, T, dtype=torch.long),
        completion_mask=completion_mask,
        tool_mask=tool_mask,
        advantages=adv.double(),
        num_items_in_batch=torch.tensor(num_items_in_batch(case)),
        old_per_token_logps=x["old"].double(),
    )
    if case["beta"] != 0.0:
        inputs["ref_per_token_logps"] = x["ref"].double()
    if case["vllm_mode"] is not None:
        inputs["sampling_per_token_logps"] = x["rollout"].double()
        inputs["importance_sampling_ratio"] = trl_vllm_is_ratio(
            x["old"].double(),
            x["rollout"].double(),
            completion_mask * tool_mask,
            case["vllm_mode"],
            case["clip_min"],
            case["clip_max"],
        )
    trainer = trl_trainer(case, lp, ent, accelerator)
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    mode = "train" if case["training"] else "eval"
    metrics = {k: v for k, v in trainer._metrics[mode].items()}
    assert all(len(v) == 1 for v in metrics.values()), metrics
    metrics = {k: v[0] for k, v in metrics.items()}
    if case["vllm_mode"] in ("token_truncate", "token_mask") and case["loss_type"] != "vespo":
        metrics.update(
            trl_vllm_is_ratio_metrics(inputs["importance_sampling_ratio"], completion_mask * tool_mask)
        )
    return loss.detach(), metrics, lp.grad, ent.grad


def trl_vllm_is_ratio_metrics(ratio, mask):
    """The IS-ratio statistics _generate_and_score_completions logs for token-level modes
    (grpo_trainer.py:2874-2896; one process). At sequence level TRL takes them over the B rows, an
    all-masked row's ratio 1 included, and its mean is per row where ours is per token: not compared.
    vespo: ours applies no IS weight to the loss (it folds the ratio into phi), so its is_weight
    statistics are those of a weight 1, not comparable either."""
    flat = ratio[mask.bool()]
    prefix = "sampling/importance_sampling_ratio/"
    return {
        prefix + "min": flat.min().item(),
        prefix + "mean": flat.mean().item(),
        prefix + "max": flat.max().item(),
    }


# ---------------------------------------------------------------------------------------------------
# Our side: configured and logged by the TRL adapter's functions, on a stand-in of the same settings
# ---------------------------------------------------------------------------------------------------
def run_ours(case: dict, x: dict, accelerator=None):
    trainer = trl_trainer(case, None, None, accelerator)
    lp, ent = leaf(x["logp"], torch.float32), leaf(x["entropy"], torch.float32)
    adv = x["adv_seq"] if case["advantages"] == "seq" else x["adv_tok"]
    out = gk.grpo_loss(
        lp,
        adv,
        x["mask"],
        old_logprobs=x["old"],
        ref_logprobs=x["ref"] if case["beta"] != 0.0 else None,
        rollout_logprobs=x["rollout"] if case["vllm_mode"] is not None else None,
        entropy=ent,
        config=gk_trl.policy_loss_config(trainer),
        backend="torch",
        **gk_trl.loss_normalizers(trainer, B, torch.tensor(num_items_in_batch(case))),
    )
    out.loss.backward()
    gk_trl.log_trl_metrics(trainer, out.metrics, x["mask"])
    mode = "train" if case["training"] else "eval"
    logged = trainer._metrics[mode]
    assert all(len(v) == 1 for v in logged.values()), logged
    metrics = {k: v[0] for k, v in logged.items()}
    if case["vllm_mode"] in ("token_truncate", "token_mask") and case["loss_type"] != "vespo":
        for stat in ("min", "mean", "max"):  # TRL logs these at generation time (trl_vllm_is_ratio_metrics)
            metrics[f"sampling/importance_sampling_ratio/{stat}"] = out.metrics[f"is_weight/{stat}"].item()
    return out, metrics, lp.grad, ent.grad


def check(case: dict, x: dict | None = None) -> None:
    x = make_token_inputs(SEED) if x is None else x
    compare(case, run_trl(case, x), run_ours(case, x))


def check_two_processes(case: dict) -> None:
    """Rank 0 of two processes whose batches differ (seeds SEED, SEED + 1): rank 1 runs first and
    records what it sends to every collective; rank 0 replays it (each side replays its own)."""
    x0, x1 = make_token_inputs(SEED), make_token_inputs(SEED + 1)
    sent_by_trl, sent_by_ours = _RecordingAccelerator(), _RecordingAccelerator()
    run_trl(case, x1, sent_by_trl)
    run_ours(case, x1, sent_by_ours)
    theirs = run_trl(case, x0, _ReplayAccelerator(sent_by_trl.sent))
    ours = run_ours(case, x0, _ReplayAccelerator(sent_by_ours.sent))
    compare(case, theirs, ours)


def compare(case: dict, theirs, ours) -> None:
    loss_t, metrics_t, grad_t, grad_ent_t = theirs
    out, metrics_o, grad_o, grad_ent_o = ours
    ctx = "trl " + " ".join(f"{k}={v}" for k, v in case.items() if v != trl_case(case["loss_type"]).get(k))
    ctx = f"{ctx} [{case['loss_type']}]"
    assert_close(f"{ctx} loss", out.loss, loss_t)
    assert_close(f"{ctx} dloss/dlogp", grad_o, grad_t, scale=grad_scale(grad_t))
    if grad_ent_t is None:  # entropy only selects tokens (or is only logged): no gradient on either side
        assert grad_ent_o is None or not grad_ent_o.any(), f"{ctx}: ours has an entropy gradient, TRL none"
    else:
        assert_close(f"{ctx} dloss/dentropy", grad_ent_o, grad_ent_t, scale=grad_scale(grad_ent_t))
    assert set(metrics_o) == set(metrics_t), (
        f"{ctx}: logged metrics differ: only TRL {sorted(set(metrics_t) - set(metrics_o))}, "
        f"only ours {sorted(set(metrics_o) - set(metrics_t))}"
    )
    for name, value in metrics_t.items():
        assert_close(f"{ctx} metric {name}", metrics_o[name], value, equal_nan=True)


@pytest.fixture(scope="module")
def inputs():
    return make_token_inputs(SEED)


def test_inputs_visit_every_regime(inputs):
    x, m = inputs, inputs["mask"]
    lr = x["logp"] - x["old"]
    r, a = lr.exp()[m], x["adv_seq"][:, None].expand(B, T)[m]
    assert ((r < 1 - EPSILON) & (a < 0)).any() and ((r > 1 + EPSILON_HIGH) & (a > 0)).any()
    assert ((r > CISPO_CAP) & (a > 0)).any() and ((r < CISPO_CAP) & (a > 0)).any()
    assert ((r > 1.6) & (a > 0)).any(), "delta=1.6 never binds"
    seq_r = ((lr * m).sum(1) / m.sum(1).clamp(min=1)).exp()
    assert ((seq_r < 1 - EPSILON) & (x["adv_seq"] < 0)).any() and (
        (seq_r > 1 + EPSILON_HIGH) & (x["adv_seq"] > 0)
    ).any()
    mask = m.double()
    for mode in ("token_mask", "sequence_mask"):  # no bounds: the raw ratio
        rho = trl_vllm_is_ratio(x["old"].double(), x["rollout"].double(), mask, mode, None, None)
        rho = rho[m] if mode.startswith("token") else rho[m.any(1)]
        assert (rho < IS_CLIP_MIN).any() and (rho > IS_CLIP_MAX).any(), f"{mode}: IS clip bounds never hit"
        assert ((rho > IS_CLIP_MIN) & (rho < IS_CLIP_MAX)).any()
    seq_kl = ((x["old"] - x["logp"]) * m).sum(1) / m.sum(1).clamp(min=1)
    negative = (x["adv_seq"] < 0) & m.any(1)
    assert (seq_kl[negative] > OFF_POLICY_THRESHOLD).any() and (
        seq_kl[negative] <= OFF_POLICY_THRESHOLD
    ).any()
    assert not m[EMPTY_ROW].any()


def _loss_type_cases():
    for lt in LOSS_TYPES:
        for level in ("token", "sequence"):
            if lt == "vespo" and level == "sequence":
                continue  # TRL warns: vespo is defined on token log-ratios (and so is ours)
            for ga in (1, 2):
                yield pytest.param(lt, level, ga, id=f"{lt}-{level}-GA{ga}")


@pytest.mark.parametrize(("loss_type", "level", "grad_accum"), list(_loss_type_cases()))
def test_loss_type_matches_trl(loss_type, level, grad_accum, inputs):
    """Every loss_type x importance_sampling_level x GA, with the (default) bias-corrected k3 KL."""
    check(trl_case(loss_type, importance_sampling_level=level, grad_accum=grad_accum, beta=0.04), inputs)


@pytest.mark.parametrize("bias_correction", [False, True], ids=["plain-kl", "bias-corrected-kl"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_kl_matches_trl(loss_type, level, bias_correction, inputs):
    check(
        trl_case(
            loss_type, importance_sampling_level=level, beta=0.1, use_bias_correction_kl=bias_correction
        ),
        inputs,
    )


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
def test_delta_matches_trl(loss_type, level, inputs):
    """INTELLECT-2 two-sided clipping: the unclipped ratio is capped at delta (after coef_2 is built,
    and after the bias-corrected KL took the uncapped ratio)."""
    check(trl_case(loss_type, importance_sampling_level=level, delta=1.6, beta=0.04), inputs)


def _vllm_cases():
    for loss_type in ("dapo", "grpo", "vespo"):
        for vllm_mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
            if loss_type == "vespo" and vllm_mode.startswith("sequence"):
                continue  # TRL's __init__ refuses it (grpo_trainer.py:936-940), and so does our config
            for clip_min in (None, IS_CLIP_MIN):
                yield pytest.param(
                    loss_type, vllm_mode, clip_min, id=f"{loss_type}-{vllm_mode}-min{clip_min}"
                )


@pytest.mark.parametrize(("loss_type", "vllm_mode", "clip_min"), list(_vllm_cases()))
def test_vllm_importance_sampling_matches_trl(loss_type, vllm_mode, clip_min, inputs):
    """TIS / MIS at token and sequence level; vespo folds the token-level ratio into phi instead."""
    check(trl_case(loss_type, vllm_mode=vllm_mode, clip_min=clip_min, beta=0.04), inputs)


@pytest.mark.parametrize("with_vllm", [False, True], ids=["old-logps", "sampling-logps"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_off_policy_mask_matches_trl(loss_type, with_vllm, inputs):
    """DeepSeek-V3.2 off-policy sequence masking; with vLLM it measures the KL to the sampler."""
    case = trl_case(
        loss_type,
        off_policy_mask_threshold=OFF_POLICY_THRESHOLD,
        beta=0.04,
        vllm_mode="token_truncate" if with_vllm else None,
    )
    check(case, inputs)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05], ids=["no-bonus", "bonus"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_top_entropy_quantile_matches_trl(loss_type, entropy_coef, inputs):
    """Only tokens whose entropy is in the top 40% train; the entropy bonus acts on the same tokens."""
    check(trl_case(loss_type, top_entropy_quantile=0.4, entropy_coef=entropy_coef, grad_accum=2), inputs)


@pytest.mark.parametrize("grad_accum", [1, 2], ids=["GA1", "GA2"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_entropy_bonus_matches_trl(loss_type, grad_accum, inputs):
    """entropy_coef: a token mean over the batch / GA, whatever the policy normalizer (plus TRL's
    policy_loss metric: the loss before the bonus)."""
    check(trl_case(loss_type, entropy_coef=0.05, grad_accum=grad_accum, beta=0.04), inputs)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "luspo"])
def test_per_token_advantages_match_trl(loss_type, inputs):
    """Advantages [B, T] (a subclass's per-token advantages; TRL keeps them as they are)."""
    check(trl_case(loss_type, advantages="token", beta=0.04, grad_accum=2), inputs)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_eval_mode_matches_trl(loss_type, inputs):
    """model.training False: no GA division and the dapo normalizer without GA / steps_per_generation."""
    check(
        trl_case(
            loss_type, training=False, grad_accum=2, steps_per_generation=4, beta=0.04, entropy_coef=0.05
        ),
        inputs,
    )


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_generation_batch_normalizer_matches_trl(loss_type, inputs):
    """num_items_in_batch over 4 slices x 2 processes, GA 2: num_tokens = N GA / spg, dp_size 2."""
    check(trl_case(loss_type, grad_accum=2, steps_per_generation=4, num_processes=2, beta=0.04), inputs)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_rescaled_normalizer_below_the_local_count_matches_trl(loss_type, inputs):
    """GA 3 of steps_per_generation 4, this slice holding nearly all of the generation batch's tokens: TRL's
    window estimate num_items GA / spg falls below this call's own count and is used as it is (TRL's own
    test_prepare_input_called_with_correct_data trains with these settings)."""
    case = trl_case(loss_type, grad_accum=3, steps_per_generation=4, items_elsewhere=2)
    local = int(make_mask().sum())
    assert num_items_in_batch(case) * 3 / 4 < local  # the regime this case is for
    check(case, inputs)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_everything_on_matches_trl(loss_type, inputs):
    """All of the above at once, in TRL's order (off-policy mask, entropy mask, IS ratio, then KL)."""
    case = trl_case(
        loss_type,
        beta=0.04,
        delta=1.6,
        grad_accum=2,
        steps_per_generation=4,
        vllm_mode="token_mask",
        clip_min=IS_CLIP_MIN,
        off_policy_mask_threshold=OFF_POLICY_THRESHOLD,
        top_entropy_quantile=0.6,
        entropy_coef=0.05,
        advantages="token",
    )
    check(case, inputs)


TWO_PROCESS_CASES = [
    pytest.param(lt, level, id=f"{lt}-{level}")
    for lt in LOSS_TYPES
    for level in ("token", "sequence")
    if not (lt == "vespo" and level == "sequence")  # vespo is defined on token log-ratios
]


@pytest.mark.parametrize(("loss_type", "level"), TWO_PROCESS_CASES)
def test_two_processes_match_trl(loss_type, level, inputs):
    """num_processes=2: the dapo / cispo / vespo normalizer and every logged metric reduced across the
    two ranks as TRL reduces them (token-weighted global means, gathered min / max, gathered
    nanmean of policy_loss). top_entropy_quantile, whose quantile TRL takes across ranks with real
    collectives, is test_top_entropy_quantile_over_processes_matches_trl."""
    check_two_processes(
        trl_case(
            loss_type,
            importance_sampling_level=level,
            num_processes=2,
            grad_accum=2,
            beta=0.04,
            entropy_coef=0.05,
        )
    )


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_top_entropy_quantile_over_processes_matches_trl(world):
    """top_entropy_quantile < 1 on `world` spawned gloo processes, each with its own batch: TRL gathers every
    process's entropies for the quantile (get_high_entropy_mask); the adapter passes the default process
    group as entropy_group, and the loss, both gradients and every logged metric equal TRL's on every rank."""
    import _distributed_workers as workers

    from grpo_kernels.testing.distributed import run_group

    for rank, report in enumerate(run_group(workers.trl_entropy_quantile_worker, world)):
        for loss_type, result in report.items():
            assert result == "ok", f"rank {rank} of {world}, {loss_type}: {result}"
