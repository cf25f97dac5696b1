#!/usr/bin/env bash
# GRPO on GSM8K with verl 0.9.1, the policy loss (and optionally the LM head) on grpo_kernels.
#
# Prerequisites: a GPU machine with verl 0.9.1 + vLLM, `pip install -e ".[verl]"` from this
# repository (it registers grpo_kernels as a `verl.plugins` entry point: every verl process then
# has the gk_<mode> policy losses), and the GSM8K parquet files from verl's preprocessing script
# (examples/data_preprocess/gsm8k.py in verl's repository) in $HOME/data/gsm8k.
#
# grpo_kernels is on through two groups of lines at the end:
#   1. the policy loss: actor_rollout_ref.actor.policy_loss.loss_mode=gk_vanilla (verl's "vanilla"
#      PPO-clip loss computed by grpo_kernels; also gk_gspo, gk_gpg, gk_clip_cov, gk_kl_cov,
#      gk_geo_mean, gk_cispo, gk_sapo);
#   2. optionally, the LM-head log-prob / entropy kernel: verl's fused-kernel path
#      (use_fused_kernels=True, impl_backend=triton) with GRPO_KERNELS_VERL_LINEAR_CE=1 in every
#      Ray worker, which replaces verl's linear_cross_entropy with grpo_kernels'.
# Remove them to run verl's own code on the same settings.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    trainer.logger='["console"]' \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 \
    actor_rollout_ref.actor.policy_loss.loss_mode=gk_vanilla \
    actor_rollout_ref.model.use_fused_kernels=True \
    actor_rollout_ref.model.fused_kernel_options.impl_backend=triton \
    +ray_kwargs.ray_init.runtime_env.env_vars.GRPO_KERNELS_VERL_LINEAR_CE='"1"' \
    "$@"
