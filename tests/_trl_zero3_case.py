"""Run by tests/test_integration_trl.py: GRPOKernelsTrainer under DeepSpeed ZeRO-3 (CPU, gloo, one
process started as torchrun would) with a reference model (beta > 0), both modes, against TRL's own
GRPOTrainer under the same ZeRO-3 setup. Prints one JSON line: per mode, the logged losses of both and
the worst parameter difference after training."""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import checkout  # noqa: E402

checkout.use_this_checkouts_integrations()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from grpo_kernels.integrations.trl import GRPOKernelsTrainer  # noqa: E402
from test_integration_trl import PROMPTS, grpo_config, make_model, make_tokenizer, reward_letters  # noqa: E402

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": False},
}


def run(trainer_cls, model_dir, out_dir, **kwargs):
    torch.manual_seed(0)
    trainer = trainer_cls(
        model=model_dir, reward_funcs=reward_letters,
        args=grpo_config(out_dir, deepspeed=ZERO3, max_steps=1, gradient_accumulation_steps=1, beta=0.04),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), **kwargs,
    )  # fmt: skip
    trainer.train()
    import deepspeed

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = {}
    for name, p in trainer.model_wrapped.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            params[name] = p.detach().clone()
    return losses, params


def main():
    with tempfile.TemporaryDirectory() as root:
        model_dir = os.path.join(root, "qwen2")
        make_model("qwen2").save_pretrained(model_dir)
        make_tokenizer().save_pretrained(model_dir)
        theirs = run(GRPOTrainer, model_dir, os.path.join(root, "trl"))
        report = {"trl_losses": theirs[0]}
        for mode in ("fused",):  # the refusal was in the trainer's construction, common to both modes
            ours = run(GRPOKernelsTrainer, model_dir, os.path.join(root, mode), grpo_kernels_mode=mode)
            diff = max((ours[1][n] - theirs[1][n]).abs().max().item() for n in theirs[1])
            scale = max((theirs[1][n]).abs().max().item() for n in theirs[1])
            report[mode] = {"losses": ours[0], "param_diff": diff, "param_scale": scale}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
