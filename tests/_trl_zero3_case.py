"""Run by tests/test_integration_trl.py: GRPOKernelsTrainer under DeepSpeed ZeRO-3 (CPU, gloo, one
process started as torchrun would) with a reference model (beta > 0), both modes, against TRL's own
GRPOTrainer under the same ZeRO-3 setup and without DeepSpeed; two optimizer steps of two micro-batches.
Prints one JSON line: TRL's logged losses (ZeRO-3 and plain), how far TRL's steps moved the LM head and
how far that differs from the plain run; per mode, the logged losses, the worst parameter difference to
TRL's ZeRO-3 run after training, how far the head moved, whether the head is partitioned outside the
forward (numel 0) after training, and in "logprobs" mode, for every backward of the adapter's head, the
weight's numel when that backward starts and inside its gather (maybe_gather_lm_head_ctx)."""

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

import grpo_kernels.integrations.trl as gk_trl  # noqa: E402
from grpo_kernels.integrations.trl import GRPOKernelsTrainer  # noqa: E402
from test_integration_trl import PROMPTS, grpo_config, make_model, make_tokenizer, reward_letters  # noqa: E402

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": False},
}
HEAD = "lm_head.weight"
backwards = []  # per backward of the logprobs head: (numel of the weight on entry, numel inside the gather)


def _recording_backward(backward):
    def wrapped(ctx, *grads):
        entry = ctx.weight.numel()
        gather = ctx.gather

        def recording_gather(*params):
            context = gather(*params)

            class Recorder:
                def __enter__(self):
                    value = context.__enter__()
                    backwards.append((entry, ctx.weight.numel()))
                    return value

                def __exit__(self, *exc):
                    return context.__exit__(*exc)

            return Recorder()

        ctx.gather = recording_gather
        return backward(ctx, *grads)

    return staticmethod(wrapped)


_head = gk_trl._LogProbsWithGatheredBackward
_head.backward = _recording_backward(_head.backward)


def run(trainer_cls, model_dir, out_dir, zero3=True, **kwargs):
    torch.manual_seed(0)
    ds = dict(deepspeed=ZERO3) if zero3 else {}
    trainer = trainer_cls(
        model=model_dir, reward_funcs=reward_letters,
        args=grpo_config(out_dir, max_steps=2, gradient_accumulation_steps=2, beta=0.04, **ds),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), **kwargs,
    )  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if not zero3:
        return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, False
    import deepspeed

    module = trainer.model_wrapped.module
    head_partitioned = dict(module.named_parameters())[HEAD].numel() == 0  # outside any forward
    params = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            params[name] = p.detach().clone()
    return losses, params, head_partitioned


def main():
    with tempfile.TemporaryDirectory() as root:
        model_dir = os.path.join(root, "qwen2")
        model = make_model("qwen2")
        initial_head = model.get_output_embeddings().weight.detach().clone()
        model.save_pretrained(model_dir)
        make_tokenizer().save_pretrained(model_dir)
        theirs = run(GRPOTrainer, model_dir, os.path.join(root, "trl"))
        plain = run(GRPOTrainer, model_dir, os.path.join(root, "trl-plain"), zero3=False)
        report = {
            "trl_losses": theirs[0],
            "trl_plain_losses": plain[0],
            "trl_plain_head_diff": (theirs[1][HEAD] - plain[1][HEAD]).abs().max().item(),
            "trl_head_moved": (theirs[1][HEAD] - initial_head).abs().max().item(),
            "trl_head_partitioned": theirs[2],
        }
        for mode in gk_trl.MODES:
            backwards.clear()
            ours = run(GRPOKernelsTrainer, model_dir, os.path.join(root, mode), grpo_kernels_mode=mode)
            diff = max((ours[1][n] - theirs[1][n]).abs().max().item() for n in theirs[1])
            scale = max((theirs[1][n]).abs().max().item() for n in theirs[1])
            report[mode] = {
                "losses": ours[0], "param_diff": diff, "param_scale": scale, "head_partitioned": ours[2],
                "head_moved": (ours[1][HEAD] - initial_head).abs().max().item(),
                "gathered_backwards": [list(b) for b in backwards],
            }  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
