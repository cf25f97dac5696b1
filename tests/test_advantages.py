"""grpo_kernels.advantages: hand-computed cases, properties, bad input, and the README table.

Grid rationale: one batch of 7 rows in groups of 3, 3 and 1 (odd sizes, a ragged batch, a singleton) in
float64, so expected values written out from the formulas can be compared at 1e-10. Per-token cases use
T = 4 or 5 with at least one row shorter than T. Expected values are derived by hand from each paper's
formula (written as arithmetic here), never by calling the code under test.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.advantages import estimate
from grpo_kernels.advantages.__main__ import END, START, replace_table
from grpo_kernels.advantages.shaping import DIVER_BLEU_WEIGHTS, sentence_bleu

A = gk.advantages
F64 = torch.float64

# rows:        group 0        group 1           group 2
REWARDS = [1.0, 0.0, 1.0, 0.5, 0.0, 2.0, 3.0]
GROUPS = [0, 0, 0, 1, 1, 1, 2]
LENGTHS = [2, 3, 1, 4, 2, 3, 5]
MU0, SD0 = 2 / 3, math.sqrt(1 / 3)
MU1 = 2.5 / 3
SD1 = math.sqrt(((0.5 - MU1) ** 2 + MU1**2 + (2 - MU1) ** 2) / 2)
MEAN_ALL = sum(REWARDS) / 7
SD_ALL = math.sqrt(sum((r - MEAN_ALL) ** 2 for r in REWARDS) / 6)


def rewards64(values=REWARDS):
    return torch.tensor(values, dtype=F64)


def groups(values=GROUPS):
    return torch.tensor(values, dtype=torch.long)


def assert_close(name, out, expected, atol=1e-10, rtol=1e-10):
    """Elementwise |out - expected| <= atol + rtol |expected|; the message shows the worst element."""
    out = torch.as_tensor(out).detach().to(F64).cpu()
    expected = torch.as_tensor(expected, dtype=F64).cpu()
    assert out.shape == expected.shape, (
        f"{name}: shape {tuple(out.shape)} != expected {tuple(expected.shape)}"
    )
    excess = (out - expected).abs() - (atol + rtol * expected.abs())
    excess = torch.where(
        torch.isnan(out) | torch.isnan(expected), torch.full_like(excess, float("inf")), excess
    )
    if bool((excess > 0).any()):
        flat = int(excess.flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), out.shape)) if out.ndim else ()
        raise AssertionError(
            f"{name}: worst element {list(idx)}: got {out[idx].item()!r}, expected {expected[idx].item()!r} "
            f"(|diff| {abs(out[idx].item() - expected[idx].item()):.3e}); "
            f"{int((excess > 0).sum())} of {out.numel()} elements out of tolerance"
        )


def grpo_expected(epsilon, scale="group"):
    out = []
    for r, g in zip(REWARDS, GROUPS):
        mu, sd = {0: (MU0, SD0), 1: (MU1, SD1), 2: (3.0, 0.0)}[g]
        if scale == "none":
            out.append(r - mu)
        elif scale == "group":
            out.append((r - mu) / (sd + epsilon))
        else:
            out.append((r - mu) / (SD_ALL + epsilon))
    return out


# Registry

REQUIRED = [
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "lite_ppo",
    "opo",
    "grpo_passk",
    "gpg",
    "grpo_lead",
    "edge_grpo",
    "dcpo",
    "grpo_lambda_clamp",
    "mo_grpo",
    "gdpo",
    "mt_grpo",
    "gigpo",
    "gtpo",
    "grpo_s",
    "lambda_grpo",
    "process_supervision",
    "gfpo",
]


def test_registry_has_every_method():
    missing = sorted(set(REQUIRED) - set(A.available()))
    assert not missing, f"not registered: {missing}"


@pytest.mark.parametrize("name", REQUIRED)
def test_docstring_states_formula_paper_and_peer(name):
    spec = A.get(name)
    doc = spec.fn.__doc__ or ""
    for section in ("Formula", "Paper:", "Peer:"):
        assert section in doc, f"{name}: docstring lacks a {section!r} section"
    assert re.search(r"arXiv:\d{4}\.\d{5}", spec.paper), f"{name}: paper field {spec.paper!r} has no arXiv id"
    assert spec.output in ("[B]", "[B, T]")


def test_readme_table_matches_generator():
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()
    assert START in text and END in text, "README.md lacks the advantages-table markers"
    expected = replace_table(text, A.registry_table_markdown())
    assert text == expected, (
        "README.md table is stale; run `python -m grpo_kernels.advantages --write README.md`"
    )


def test_get_unknown_name_lists_available():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'.*grpo"):
        A.get("nope")


def test_unknown_option_is_rejected():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['epsilonn'\]"):
        estimate("grpo", rewards64(), groups(), epsilonn=1e-6)


def test_user_estimator_registration_and_conflict():
    name = "test_constant_shift"

    def shift(rewards, group_index, *, num_groups, offset: float = 0.0):
        """Reward minus a constant (test estimator)."""
        return rewards - offset

    A.register(name, output="[B]")(shift)
    A.register(name, output="[B]")(shift)  # the same function twice is a no-op
    assert_close(
        "user estimator", estimate(name, rewards64(), groups(), offset=1.0), [r - 1 for r in REWARDS]
    )
    assert A.get(name).summary == "Reward minus a constant (test estimator)."

    def other(rewards, group_index, *, num_groups):
        return rewards

    with pytest.raises(ValueError, match="already registered"):
        A.register(name)(other)
    with pytest.raises(ValueError, match="must accept a 'num_groups'"):
        A.register("test_bad_signature")(lambda rewards, group_index: rewards)


# Group-normalized family


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_hand(scale):
    eps = 1e-4
    assert_close(
        f"grpo[{scale}]",
        estimate("grpo", rewards64(), groups(), scale=scale, epsilon=eps),
        grpo_expected(eps, scale),
    )


def test_dr_grpo_and_lite_ppo_hand():
    assert_close("dr_grpo", estimate("dr_grpo", rewards64(), groups()), grpo_expected(0.0, "none"))
    assert_close("lite_ppo", estimate("lite_ppo", rewards64(), groups()), grpo_expected(1e-4, "batch"))


def test_rloo_hand():
    expected = [1 - 0.5, 0 - 1, 1 - 0.5, 0.5 - 1.0, 0 - 1.25, 2 - 0.25, 0.0]
    assert_close("rloo", estimate("rloo", rewards64(), groups()), expected)


def test_reinforce_plus_plus_baseline_hand():
    centered = [r - {0: MU0, 1: MU1, 2: 3.0}[g] for r, g in zip(REWARDS, GROUPS)]

    def whiten(weights):
        total = sum(weights)
        mean = sum(w * c for w, c in zip(weights, centered)) / total
        var = sum(w * (c - mean) ** 2 for w, c in zip(weights, centered)) / (total - 1)
        return [(c - mean) / math.sqrt(var + 1e-8) for c in centered]

    assert_close(
        "rf++ baseline (sequences)",
        estimate("reinforce_plus_plus_baseline", rewards64(), groups()),
        whiten([1] * 7),
    )
    mask = torch.zeros(7, 6, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    assert_close(
        "rf++ baseline (tokens)",
        estimate("reinforce_plus_plus_baseline", rewards64(), groups(), mask=mask),
        whiten(LENGTHS),
    )


def test_opo_hand():
    lengths = torch.tensor(LENGTHS)
    b0 = (2 * 1 + 3 * 0 + 1 * 1) / 6
    b1 = (4 * 0.5 + 2 * 0 + 3 * 2) / 9
    expected = [1 - b0, 0 - b0, 1 - b0, 0.5 - b1, 0 - b1, 2 - b1, 0.0]
    assert_close("opo", estimate("opo", rewards64(), groups(), lengths=lengths), expected)


def test_grpo_passk_hand():
    # group 0 ties at the top (1, 1): margin 0; group 1: best is row 5 (2.0) over 0.5.
    expected = [0, 0, 0, 0, 0, 1.5 / (SD1 + 1e-6), 0]
    assert_close("passk", estimate("grpo_passk", rewards64(), groups()), expected)
    expected_raw = [0, 0, 0, 0, 0, 1.5, 0]
    assert_close(
        "passk no std", estimate("grpo_passk", rewards64(), groups(), normalize_by_std=False), expected_raw
    )
    # the first maximum wins a tie at the top when the runner-up is lower
    out = estimate(
        "grpo_passk", rewards64([0.0, 2.0, 2.0, 1.0]), groups([0, 0, 0, 0]), normalize_by_std=False
    )
    assert_close("passk tie", out, [0, 0, 0, 0])
    out = estimate("grpo_passk", rewards64([0.0, 2.0, 1.0]), groups([0, 0, 0]), normalize_by_std=False)
    assert_close("passk unique", out, [0, 1.0, 0])


def test_gpg_hand():
    centered = grpo_expected(0.0, "none")
    # valid_groups: groups 0 and 1 are non-uniform (6 rows); the singleton is uniform
    assert_close("gpg valid", estimate("gpg", rewards64(), groups()), [7 / 6 * c for c in centered])
    # nonzero_rewards: 5 rows have r != 0
    assert_close(
        "gpg nonzero",
        estimate("gpg", rewards64(), groups(), alpha_mode="nonzero_rewards", f_norm=2.0),
        [7 / 5 * c / 2 for c in centered],
    )


def test_grpo_lead_hand():
    def w(x):
        return 0.4 + 1.1 / (1 + math.exp(10 * (x - 0.75)))

    base = grpo_expected(1e-6, "group")
    rho = {0: 2 / 3, 1: 2 / 3, 2: 1.0}
    expected = [a * (w(rho[g]) if a > 0 else w(1 - rho[g])) for a, g in zip(base, GROUPS)]
    assert_close("grpo_lead", estimate("grpo_lead", rewards64(), groups()), expected)
    correct = torch.tensor([True, True, False, False, False, True, False])
    rho = {0: 2 / 3, 1: 1 / 3, 2: 0.0}
    expected = [a * (w(rho[g]) if a > 0 else w(1 - rho[g])) for a, g in zip(base, GROUPS)]
    assert_close(
        "grpo_lead correct=", estimate("grpo_lead", rewards64(), groups(), correct=correct), expected
    )


def test_edge_grpo_hand():
    entropy = torch.tensor(
        [
            [1.0, 3.0, 9.0],
            [2.0, 2.0, 2.0],
            [4.0, 0.0, 0.0],
            [1.0, 1.0, 1.0],
            [0.5, 0.5, 2.0],
            [3.0, 3.0, 3.0],
            [1.0, 2.0, 3.0],
        ],
        dtype=F64,
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    mean_h = [2.0, 2.0, 4.0, 1.0, 1.0, 3.0, 2.0]
    base = grpo_expected(1e-4, "group")
    group_ref = {0: 8 / 3, 1: 5 / 3, 2: 2.0}
    expected = [a / (h / group_ref[g]) for a, h, g in zip(base, mean_h, GROUPS)]
    out = estimate("edge_grpo", rewards64(), groups(), entropy=entropy, mask=mask)
    assert_close("edge_grpo group", out, expected)
    batch_ref = sum(mean_h) / 7
    expected = [a / (h / batch_ref) for a, h in zip(base, mean_h)]
    out = estimate("edge_grpo", rewards64(), groups(), entropy=entropy, mask=mask, entropy_normalizer="batch")
    assert_close("edge_grpo batch", out, expected)


def test_grpo_lambda_clamp_hand():
    expected = [max(a, -0.5) for a in grpo_expected(1e-4, "group")]
    assert_close("clamp", estimate("grpo_lambda_clamp", rewards64(), groups(), min_advantage=-0.5), expected)
    with pytest.raises(ValueError, match="min_advantage must be a number <= 0"):
        estimate("grpo_lambda_clamp", rewards64(), groups(), min_advantage=0.5)


# Multi-reward

MULTI = [[1.0, 0.2], [0.0, 0.9], [1.0, 0.4], [0.5, 0.1], [0.0, 0.1], [2.0, 0.7], [3.0, 0.5]]


def _z_columns(epsilon):
    """Per-group z-scores of each reward column (Bessel std), by hand."""
    z = [[0.0, 0.0] for _ in MULTI]
    for g in (0, 1, 2):
        rows = [i for i, gi in enumerate(GROUPS) if gi == g]
        for k in (0, 1):
            vals = [MULTI[i][k] for i in rows]
            mu = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
            for i in rows:
                z[i][k] = (MULTI[i][k] - mu) / (sd + epsilon)
    return z


def test_mo_grpo_hand_and_scale_invariance():
    eps = 1e-4
    weights = [1.0, 2.0]
    summed = [weights[0] * a + weights[1] * b for a, b in _z_columns(eps)]
    expected = []
    for i, g in enumerate(GROUPS):
        vals = [summed[j] for j, gj in enumerate(GROUPS) if gj == g]
        mu = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        expected.append((summed[i] - mu) / (sd + eps))
    r = torch.tensor(MULTI, dtype=F64)
    assert_close("mo_grpo", estimate("mo_grpo", r, groups(), weights=torch.tensor(weights)), expected)
    assert_close("mo_grpo sum", estimate("mo_grpo", r, groups(), weights=weights, renormalize=False), summed)
    # scaling one objective by 1000 and shifting it leaves every advantage unchanged (epsilon = 0)
    scaled = r.clone()
    scaled[:, 1] = scaled[:, 1] * 1000 + 7
    assert_close(
        "mo_grpo scale invariance",
        estimate("mo_grpo", scaled, groups(), epsilon=0.0),
        estimate("mo_grpo", r, groups(), epsilon=0.0),
        atol=1e-9,
        rtol=1e-9,
    )


def test_gdpo_hand():
    eps = 1e-4
    summed = [a + b for a, b in _z_columns(eps)]
    mean = sum(summed) / 7
    sd = math.sqrt(sum((s - mean) ** 2 for s in summed) / 6)
    expected = [(s - mean) / (sd + eps) for s in summed]
    assert_close("gdpo", estimate("gdpo", torch.tensor(MULTI, dtype=F64), groups()), expected)
    tokens = LENGTHS
    total = sum(tokens)
    mean_w = sum(t * s for t, s in zip(tokens, summed)) / total
    var_w = sum(t * (s - mean_w) ** 2 for t, s in zip(tokens, summed)) / (total - 1)
    mask = torch.zeros(7, 5, dtype=torch.bool)
    for i, n in enumerate(tokens):
        mask[i, :n] = True
    expected = [(s - mean_w) / math.sqrt(var_w + 1e-8) for s in summed]
    out = estimate("gdpo", torch.tensor(MULTI, dtype=F64), groups(), batch_normalization="token", mask=mask)
    assert_close("gdpo token", out, expected)


# Entropy shaping


def test_grpo_s_hand():
    rewards = rewards64([1.0, 1.0, 0.0])
    entropy = torch.tensor([[2.0, 2.0], [1.0, 1.0], [0.5, 0.5]], dtype=F64)
    mask = torch.ones(3, 2, dtype=torch.bool)
    shaped = [1 + 0.1 * (2 / 3) * 2, 1 + 0.1 * (1 / 3) * 2, -1 - 0.1 * 1.0 * 1]
    sd_pos = math.sqrt(((shaped[0] - 1.1) ** 2 + (shaped[1] - 1.1) ** 2) / 1)
    expected = [(shaped[0] - 1.1) / (sd_pos + 1e-8), (shaped[1] - 1.1) / (sd_pos + 1e-8), 0.0]
    out = estimate("grpo_s", rewards, groups([0, 0, 0]), entropy=entropy, mask=mask)
    assert_close("grpo_s per_polarity", out, expected, atol=1e-8)
    mu = sum(shaped) / 3
    sd = math.sqrt(sum((s - mu) ** 2 for s in shaped) / 2)
    out = estimate("grpo_s", rewards, groups([0, 0, 0]), entropy=entropy, mask=mask, normalize="joint")
    assert_close("grpo_s joint", out, [(s - mu) / (sd + 1e-8) for s in shaped])


def test_gtpo_hand():
    # group of 3, T = 3; row 2 (wrong) is one token shorter.
    rewards = rewards64([1.0, 1.0, 0.0])
    entropy = torch.tensor([[3.0, 1.0, 2.0], [1.0, 3.0, 2.0], [2.0, 4.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    eps = 1e-8
    pos = {
        (0, 0): 1 + 0.1 * 3 / 4 * 2,
        (1, 0): 1 + 0.1 * 1 / 4 * 2,
        (0, 1): 1 + 0.1 * 1 / 4 * 2,
        (1, 1): 1 + 0.1 * 3 / 4 * 2,
        (0, 2): 1 + 0.1 * 2 / 4 * 2,
        (1, 2): 1 + 0.1 * 2 / 4 * 2,
    }
    neg = {(2, 0): -1 - 0.1 * 1 * 1, (2, 1): -1 - 0.1 * 1 * 1}  # a single wrong response: share 1, h_t = 1

    def z(values):
        mu = sum(values.values()) / len(values)
        sd = math.sqrt(sum((v - mu) ** 2 for v in values.values()) / (len(values) - 1))
        return {k: (v - mu) / (sd + eps) for k, v in values.items()}

    expected = torch.zeros(3, 3, dtype=F64)
    for (i, t), v in {**z(pos), **{k: 0.0 for k in neg}}.items():  # constant O- set -> 0
        expected[i, t] = v
    out = estimate("gtpo", rewards, groups([0, 0, 0]), entropy=entropy, mask=mask)
    assert_close("gtpo per_polarity", out, expected, atol=1e-8)
    joint = z({**pos, **neg})
    expected = torch.zeros(3, 3, dtype=F64)
    for (i, t), v in joint.items():
        expected[i, t] = v
    out = estimate("gtpo", rewards, groups([0, 0, 0]), entropy=entropy, mask=mask, normalize="joint")
    assert_close("gtpo joint", out, expected)


def test_gtpo_negative_share_uses_inverse_entropy():
    # two wrong responses: the confident one (low entropy) gets the larger penalty
    rewards = rewards64([1.0, 0.0, 0.0])
    entropy = torch.tensor([[1.0], [0.5], [2.0]], dtype=F64)
    mask = torch.ones(3, 1, dtype=torch.bool)
    out = estimate("gtpo", rewards, groups([0, 0, 0]), entropy=entropy, mask=mask, normalize="joint")
    inv = [1 / (0.5 + 1e-8), 1 / (2.0 + 1e-8)]
    shaped = [1 + 0.1 * 1 * 1, -1 - 0.1 * inv[0] / sum(inv) * 2, -1 - 0.1 * inv[1] / sum(inv) * 2]
    mu = sum(shaped) / 3
    sd = math.sqrt(sum((s - mu) ** 2 for s in shaped) / 2)
    assert_close("gtpo inverse share", out[:, 0], [(s - mu) / (sd + 1e-8) for s in shaped])
    assert out[1, 0] < out[2, 0]


# Per-token


def test_reinforce_plus_plus_hand():
    rewards = rewards64([1.0, 0.0, 2.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)  # row 1 has a gap
    logp = torch.tensor(
        [[-1.0, -2.0, -0.5, -9.0], [-0.2, -9.0, -0.3, -1.0], [-1.0, -1.0, -1.0, -1.0]], dtype=F64
    )
    ref = torch.tensor(
        [[-1.5, -1.0, -0.5, -9.0], [-0.1, -9.0, -0.4, -2.0], [-1.2, -0.8, -1.0, -0.5]], dtype=F64
    )
    beta, gamma = 0.1, 0.5
    # token rewards: score at the last valid token, minus beta * k1 on valid tokens
    tok = [[0.0] * 4 for _ in range(3)]
    for i in range(3):
        valid = [t for t in range(4) if mask[i, t]]
        for t in valid:
            tok[i][t] = -beta * float(logp[i, t] - ref[i, t])
        tok[i][valid[-1]] += float(rewards[i])
    returns = [[0.0] * 4 for _ in range(3)]
    for i in range(3):
        running = 0.0
        for t in reversed(range(4)):
            if mask[i, t]:
                running = tok[i][t] + gamma * running
                returns[i][t] = running
    values = [returns[i][t] for i in range(3) for t in range(4) if mask[i, t]]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    expected = [
        [(returns[i][t] - mean) / math.sqrt(var + 1e-8) if mask[i, t] else 0.0 for t in range(4)]
        for i in range(3)
    ]
    out = estimate(
        "reinforce_plus_plus",
        rewards,
        groups([0, 1, 2]),
        mask=mask,
        gamma=gamma,
        kl_coef=beta,
        logprobs=logp,
        ref_logprobs=ref,
    )
    assert_close("reinforce++", out, expected)


def test_mt_grpo_hand():
    outcome = rewards64([1.0, 0.0, 1.0])
    turn_rewards = torch.tensor(
        [[1.0, 0.0], [0.0, 0.0], [0.5, 0.0]], dtype=F64
    )  # final turn: 0 (paper's 2 turns)
    turn_ids = torch.tensor([[0, 0, -1, 1, 1], [0, -1, 1, -1, -1], [0, 0, 0, -1, 1]])
    a_out = [(r - 2 / 3) / (SD0 + 1e-4) for r in (1.0, 0.0, 1.0)]
    sd_t = math.sqrt(((1 - 0.5) ** 2 + 0.5**2 + 0) / 2)
    a_turn = [(v - 0.5) / (sd_t + 1e-4) for v in (1.0, 0.0, 0.5)]
    expected = torch.zeros(3, 5, dtype=F64)
    for i in range(3):
        for t in range(5):
            k = int(turn_ids[i, t])
            if k == 0:
                expected[i, t] = a_out[i] + 0.5 * a_turn[i]
            elif k == 1:
                expected[i, t] = a_out[i]
    out = estimate(
        "mt_grpo", outcome, groups([0, 0, 0]), turn_rewards=turn_rewards, turn_ids=turn_ids, turn_coef=0.5
    )
    assert_close("mt_grpo", out, expected)


def test_gigpo_hand():
    # one group of 3 episodes, 2 steps each except episode 1 (1 step); anchor states by id
    episode_returns = rewards64([1.0, 0.0, 2.0])
    step_rewards = torch.tensor(
        [[0.0, 1.0], [0.0, 7.0], [1.0, 1.0]], dtype=F64
    )  # 7.0 is past the end of ep. 1
    state_ids = torch.tensor([[0, 5], [0, -1], [0, 5]])
    step_ids = torch.tensor([[0, 0, 1, -1], [0, 0, -1, -1], [-1, 0, 1, 1]])
    gamma, omega = 0.5, 0.7
    ret = {(0, 0): 0 + gamma * 1, (0, 1): 1.0, (1, 0): 0.0, (2, 0): 1 + gamma * 1, (2, 1): 1.0}
    state0 = [ret[(0, 0)], ret[(1, 0)], ret[(2, 0)]]
    step_adv = {
        (0, 0): ret[(0, 0)] - sum(state0) / 3,
        (1, 0): ret[(1, 0)] - sum(state0) / 3,
        (2, 0): ret[(2, 0)] - sum(state0) / 3,
        (0, 1): 0.0,
        (2, 1): 0.0,
    }  # state 5: equal returns
    episode = [r - 1.0 for r in (1.0, 0.0, 2.0)]
    expected = torch.zeros(3, 4, dtype=F64)
    for i in range(3):
        for t in range(4):
            s = int(step_ids[i, t])
            if s >= 0:
                expected[i, t] = episode[i] + omega * step_adv[(i, s)]
    out = estimate(
        "gigpo",
        episode_returns,
        groups([0, 0, 0]),
        step_rewards=step_rewards,
        state_ids=state_ids,
        step_ids=step_ids,
        gamma=gamma,
        step_weight=omega,
    )
    assert_close("gigpo", out, expected)
    # with F_norm = std + eps
    sd_e = math.sqrt((0 + 1 + 1) / 2)
    mu0 = sum(state0) / 3
    sd0 = math.sqrt(sum((v - mu0) ** 2 for v in state0) / 2)
    for i in range(3):
        for t in range(4):
            s = int(step_ids[i, t])
            if s >= 0:
                a_s = (ret[(i, s)] - mu0) / (sd0 + 1e-6) if s == 0 else 0.0
                expected[i, t] = episode[i] / (sd_e + 1e-6) + omega * a_s
    out = estimate(
        "gigpo",
        episode_returns,
        groups([0, 0, 0]),
        step_rewards=step_rewards,
        state_ids=state_ids,
        step_ids=step_ids,
        gamma=gamma,
        step_weight=omega,
        normalize_by_std=True,
    )
    assert_close("gigpo std", out, expected)


def test_gigpo_anchor_groups_stay_within_prompt_group():
    # the same state id in two different prompt groups must not be pooled
    returns = rewards64([1.0, 0.0, 5.0, 3.0])
    step_rewards = torch.tensor([[1.0], [0.0], [5.0], [3.0]], dtype=F64)
    state_ids = torch.zeros(4, 1, dtype=torch.long)
    step_ids = torch.zeros(4, 1, dtype=torch.long)
    out = estimate(
        "gigpo",
        returns,
        groups([0, 0, 1, 1]),
        step_rewards=step_rewards,
        state_ids=state_ids,
        step_ids=step_ids,
        step_weight=1.0,
    )
    assert_close("gigpo per group", out[:, 0], [0.5 + 0.5, -0.5 - 0.5, 1.0 + 1.0, -1.0 - 1.0])


def test_lambda_grpo_hand():
    rewards = rewards64([1.0, 0.0, 1.0, 2.0, 0.0])
    ids = torch.tensor([[5, 6, 7, 1], [5, 6, 8, 1], [5, 9, 9, 1], [5, 6, 7, 1], [4, 4, 4, 4]])
    mask = torch.tensor(
        [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool
    )
    # group 0 = rows 0,1,2; group 1 = rows 3,4. Row 3 shares nothing with row 4.
    counts = [[3, 2, 1, 0], [3, 2, 1, 1], [3, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]
    base = [
        (1 - MU0) / (SD0 + 1e-4),
        (0 - MU0) / (SD0 + 1e-4),
        (1 - MU0) / (SD0 + 1e-4),
        1 / (math.sqrt(2) + 1e-4),
        -1 / (math.sqrt(2) + 1e-4),
    ]
    expected = [[base[i] / c if c else 0.0 for c in counts[i]] for i in range(5)]
    out = estimate("lambda_grpo", rewards, groups([0, 0, 0, 1, 1]), completion_ids=ids, mask=mask)
    assert_close("lambda_grpo", out, expected)


def test_process_supervision_hand():
    step_rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.3, 0.0, 0.0]], dtype=F64)
    step_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    step_ids = torch.tensor([[0, 0, 1, 2, 2], [0, 1, 1, -1, -1], [-1, 0, 0, 0, -1]])
    values = [1.0, 0.0, 1.0, 0.0, 1.0]  # group 0: 5 valid steps
    mu = sum(values) / 5
    sd = math.sqrt(sum((v - mu) ** 2 for v in values) / 4)
    n = [
        [(1 - mu) / (sd + 1e-6), (0 - mu) / (sd + 1e-6), (1 - mu) / (sd + 1e-6)],
        [(0 - mu) / (sd + 1e-6), (1 - mu) / (sd + 1e-6), 0.0],
    ]
    suffix = [[n[i][0] + n[i][1] + n[i][2], n[i][1] + n[i][2], n[i][2]] for i in range(2)]
    expected = [
        [suffix[0][0], suffix[0][0], suffix[0][1], suffix[0][2], suffix[0][2]],
        [suffix[1][0], suffix[1][1], suffix[1][1], 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
    ]  # group 1 has a single step: normalized to 0
    out = estimate(
        "process_supervision", step_rewards, groups([0, 0, 1]), step_ids=step_ids, step_mask=step_mask
    )
    assert_close("process_supervision", out, expected)


# Stateful / filtered


def test_dcpo_smooth_standardization_over_steps():
    state = A.SmoothAdvantageStandardizer()
    history: list[float] = []
    steps = [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]
    for i, step in enumerate(steps, start=1):
        history += step
        mu_n = sum(step) / 3
        sd_n = math.sqrt(sum((r - mu_n) ** 2 for r in step) / 2)
        mu_t = sum(history) / len(history)
        sd_t = math.sqrt(sum((r - mu_t) ** 2 for r in history) / (len(history) - 1))
        expected = []
        for r in step:
            sa_n = (r - mu_n) / sd_n if sd_n > 0 else 0.0
            sa_t = (r - mu_t) / sd_t if sd_t > 0 else 0.0
            s_new = (i - 1) / i * sa_n + 1 / i * sa_t
            s_tot = 1 / i * sa_n + (i - 1) / i * sa_t
            expected.append(s_new if abs(s_new) < abs(s_tot) else s_tot)
        out = estimate("dcpo", rewards64(step), groups([0, 0, 0]), state=state, prompt_keys=["q"])
        assert_close(f"dcpo step {i}", out, expected)
    assert state.times_seen("q") == 4
    # a second prompt starts fresh; state round-trips through state_dict
    restored = A.SmoothAdvantageStandardizer()
    restored.load_state_dict(state.state_dict())
    out = estimate(
        "dcpo",
        rewards64([0.0, 1.0, 1.0, 0.0]),
        groups([0, 0, 1, 1]),
        state=restored,
        prompt_keys=["fresh", "q"],
    )
    assert_close("dcpo fresh prompt", out[:2], [-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)])
    assert restored.times_seen("q") == 5 and restored.times_seen("fresh") == 1


def test_gfpo_hand():
    lengths = torch.tensor(LENGTHS)
    # length, keep 2: group 0 keeps rows 2 (l=1) and 0 (l=2), both r=1 -> 0; group 1 keeps rows 4 and 5
    expected = [0, 0, 0, 0, -1 / (math.sqrt(2) + 1e-4), 1 / (math.sqrt(2) + 1e-4), 0]
    assert_close("gfpo length", estimate("gfpo", rewards64(), groups(), lengths=lengths, keep=2), expected)
    # reward per token: group 1 r/l = [0.125, 0, 0.667] keeps rows 5 and 3
    sd = math.sqrt(2 * 0.75**2)
    expected = [0, 0, 0, -0.75 / (sd + 1e-4), 0, 0.75 / (sd + 1e-4), 0]
    out = estimate("gfpo", rewards64(), groups(), lengths=lengths, keep=2, metric="reward_per_token")
    assert_close("gfpo reward/token", out, expected)


# Properties


SEQUENCE_ESTIMATORS = {
    "grpo": {},
    "dr_grpo": {},
    "lite_ppo": {},
    "rloo": {},
    "reinforce_plus_plus_baseline": {},
    "grpo_passk": {},
    "gpg": {},
    "grpo_lead": {},
    "grpo_lambda_clamp": {"min_advantage": -1.0},
}


@pytest.mark.parametrize("name", sorted(SEQUENCE_ESTIMATORS))
def test_permutation_equivariance(name):
    # shuffling rows (and their group ids) shuffles the advantages the same way
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(11, generator=gen, dtype=F64)
    group_index = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 3])
    perm = torch.randperm(11, generator=gen)
    out = estimate(name, rewards, group_index, **SEQUENCE_ESTIMATORS[name])
    out_perm = estimate(name, rewards[perm], group_index[perm], **SEQUENCE_ESTIMATORS[name])
    assert_close(f"{name} permuted", out_perm, out[perm], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "gpg", "opo"])
def test_group_advantages_sum_to_zero(name):
    gen = torch.Generator().manual_seed(5)
    rewards = torch.rand(9, generator=gen, dtype=F64)
    group_index = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2])
    opts = {"lengths": torch.ones(9)} if name == "opo" else {}
    out = estimate(name, rewards, group_index, **opts)
    sums = torch.zeros(3, dtype=F64).index_add_(0, group_index, out)
    assert_close(f"{name} group sums", sums, [0.0, 0.0, 0.0], atol=1e-12)


@pytest.mark.parametrize(
    "name", ["grpo", "dr_grpo", "rloo", "grpo_passk", "gpg", "grpo_lead", "opo", "lite_ppo"]
)
def test_singleton_groups_get_zero(name):
    opts = {"lengths": torch.tensor([3.0, 4.0, 5.0])} if name == "opo" else {}
    out = estimate(name, rewards64([0.3, 7.0, -2.0]), groups([0, 1, 2]), **opts)
    assert_close(f"{name} singletons", out, [0.0, 0.0, 0.0])


def test_grpo_is_invariant_to_affine_reward_changes_per_group():
    r = torch.tensor([0.1, 0.7, 0.4, 2.0, 5.0], dtype=F64)
    g = groups([0, 0, 0, 1, 1])
    shifted = r * 3.0 + 11.0
    assert_close(
        "grpo affine",
        estimate("grpo", shifted, g, epsilon=0.0),
        estimate("grpo", r, g, epsilon=0.0),
        atol=1e-12,
        rtol=1e-12,
    )


def test_two_rollout_groups_give_plus_minus_one_over_sqrt2():
    r = rewards64([1.0, 0.0, 0.2, 5.0, 3.0, 3.0])
    out = estimate("grpo", r, groups([0, 0, 1, 1, 2, 2]), epsilon=0.0)
    s = 1 / math.sqrt(2)
    assert_close("2-grpo", out, [s, -s, -s, s, 0.0, 0.0], atol=1e-12)


def test_float32_in_float32_out_and_bf16_promoted():
    r32 = torch.tensor(REWARDS, dtype=torch.float32)
    assert estimate("grpo", r32, groups()).dtype == torch.float32
    assert estimate("grpo", r32.bfloat16(), groups()).dtype == torch.float32
    assert_close("fp32 vs fp64", estimate("grpo", r32, groups()), grpo_expected(1e-4), atol=1e-6, rtol=1e-6)


# Shaping


def test_dapo_overlong_penalty_hand():
    lengths = torch.tensor([10, 80, 81, 90, 100, 101, 500])
    expected = [0.0, 0.0, -1 / 20, -0.5, -1.0, -1.0, -1.0]
    out = A.dapo_overlong_penalty(lengths.to(F64), max_length=100, cache_length=20)
    assert_close("overlong", out, expected)
    out = A.dapo_overlong_penalty(lengths, max_length=100, cache_length=20)  # integer lengths -> fp32
    assert out.dtype == torch.float32
    assert_close("overlong int", out, expected, atol=1e-7, rtol=1e-7)
    with pytest.raises(ValueError, match="cache_length"):
        A.dapo_overlong_penalty(lengths, max_length=100, cache_length=0)


def test_lead_length_reward_hand():
    correct = torch.tensor([True, True, False, True, True, False])
    lengths = torch.tensor([100.0, 200.0, 50.0, 300.0, 40.0, 10.0], dtype=F64)
    eps = 1e-6
    z = [(100 - 200) / (100 + eps), 0.0, None, (300 - 200) / (100 + eps), 0.0]
    expected = [math.exp(-0.05 * z[0]), 1.0, -1.0, math.exp(-0.05 * z[3]), 1.0, -1.0]
    out = A.lead_length_reward(correct, lengths, groups([0, 0, 0, 0, 1, 1]))
    assert_close("lead length reward", out, expected)


def test_sentence_bleu_hand():
    hyp = "a b c d e f".split()
    ref = "a b c d e g".split()
    w = DIVER_BLEU_WEIGHTS
    expected = math.exp(
        w[0] * math.log(5 / 6)
        + w[1] * math.log(4 / 5)
        + w[2] * math.log(3 / 4)
        + w[3] * math.log(2 / 3)
        + w[4] * math.log(1 / 2)
    )
    assert abs(sentence_bleu(ref, hyp) - expected) < 1e-12
    # brevity penalty: a shorter hypothesis that is a prefix of the reference
    short, long_ref = "a b c d e".split(), "a b c d e f g".split()
    assert abs(sentence_bleu(long_ref, short) - math.exp(1 - 7 / 5)) < 1e-12
    # clipping: repeated words count at most as often as in the reference
    # (hypothesis longer than the reference: no brevity penalty)
    assert abs(sentence_bleu("x y".split(), "x x x x x".split(), weights=(1.0,)) - 1 / 5) < 1e-15
    assert sentence_bleu(ref, []) == 0.0


def test_sentence_bleu_matches_nltk_when_installed():
    bleu_score = pytest.importorskip(
        "nltk.translate.bleu_score", reason="nltk not installed (optional cross-check)"
    )
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        ref = torch.randint(0, 4, (int(torch.randint(5, 12, (1,), generator=gen)),), generator=gen).tolist()
        hyp = torch.randint(0, 4, (int(torch.randint(5, 12, (1,), generator=gen)),), generator=gen).tolist()
        ours = sentence_bleu(ref, hyp)
        theirs = bleu_score.sentence_bleu([ref], hyp, weights=DIVER_BLEU_WEIGHTS)
        assert abs(ours - theirs) < 1e-12 or (ours == 0.0 and theirs < 1e-30), (ref, hyp, ours, theirs)


def test_textual_diversity_and_diver_rewards_hand():
    texts = ["the cat sat on the mat", "the cat sat on the mat", "a dog ran in the park today", "solo answer"]
    g = groups([0, 0, 0, 1])
    assert_close("diversity", A.textual_diversity(texts, g), [0.5, 0.5, 1.0, 0.0])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert_close(
        "diver rewards", A.diver_rewards(rewards, g, texts, coef=0.2), [1.1, 0.0, 1.2, 1.0], atol=1e-7
    )
    ids = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [9, 8, 7, 6, 5], [3]]
    assert_close("diversity ids", A.textual_diversity(ids, g), [0.5, 0.5, 1.0, 0.0])


def test_kl_penalized_token_rewards_hand():
    rewards = torch.tensor([2.0, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    logp = torch.tensor([[-1.0, -0.5, -3.0], [-2.0, -1.0, -0.1]], dtype=F64)
    ref = torch.tensor([[-1.2, -0.5, -1.0], [-1.0, -1.5, -0.3]], dtype=F64)
    d = logp - ref
    for name, kl in [("k1", d), ("abs", d.abs()), ("k2", 0.5 * d**2), ("k3", torch.exp(-d) + d - 1)]:
        expected = -0.1 * kl * mask
        expected[0, 1] += 2.0
        expected[1, 2] += -1.0
        out = A.kl_penalized_token_rewards(rewards, mask, logp, ref, kl_coef=0.1, kl_estimator=name)
        assert_close(f"kl fold {name}", out, expected)
    big = torch.tensor([[0.0, 0.0, 0.0], [0.0, -50.0, 0.0]], dtype=F64)
    clamped = A.token_kl(big, torch.zeros_like(big), "low_var_kl")
    assert_close("low_var_kl clamp", clamped[1, 1], min(math.exp(20) - 20 - 1, 10.0))


# Filters


def test_dynamic_sampling_hand():
    r = rewards64([1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1, 5])
    g = groups([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4])
    res = A.dynamic_sampling(r, g)
    assert res.kept.tolist() == [3, 4, 5, 9, 10, 11]
    assert (
        res.reasons[0] == "uniform_reward"
        and res.reasons[6] == "uniform_reward"
        and res.reasons[12] == "uniform_reward"
    )
    assert res.reasons[3] == "kept" and res.shortfall == 0
    res = A.dynamic_sampling(r, g, num_groups=1)
    assert res.kept.tolist() == [3, 4, 5] and res.reasons[9] == "surplus" and res.shortfall == 0
    res = A.dynamic_sampling(r, g, num_groups=4)
    assert res.kept.tolist() == [3, 4, 5, 9, 10, 11] and res.shortfall == 2
    assert res.kept_mask.tolist() == [i in (3, 4, 5, 9, 10, 11) for i in range(13)]


def test_reinforce_rej_hand():
    correct = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 1])
    res = A.reinforce_rej(correct, groups([0, 0, 0, 1, 1, 1, 2, 2, 3]))
    assert res.kept.tolist() == [3, 4, 5]
    assert res.reasons == ("all_correct",) * 3 + ("kept",) * 3 + ("all_incorrect",) * 2 + ("all_correct",)


def test_cppo_hand():
    adv = torch.tensor([0.1, -2.0, 0.5, 1.0, -0.05, 0.3, 0.3], dtype=F64)
    g = groups([0, 0, 0, 1, 1, 1, 1])
    res = A.cppo(adv, g, min_abs_advantage=0.3)
    assert res.kept.tolist() == [1, 2, 3, 5, 6] and res.reasons[0] == "low_abs_advantage"
    # prune 50%: group 0 keeps floor(3 * 0.5) = 1 (row 1); group 1 keeps 2: row 3, then row 5 (tied with 6)
    res = A.cppo(adv, g, prune_fraction=0.5)
    assert res.kept.tolist() == [1, 3, 5] and res.reasons[6] == "pruned_low_abs_advantage"
    res = A.cppo(adv, g, prune_fraction=0.5, scope="batch")  # floor(7 * 0.5) = 3 largest overall
    assert res.kept.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="exactly one"):
        A.cppo(adv, g)


def test_gfpo_filter_hand():
    res = A.gfpo_filter(rewards64(), groups(), lengths=torch.tensor(LENGTHS), keep=2)
    assert res.kept.tolist() == [0, 2, 4, 5, 6] and res.reasons[1] == "filtered_by_length"
    res = A.gfpo_filter(
        rewards64(), groups(), lengths=torch.tensor(LENGTHS), keep=1, metric="reward_per_token"
    )
    assert res.kept.tolist() == [2, 5, 6] and res.reasons[0] == "filtered_by_reward_per_token"


def test_two_rollout_contrastive_hand():
    res = A.two_rollout_contrastive(rewards64([1, 0, 1, 1, 0.2, 0.3]), groups([0, 0, 1, 1, 2, 2]))
    assert res.kept.tolist() == [0, 1, 4, 5] and res.reasons[2] == "tied_pair"
    with pytest.raises(ValueError, match="group 0 has 3 rollouts"):
        A.two_rollout_contrastive(rewards64([1, 0, 1]), groups([0, 0, 0]))


def test_overlong_filter_hand():
    res = A.overlong_filter(torch.tensor([10, 100, 99, 120]), max_length=100)
    assert res.kept.tolist() == [0, 2] and res.reasons[1] == "truncated"
    res = A.overlong_filter(torch.tensor([10, 100]), max_length=100, truncated=torch.tensor([True, False]))
    assert res.kept.tolist() == [1]


# Bad input


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_raise(bad):
    r = rewards64()
    r[4] = bad
    with pytest.raises(ValueError, match=re.escape(f"rewards must be finite; rewards[4] = {bad}")):
        estimate("grpo", r, groups())


@pytest.mark.parametrize(
    ("group_index", "message"),
    [
        (torch.tensor([0, 0, 0, 2, 2, 2, 3]), r"missing group id\(s\) \[1\]"),
        (torch.tensor([0, 0, 0, 1, 1, 1]), r"group_index must have shape \(7,\)"),
        (torch.tensor([0, 0, 0, 1, 1, 1, -1]), r"group_index must be >= 0; group_index\[6\] = -1"),
        (torch.tensor([0.0, 0, 0, 1, 1, 1, 2]), "group_index must be an integer tensor"),
        ([0, 0, 0, 1, 1, 1, 2], "group_index must be a torch.Tensor"),
    ],
)
def test_bad_group_index_raises(group_index, message):
    with pytest.raises(ValueError, match=message):
        estimate("grpo", rewards64(), group_index)


def test_bad_rewards_shape_and_type_raise():
    with pytest.raises(ValueError, match=r"rewards must have shape \[B\], got \(7, 1\)"):
        estimate("grpo", rewards64().unsqueeze(-1), groups())
    with pytest.raises(ValueError, match=r"rewards must have shape \[B, K\], got \(7,\)"):
        estimate("gdpo", rewards64(), groups())
    with pytest.raises(ValueError, match="rewards must be a floating tensor"):
        estimate("grpo", torch.tensor(GROUPS), groups())
    with pytest.raises(ValueError, match="at least one row"):
        estimate("grpo", torch.zeros(0), torch.zeros(0, dtype=torch.long))


def test_bad_per_token_inputs_raise():
    entropy = torch.rand(7, 4, dtype=F64) + 0.1
    with pytest.raises(ValueError, match=r"mask must have shape \(7, 4\), got \(7, 3\)"):
        estimate("edge_grpo", rewards64(), groups(), entropy=entropy, mask=torch.ones(7, 3))
    with pytest.raises(ValueError, match=r"mask must hold only 0 and 1; mask\[0, 1\] = 2"):
        estimate("edge_grpo", rewards64(), groups(), entropy=entropy, mask=torch.tensor([[1, 2, 1, 1]] * 7))
    with pytest.raises(ValueError, match="entropy must be >= 0"):
        estimate("gtpo", rewards64(), groups(), entropy=-entropy, mask=torch.ones(7, 4))
    with pytest.raises(ValueError, match="lengths must be >= 0; lengths\\[1\\] = -3.0"):
        estimate("opo", rewards64(), groups(), lengths=torch.tensor([1, -3, 1, 1, 1, 1, 1]))
    with pytest.raises(ValueError, match=r"step_ids\[0, 0\] = 2 refers to a step with step_mask = 0"):
        estimate(
            "process_supervision",
            torch.zeros(2, 3, dtype=F64),
            groups([0, 0]),
            step_ids=torch.tensor([[2, 0], [0, 0]]),
            step_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
        )
    with pytest.raises(ValueError, match="valid steps .* must form a prefix"):
        estimate(
            "gigpo",
            rewards64([1.0, 0.0]),
            groups([0, 0]),
            step_rewards=torch.zeros(2, 2, dtype=F64),
            state_ids=torch.tensor([[-1, 3], [0, 1]]),
            step_ids=torch.tensor([[1], [0]]),
        )
    with pytest.raises(ValueError, match=r"turn_ids must be \[-1, 2\)"):
        estimate(
            "mt_grpo",
            rewards64([1.0, 0.0]),
            groups([0, 0]),
            turn_rewards=torch.zeros(2, 2, dtype=F64),
            turn_ids=torch.tensor([[0, 2], [0, 1]]),
        )


def test_dcpo_requires_state_and_one_key_per_group():
    with pytest.raises(ValueError, match="state must be a SmoothAdvantageStandardizer"):
        estimate("dcpo", rewards64(), groups(), state=None, prompt_keys=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"prompt_keys must hold one key per group \(3\)"):
        estimate("dcpo", rewards64(), groups(), state=A.SmoothAdvantageStandardizer(), prompt_keys=["a", "b"])


def test_output_shapes_follow_the_registry():
    gen = torch.Generator().manual_seed(11)
    b, t = 7, 5
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[2, 3:] = False
    entropy = torch.rand(b, t, generator=gen, dtype=F64) + 0.05
    options = {
        "opo": {"lengths": torch.tensor(LENGTHS)},
        "edge_grpo": {"entropy": entropy, "mask": mask},
        "grpo_s": {"entropy": entropy, "mask": mask},
        "gtpo": {"entropy": entropy, "mask": mask},
        "dcpo": {"state": A.SmoothAdvantageStandardizer(), "prompt_keys": [0, 1, 2]},
        "grpo_lambda_clamp": {"min_advantage": -1.0},
        "gfpo": {"lengths": torch.tensor(LENGTHS), "keep": 2},
        "reinforce_plus_plus": {"mask": mask},
        "mt_grpo": {
            "turn_rewards": torch.rand(b, 2, generator=gen, dtype=F64),
            "turn_ids": torch.zeros(b, t, dtype=torch.long),
        },
        "gigpo": {
            "step_rewards": torch.rand(b, 2, generator=gen, dtype=F64),
            "state_ids": torch.zeros(b, 2, dtype=torch.long),
            "step_ids": torch.zeros(b, t, dtype=torch.long),
        },
        "lambda_grpo": {"completion_ids": torch.randint(0, 3, (b, t), generator=gen), "mask": mask},
        "process_supervision": {"step_ids": torch.zeros(b, t, dtype=torch.long)},
    }
    for name in REQUIRED:
        spec = A.get(name)
        rewards = torch.rand(b, 3 if spec.rewards_shape != "[B]" else 1, generator=gen, dtype=F64)
        rewards = rewards.squeeze(-1) if spec.rewards_shape == "[B]" else rewards
        out = estimate(name, rewards, groups(), **options.get(name, {}))
        expected_shape = (b,) if spec.output == "[B]" else (b, t)
        assert tuple(out.shape) == expected_shape, (
            f"{name}: shape {tuple(out.shape)}, registry says {spec.output}"
        )
        assert bool(torch.isfinite(out).all()), f"{name}: non-finite output"


# ---- the other reading of a method, as an option (hand-computed) -----------------------------------------


def test_mt_grpo_coef_on_outcome_is_the_papers_formula():
    # one group (1, 0): A^O = +-0.5 / (sqrt(0.5) + 1e-4) = +-a; turn-0 rewards (1, 0) give the same +-a
    # paper: turn 0 -> A^T + lambda A^O, last turn -> A^O; lambda 0.5
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    turn_rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    turn_ids = torch.tensor([[0, -1, 1], [0, -1, 1]])
    out = gk.advantages.estimate("mt_grpo", rewards, groups, turn_rewards=turn_rewards, turn_ids=turn_ids,
                                 turn_coef=0.5, coef_on="outcome")  # fmt: skip
    torch.testing.assert_close(out, torch.tensor([[1.5 * a, 0.0, a], [-1.5 * a, 0.0, -a]]))
    code = gk.advantages.estimate("mt_grpo", rewards, groups, turn_rewards=turn_rewards, turn_ids=turn_ids,
                                  turn_coef=0.5)  # fmt: skip
    torch.testing.assert_close(code, torch.tensor([[1.5 * a, 0.0, a], [-1.5 * a, 0.0, -a]]))  # A^T = A^O here
    turn_rewards = torch.tensor([[0.0, 0.0], [1.0, 0.0]])  # turn 0 now disagrees with the outcome
    out = gk.advantages.estimate("mt_grpo", rewards, groups, turn_rewards=turn_rewards, turn_ids=turn_ids,
                                 turn_coef=0.5, coef_on="outcome")  # fmt: skip
    code = gk.advantages.estimate("mt_grpo", rewards, groups, turn_rewards=turn_rewards, turn_ids=turn_ids,
                                  turn_coef=0.5)  # fmt: skip
    torch.testing.assert_close(out[:, 0], torch.tensor([-a + 0.5 * a, a - 0.5 * a]))
    torch.testing.assert_close(code[:, 0], torch.tensor([a - 0.5 * a, -a + 0.5 * a]))


def test_diver_one_way_bleu_and_bonus_clip_hand_computed():
    # unigram BLEU: "1 2" against "1 2 3 4": precision 1, brevity exp(1 - 4/2); the other way 2/4, brevity 1
    texts, groups = ["1 2", "1 2 3 4"], torch.tensor([0, 0])
    short_given_long, long_given_short = math.exp(-1.0), 0.5
    one_way = gk.advantages.textual_diversity(texts, groups, weights=(1.0,), direction="one_way")
    torch.testing.assert_close(one_way, torch.tensor([1 - short_given_long, 1 - long_given_short]))
    both = gk.advantages.textual_diversity(texts, groups, weights=(1.0,))
    torch.testing.assert_close(both, torch.full((2,), 1 - (short_given_long + long_given_short) / 2))
    # the bonus coef * D clipped to [0, max_bonus], correct completions only
    texts = ["1 2 3 4 5", "6 7 8 9 0", "1 2 3 4 5"]
    shaped = gk.advantages.diver_rewards(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 0, 0]), texts,
                                         coef=2.0, max_bonus=0.3)  # fmt: skip
    assert shaped.tolist() == pytest.approx([1.3, 1.3, 0.0])
    with pytest.raises(ValueError, match="direction"):
        gk.advantages.textual_diversity(texts, torch.tensor([0, 0, 0]), direction="sideways")
