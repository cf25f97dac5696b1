"""Parity of grpo_kernels.advantages with the peers' own code: verl 0.9.1 and TRL 1.16.

verl's estimators are imported and called on the same inputs. TRL computes GRPO's and RLOO's advantages
inline in ``_generate_and_score_completions``; calling that method needs a model and a generation backend,
so these tests take the exact source lines of that method from the installed TRL (``inspect``), check that
they are the 1.16 lines this test was written against, and execute them on the same inputs. The file:line
of each block is printed in the failure message. Every test is skipped, with the reason, when the peer is
not importable.

Grid rationale: 5 groups of 3 rows plus 3 groups of 5 rows (odd sizes; TRL requires equal group sizes, so
the TRL cases use groups of 5), response lengths 1..9 over T = 9, float64 where the peer keeps the dtype
(compared at 1e-10) and float32 where the peer casts to float32 (compared at 1e-6 relative).
"""

from __future__ import annotations

import inspect
import textwrap
import types

import pytest
import torch

from grpo_kernels.advantages import dapo_overlong_penalty, estimate, kl_penalized_token_rewards

np = pytest.importorskip("numpy", reason="numpy is needed to build verl's index arrays")

pytestmark = pytest.mark.parity

F64 = torch.float64


def assert_close(name, out, expected, atol=1e-10, rtol=1e-10):
    """Elementwise |out - expected| <= atol + rtol |expected|; the message shows the worst element."""
    out = torch.as_tensor(out).detach().to(F64).cpu()
    expected = (
        (expected if isinstance(expected, torch.Tensor) else torch.tensor(expected, dtype=F64))
        .detach()
        .to(F64)
        .cpu()
    )
    assert out.shape == expected.shape, (
        f"{name}: shape {tuple(out.shape)} != expected {tuple(expected.shape)}"
    )
    excess = (out - expected).abs() - (atol + rtol * expected.abs())
    excess = torch.where(
        torch.isnan(out) | torch.isnan(expected), torch.full_like(excess, float("inf")), excess
    )
    if bool((excess > 0).any()):
        flat = int(excess.flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), out.shape))
        raise AssertionError(
            f"{name}: worst element {list(idx)}: ours {out[idx].item()!r}, peer {expected[idx].item()!r} "
            f"(|diff| {abs(out[idx].item() - expected[idx].item()):.3e}); "
            f"{int((excess > 0).sum())} of {out.numel()} elements out of tolerance"
        )


def make_batch(seed: int, dtype=F64, group_sizes=(3, 3, 3, 3, 3, 5, 5, 5), binary=False, max_len=9):
    """rewards [B], group_index [B], response mask [B, T] (left-aligned, lengths 1..T), verl uid array."""
    gen = torch.Generator().manual_seed(seed)
    group_index = torch.cat([torch.full((n,), g) for g, n in enumerate(group_sizes)])
    batch = group_index.numel()
    if binary:
        rewards = torch.randint(0, 2, (batch,), generator=gen).to(dtype)
    else:
        rewards = torch.randn(batch, generator=gen, dtype=F64).to(dtype)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    uids = np.array([f"uid-{int(g)}" for g in group_index], dtype=object)
    return rewards, group_index, mask, uids


