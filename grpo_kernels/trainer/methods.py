"""The catalogue: every published method the library implements, where it lives, and how `grpo-kernels
train` reaches it; and the methods it leaves out, with the reason. The README's method table is generated
from here (`python -m grpo_kernels.trainer.methods`) and a test keeps the two in sync; another test builds
the TrainConfig of every row's command line, so a row cannot name a preset or flag that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    source: str  # the paper (arXiv id) or the peer whose definition is followed
    lives: str  # the library symbols that implement it
    args: tuple[str, ...]  # `grpo-kernels train` arguments that run it


METHODS: tuple[Method, ...] = (
    Method("GRPO", "DeepSeekMath, arXiv:2402.03300", "`PolicyLossConfig.grpo`, advantage `grpo`",
           ("--preset", "grpo")),
    Method("DAPO", "arXiv:2503.14476", "`PolicyLossConfig.dapo`, `dynamic_sampling`, "
           "`dapo_overlong_penalty`, `overlong_filter`", ("--preset", "dapo", "--overlong-filter")),
    Method("Dr. GRPO", "arXiv:2503.20783", "`PolicyLossConfig.dr_grpo`, advantage `dr_grpo`",
           ("--preset", "dr_grpo")),
    Method("BNPO (TRL's loss_type)", "TRL 1.16", "`PolicyLossConfig.bnpo`", ("--preset", "bnpo")),
    Method("GSPO", "arXiv:2507.18071", "`PolicyLossConfig.gspo` (`ratio_level=\"sequence\"`)",
           ("--preset", "gspo")),
    Method("CISPO", "MiniMax-M1, arXiv:2506.13585", "`PolicyLossConfig.cispo`", ("--preset", "cispo")),
    Method("GPG", "arXiv:2504.02546", "`PolicyLossConfig.gpg`, advantage `gpg`", ("--preset", "gpg")),
    Method("GMPO", "arXiv:2507.20673", "`PolicyLossConfig.gmpo`", ("--preset", "gmpo")),
    Method("SAPO", "arXiv:2511.20347", "`PolicyLossConfig.sapo`", ("--preset", "sapo")),
    Method("PSPO", "arXiv:2509.21282", "`PolicyLossConfig.pspo`", ("--preset", "pspo")),
    Method("DCPO", "arXiv:2509.02333", "`PolicyLossConfig.dcpo`, advantage `dcpo` (stateful)",
           ("--preset", "dcpo")),
    Method("VESPO", "arXiv:2602.10693", "`PolicyLossConfig.vespo`", ("--preset", "vespo")),
    Method("TIC-GRPO", "arXiv:2508.02833", "`PolicyLossConfig.tic_grpo` (`ratio_level=\"sequence_sum\"`)",
           ("--preset", "tic_grpo")),
    Method("Olmo 3 RL", "arXiv:2512.13961", "`PolicyLossConfig.olmo3`, advantage `dr_grpo`",
           ("--preset", "olmo3")),
    Method("ProRL", "arXiv:2505.24864", "`ref_reset_interval` on DAPO with a small KL", ("--preset", "prorl")),
    Method("RLOO", "arXiv:2402.14740", "advantage `rloo`", ("--preset", "rloo")),
    Method("REINFORCE++", "arXiv:2501.03262", "advantage `reinforce_plus_plus` (KL in the token rewards)",
           ("--preset", "reinforce_pp")),
    Method("REINFORCE++-baseline", "arXiv:2501.03262", "advantage `reinforce_plus_plus_baseline`",
           ("--advantage", "reinforce_plus_plus_baseline")),
    Method("Lite PPO", "arXiv:2508.08221", "advantage `lite_ppo`, token-mean loss", ("--preset", "lite_ppo")),
    Method("OPO", "arXiv:2505.23585", "advantage `opo`", ("--advantage", "opo")),
    Method("GRPO pass@k", "arXiv:2503.19595", "advantage `grpo_passk`", ("--advantage", "grpo_passk")),
    Method("GRPO-λ", "arXiv:2510.00194", "`ratio_level=\"prefix\"`, advantage `grpo_lambda_clamp`",
           ("--preset", "grpo_lambda")),
    Method("λ-GRPO (process sets)", "arXiv:2509.21154", "advantage `lambda_grpo`", ("--preset", "lambda_grpo")),
    Method("Group DPO", "DPO (arXiv:2305.18290) on each group's best and worst completion",
           "`loss_type=\"group_dpo\"`",
           ("--preset", "group_dpo")),
    Method("2-GRPO", "arXiv:2510.00977", "`two_rollout_contrastive`, hook `two_rollouts`",
           ("--preset", "two_rollouts")),
    Method("CPPO", "arXiv:2503.22342", "`cppo` filter (`--prune-fraction`)", ("--preset", "cppo")),
    Method("GFPO", "arXiv:2508.09726", "`gfpo_filter`, advantage `gfpo`, hook `gfpo`", ("--preset", "gfpo")),
    Method("Lopti", "arXiv:2505.12929", "`old_prob_threshold`, hook `lopti`", ("--preset", "lopti")),
    Method("EDGE-GRPO", "arXiv:2507.21848", "advantage `edge_grpo`, hook `edge_gec`", ("--preset", "edge_grpo")),
    Method("GRPO-LEAD", "arXiv:2504.09696", "`lead_length_reward`, advantage `grpo_lead`",
           ("--preset", "grpo_lead")),
    Method("DIVER", "arXiv:2509.26209", "`diver_rewards`, `textual_diversity`", ("--preset", "diver")),
    Method("MO-GRPO", "arXiv:2509.22047", "advantage `mo_grpo` on several rewards", ("--preset", "mo_grpo")),
    Method("GDPO", "arXiv:2601.05242", "advantage `gdpo` on several rewards",
           ("--advantage", "gdpo", "--reward", "exact_match,length_match")),
    Method("GTPO", "arXiv:2508.04349", "advantage `gtpo`", ("--preset", "gtpo")),
    Method("GRPO-S", "arXiv:2508.04349", "advantage `grpo_s`", ("--preset", "grpo_s")),
    Method("MT-GRPO", "arXiv:2505.11821", "advantage `mt_grpo`, task `lookup` (two turns)",
           ("--preset", "mt_grpo")),
    Method("GiGPO", "arXiv:2505.10978", "advantage `gigpo`, task `lookup` (steps = turns)",
           ("--preset", "gigpo")),
    Method("Clip-Cov / KL-Cov", "arXiv:2505.22617", "`loss_type=\"clip_cov\"` / `\"kl_cov\"`",
           ("--loss-option", "loss_type=clip_cov")),
    Method("80/20 high-entropy tokens", "arXiv:2506.01939", "`top_entropy_quantile`",
           ("--loss-option", "top_entropy_quantile=0.2")),
    Method("DPPO (binary TV / binary KL trust region)", "arXiv:2602.04879; SkyRL 0.4.0, prime-rl",
           "`PolicyLossConfig.dppo` (`loss_type=\"dppo\"`, `dppo_divergence`)", ("--preset", "dppo")),
    Method("Squared log-ratio penalty (Kimi K2.5)", "arXiv:2602.02276; prime-rl's default loss",
           "`ratio_kl_coef`", ("--preset", "dppo", "--loss-option", "ratio_kl_coef=0.002")),
    Method("TIS / MIS / off-policy masking", "verl, TRL 1.16; DeepSeek-V3.2", "`is_level`, "
           "`off_policy_mask_threshold` (need the sampler's log-probs)",
           ("--rollout-engine", "vllm")),
    Method("Sampler-anchored ratio, geometric-mean IS, gates", "SkyRL 0.4.0 (`rollout_is`, geometric mask), "
           "OpenRLHF 0.11.2 (ratio / binary-KL / TV gating), AReaL 1.0.4, NeMo-RL (`seq-mask-tis`)",
           "`ratio_anchor=\"rollout\"`, `cispo_form=\"mask\"`, `is_level=\"sequence_geometric\"`, `is_gate`",
           ("--rollout-engine", "vllm", "--loss-option", "is_level=sequence_geometric",
            "--loss-option", "is_gate=tv", "--loss-option", "is_gate_max=0.05")),
)

LEFT_OUT: tuple[tuple[str, str], ...] = (
    ("VAPO", "a learned value model (critic) and its training: outside a critic-free loss library"),
    ("RSPO, routing replay / keep-routing", "they need the MoE router's logits of the sampler and the "
     "trainer, which the LM-head end never sees"),
    ("GAGPO", "its group-aware advantage needs per-step environment structure beyond turns and anchor states"),
    ("adaptive-difficulty GFPO", "an online difficulty estimate per prompt that sets the kept group size: "
     "use `gfpo_filter` with your own keep schedule"),
    ("cosine length reward", "a reward function, not a loss or advantage: pass it as `--reward module:fn`"),
    ("DIVER's equational diversity", "needs a parser of the task's mathematical expressions"),
    ("process-supervision GRPO in the trainer", "needs step rewards from a process reward model: "
     "`gk.advantages.estimate(\"process_supervision\", ...)` in your own loop"),
)


def methods_table_markdown() -> str:
    """The README's method table and the list of what is left out (generated; a test compares)."""
    lines = ["| Method | Source | Lives in | `grpo-kernels train` |", "| --- | --- | --- | --- |"]
    for m in METHODS:
        lines.append(f"| {m.name} | {m.source} | {m.lives} | `{' '.join(m.args)}` |")
    lines += ["", "Left out, and why:", ""]
    lines += [f"* **{name}**: {reason}." for name, reason in LEFT_OUT]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(methods_table_markdown(), end="")