def score_at_last_token(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's token_level_rewards for outcome rewards: the score at the last valid response token."""
    token_rewards = torch.zeros(mask.shape, dtype=rewards.dtype)
    last = mask.sum(-1) - 1
    token_rewards[torch.arange(mask.shape[0]), last] = rewards
    return token_rewards


def broadcast(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values[:, None] * mask.to(values.dtype)


# Verl 0.9.1


@pytest.fixture(scope="module")
def verl_algos():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not importable")
    import verl

    if not verl.__version__.startswith("0.9.1"):
        pytest.skip(f"parity is pinned to verl 0.9.1, found {verl.__version__}")
    return core_algos


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_verl(verl_algos, seed, norm_by_std):
    rewards, group_index, mask, uids = make_batch(seed)
    theirs, _ = verl_algos.compute_grpo_outcome_advantage(
        score_at_last_token(rewards, mask),
        mask.to(F64),
        uids,
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=norm_by_std,
    )
    ours = estimate("grpo", rewards, group_index, scale="group" if norm_by_std else "none", epsilon=1e-6)
    assert_close("grpo vs verl", broadcast(ours, mask), theirs)
    if not norm_by_std:
        assert_close("dr_grpo vs verl", broadcast(estimate("dr_grpo", rewards, group_index), mask), theirs)


def test_grpo_matches_verl_vectorized(verl_algos):
    # verl's vectorized estimator computes group statistics in float32
    rewards, group_index, mask, uids = make_batch(2, dtype=torch.float32)
    theirs, _ = verl_algos.compute_grpo_vectorized_outcome_advantage(
        score_at_last_token(rewards, mask), mask.float(), uids, epsilon=1e-6
    )
    ours = estimate("grpo", rewards, group_index, epsilon=1e-6)
    assert_close("grpo vs verl vectorized", broadcast(ours, mask), theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("vectorized", [False, True])
def test_rloo_matches_verl(verl_algos, vectorized):
    rewards, group_index, mask, uids = make_batch(3)
    fn = (
        verl_algos.compute_rloo_vectorized_outcome_advantage
        if vectorized
        else verl_algos.compute_rloo_outcome_advantage
    )
    theirs, _ = fn(score_at_last_token(rewards, mask), mask.to(F64), uids)
    assert_close("rloo vs verl", broadcast(estimate("rloo", rewards, group_index), mask), theirs)


def test_opo_matches_verl(verl_algos):
    rewards, group_index, mask, uids = make_batch(4)
    theirs, _ = verl_algos.compute_opo_outcome_advantage(
        score_at_last_token(rewards, mask), mask.to(F64), uids
    )
    ours = estimate("opo", rewards, group_index, lengths=mask.sum(-1))
    assert_close("opo vs verl", broadcast(ours, mask), theirs)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_matches_verl(verl_algos, norm_by_std):
    rewards, group_index, mask, uids = make_batch(5)  # continuous rewards: no ties at the top
    theirs, _ = verl_algos.compute_grpo_passk_outcome_advantage(
        score_at_last_token(rewards, mask),
        mask.to(F64),
        uids,
        epsilon=1e-6,
        config={"norm_adv_by_std_in_grpo": norm_by_std},
    )
    ours = estimate("grpo_passk", rewards, group_index, normalize_by_std=norm_by_std, epsilon=1e-6)
    assert_close("passk vs verl", broadcast(ours, mask), theirs)


def test_reinforce_plus_plus_baseline_matches_verl(verl_algos):
    rewards, group_index, mask, uids = make_batch(6)
    theirs, _ = verl_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        score_at_last_token(rewards, mask), mask.to(F64), uids
    )
    ours = estimate("reinforce_plus_plus_baseline", rewards, group_index, mask=mask)
    # verl's masked_mean divides by (token count + 1e-8): a relative difference of ~1e-8 / 50 tokens
    assert_close("rf++ baseline vs verl", broadcast(ours, mask), theirs, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("kl_penalty", ["kl", "abs", "mse", "low_var_kl", "k3"])
def test_kl_in_reward_matches_verl(verl_algos, kl_penalty):
    rewards, _, mask, _ = make_batch(7)
    gen = torch.Generator().manual_seed(70)
    logp = -torch.rand(mask.shape, generator=gen, dtype=F64) * 3
    ref = -torch.rand(mask.shape, generator=gen, dtype=F64) * 3
    beta = 0.05
    # verl/trainer/ppo/ray_trainer.py:100-106 (apply_kl_penalty; the module itself needs ray's extras):
    #     kld = core_algos.kl_penalty(old_log_probs, ref_log_prob, kl_penalty=kl_penalty)
    #     kld = kld * response_mask
    #     token_level_rewards = token_level_scores - beta * kld
    kld = verl_algos.kl_penalty(logp, ref, kl_penalty=kl_penalty) * mask.to(F64)
    theirs = score_at_last_token(rewards, mask) - beta * kld
    ours_name = {"kl": "k1", "mse": "k2"}.get(kl_penalty, kl_penalty)
    ours = kl_penalized_token_rewards(rewards, mask, logp, ref, kl_coef=beta, kl_estimator=ours_name)
    assert_close(f"kl fold {kl_penalty} vs verl", ours, theirs)


@pytest.mark.parametrize(("gamma", "beta"), [(1.0, 0.0), (0.9, 0.05)])
def test_reinforce_plus_plus_matches_verl(verl_algos, gamma, beta):
    from verl.trainer.config import AlgoConfig

    rewards, group_index, mask, _ = make_batch(8)
    gen = torch.Generator().manual_seed(80)
    logp = -torch.rand(mask.shape, generator=gen, dtype=F64) * 3
    ref = -torch.rand(mask.shape, generator=gen, dtype=F64) * 3
    # token_level_rewards as verl's apply_kl_penalty builds them (ray_trainer.py:100-106), k1 ("kl")
    token_level_rewards = (
        score_at_last_token(rewards, mask) - beta * verl_algos.kl_penalty(logp, ref, "kl") * mask
    )
    theirs, _ = verl_algos.compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards, mask.to(F64), config=AlgoConfig(gamma=gamma)
    )
    ours = estimate(
        "reinforce_plus_plus",
        rewards,
        group_index,
        mask=mask,
        gamma=gamma,
        kl_coef=beta,
        logprobs=logp,
        ref_logprobs=ref,
    )
    assert_close("reinforce++ vs verl", ours, theirs, atol=1e-9, rtol=1e-9)


def test_gpg_matches_verl(verl_algos):
    rewards, group_index, mask, uids = make_batch(9, binary=True)
    theirs, _ = verl_algos.compute_gpg_outcome_advantage(
        score_at_last_token(rewards, mask), mask.to(F64), uids, f_norm=1.5
    )
    ours = estimate("gpg", rewards, group_index, alpha_mode="nonzero_rewards", f_norm=1.5)
    assert_close("gpg vs verl", broadcast(ours, mask), theirs)


def test_gdpo_matches_verl(verl_algos):
    rewards, group_index, mask, uids = make_batch(10)
    gen = torch.Generator().manual_seed(100)
    second = torch.rand(rewards.shape, generator=gen, dtype=F64) * 4
    prompt_len = 3
    batch = {
        "prompts": torch.zeros(rewards.shape[0], prompt_len, dtype=torch.long),
        "attention_mask": torch.cat(
            [torch.ones(rewards.shape[0], prompt_len, dtype=torch.long), mask.long()], -1
        ),
    }
    # verl builds float32 score tensors from these arrays (np.float32), so compare at float32 rounding
    non_tensor = {"acc": rewards.numpy().astype(np.float32), "fmt": second.numpy().astype(np.float32)}
    config = {"gdpo_reward_keys": ["acc", "fmt"], "gdpo_reward_weights": [1.0, 0.5]}
    theirs, _ = verl_algos.compute_gdpo_outcome_advantage(
        torch.zeros(mask.shape),
        mask.float(),
        uids,
        epsilon=1e-6,
        config=config,
        non_tensor_batch=non_tensor,
        batch=batch,
    )
    stacked = torch.stack([rewards, second], -1).float()
    ours = estimate(
        "gdpo", stacked, group_index, weights=[1.0, 0.5], epsilon=1e-6, batch_normalization="token", mask=mask
    )
    assert_close("gdpo vs verl", broadcast(ours, mask), theirs, atol=1e-6, rtol=1e-5)


# TRL 1.16


def trl_source_block(method, first_line: str, last_line: str) -> tuple[str, str]:
    """The dedented source of ``method`` from the line starting with ``first_line`` through ``last_line``,
    and its "file:line-line" citation."""
    lines, start = inspect.getsourcelines(method)
    stripped = [line.strip() for line in lines]
    try:
        begin = stripped.index(first_line)
        end = stripped.index(last_line, begin)
    except ValueError:
        pytest.fail(
            f"TRL 1.16 source of {method.__qualname__} no longer contains the block "
            f"{first_line!r}..{last_line!r}"
        )
    where = f"{inspect.getsourcefile(method)}:{start + begin}-{start + end}"
    return textwrap.dedent("".join(lines[begin : end + 1])), where


@pytest.fixture(scope="module")
def trl_modules():
    trl = pytest.importorskip("trl", reason="trl is not importable")
    if trl.__version__ != "1.16.0":
        pytest.skip(f"parity is pinned to trl 1.16.0, found {trl.__version__}")
    grpo_trainer = pytest.importorskip(
        "trl.trainer.grpo_trainer", reason="trl.trainer.grpo_trainer is not importable"
    )
    rloo_trainer = pytest.importorskip(
        "trl.trainer.rloo_trainer", reason="trl.trainer.rloo_trainer is not importable"
    )
    from trl.trainer.utils import nanstd

    return types.SimpleNamespace(grpo=grpo_trainer, rloo=rloo_trainer, nanstd=nanstd)


# trl.trainer.utils.nanstd computes the Bessel factor count / (count - 1) from int64 counts, which gives a
# float32 tensor: for a count that makes it inexact (e.g. 20/19), float64 results carry a float32 rounding
# error of the factor (relative ~6e-8 in the variance). Comparisons whose std runs over such counts use this
# tolerance, the float32 rounding level; counts of 5 (factor 1.25, exact) are compared at 1e-12.
TRL_FP32_BESSEL_RTOL = 1e-7


def run_trl_grpo_advantages(
    trl_modules, rewards_per_func, num_generations, scale_rewards, aggregation, weights
):
    """Execute TRL 1.16 GRPOTrainer._generate_and_score_completions' advantage lines on the given rewards."""
    code, where = trl_source_block(
        trl_modules.grpo.GRPOTrainer._generate_and_score_completions,
        'if self.multi_objective_aggregation == "sum_then_normalize":',
        "advantages = torch.nan_to_num(advantages, nan=0.0)",
    )
    trainer = types.SimpleNamespace(
        multi_objective_aggregation=aggregation,
        scale_rewards=scale_rewards,
        reward_weights=torch.tensor(weights, dtype=rewards_per_func.dtype),
        reward_funcs=[None] * rewards_per_func.shape[1],
    )
    scope = {
        "self": trainer,
        "torch": torch,
        "nanstd": trl_modules.nanstd,
        "device": rewards_per_func.device,
        "rewards_per_func": rewards_per_func,
        "num_generations": num_generations,
        "unscorable_mask": torch.isnan(rewards_per_func).all(dim=1),
    }
    exec(compile(code, where, "exec"), scope)  # noqa: S102 - TRL's own lines, see the module docstring
    return scope["advantages"], where


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_scale_rewards_matches_trl(trl_modules, scale_rewards, dtype):
    rewards, group_index, _, _ = make_batch(11, dtype=dtype, group_sizes=(5, 5, 5, 5))
    theirs, where = run_trl_grpo_advantages(
        trl_modules, rewards[:, None], 5, scale_rewards, "sum_then_normalize", [1.0]
    )
    ours = estimate("grpo", rewards, group_index, scale=scale_rewards, epsilon=1e-4)
    if dtype == torch.float32:
        tol = 1e-6
    else:
        tol = TRL_FP32_BESSEL_RTOL if scale_rewards == "batch" else 1e-12
    assert_close(f"grpo scale={scale_rewards} vs TRL {where}", ours, theirs, atol=tol, rtol=tol)
    if scale_rewards == "batch":
        assert_close(
            f"lite_ppo vs TRL {where}", estimate("lite_ppo", rewards, group_index), theirs, atol=tol, rtol=tol
        )
    if scale_rewards == "none":
        assert_close(
            f"dr_grpo vs TRL {where}", estimate("dr_grpo", rewards, group_index), theirs, atol=tol, rtol=tol
        )


def test_sum_then_normalize_with_weights_matches_trl(trl_modules):
    rewards, group_index, _, _ = make_batch(12, group_sizes=(5, 5, 5))
    gen = torch.Generator().manual_seed(120)
    per_func = torch.stack([rewards, torch.rand(rewards.shape, generator=gen, dtype=F64)], -1)
    theirs, where = run_trl_grpo_advantages(
        trl_modules, per_func, 5, "group", "sum_then_normalize", [1.0, 0.3]
    )
    ours = estimate("grpo", per_func @ torch.tensor([1.0, 0.3], dtype=F64), group_index)
    assert_close(f"weighted sum_then_normalize vs TRL {where}", ours, theirs, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [0.5, 2.0, 1.0]])
def test_normalize_then_sum_matches_trl(trl_modules, weights):
    rewards, group_index, _, _ = make_batch(13, group_sizes=(5, 5, 5, 5, 5))
    gen = torch.Generator().manual_seed(130)
    per_func = torch.stack(
        [
            rewards,
            torch.rand(rewards.shape, generator=gen, dtype=F64) * 10,
            torch.randint(0, 2, rewards.shape, generator=gen).to(F64),
        ],
        -1,
    )
    theirs, where = run_trl_grpo_advantages(trl_modules, per_func, 5, "group", "normalize_then_sum", weights)
    ours = estimate("gdpo", per_func, group_index, weights=torch.tensor(weights), epsilon=1e-4)
    # the batch stage's std runs over 25 rows (factor 25/24 in float32 inside TRL's nanstd)
    assert_close(
        f"gdpo vs TRL normalize_then_sum {where}",
        ours,
        theirs,
        atol=TRL_FP32_BESSEL_RTOL,
        rtol=TRL_FP32_BESSEL_RTOL,
    )


def test_rloo_matches_trl(trl_modules):
    rewards, group_index, _, _ = make_batch(14, group_sizes=(5, 5, 5))
    code, where = trl_source_block(
        trl_modules.rloo.RLOOTrainer._generate_and_score_completions,
        "grouped_rewards = rewards.view(-1, num_generations)",
        "advantages = torch.nan_to_num(advantages, nan=0.0)",
    )
    scope = {
        "self": types.SimpleNamespace(normalize_advantages=False),
        "torch": torch,
        "nanstd": trl_modules.nanstd,
        "rewards": rewards.clone(),
        "num_generations": 5,
    }
    exec(compile(code, where, "exec"), scope)  # noqa: S102 - TRL's own lines, see the module docstring
    assert_close(
        f"rloo vs TRL RLOOTrainer {where}", estimate("rloo", rewards, group_index), scope["advantages"]
    )


def test_dapo_overlong_penalty_matches_trl():
    rewards_mod = pytest.importorskip("trl.rewards", reason="trl is not importable")
    punish = rewards_mod.get_soft_overlong_punishment(max_completion_len=50, soft_punish_cache=13)
    lengths = list(range(60)) + [37, 38, 49, 50, 51]
    theirs = punish([[0] * n for n in lengths])
    ours = dapo_overlong_penalty(torch.tensor(lengths, dtype=F64), max_length=50, cache_length=13)
    assert_close("overlong vs TRL get_soft_overlong_punishment", ours, theirs, atol=1e-15)


def test_dapo_overlong_penalty_matches_verl_reward_manager():
    pytest.importorskip("verl", reason="verl is not importable")
    max_len, buffer_len, factor = 40, 7, 1.0
    lengths = list(range(1, max_len + 1))
    # verl/experimental/reward_loop/reward_manager/dapo.py:108-114 (DAPO reward manager, overlong_buffer):
    #     expected_len = self.max_resp_len - overlong_buffer_len
    #     exceed_len = valid_response_length - expected_len
    #     overlong_reward = min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)
    theirs = [min(-(n - (max_len - buffer_len)) / buffer_len * factor, 0) for n in lengths]
    ours = dapo_overlong_penalty(
        torch.tensor(lengths, dtype=F64), max_length=max_len, cache_length=buffer_len
    )
    assert_close("overlong vs verl reward manager", ours, theirs, atol=1e-15)
