"""GRPO with TRL 1.16.0, its loss on grpo_kernels.

    # a GPU, a Hub model and dataset (bf16; add --use-vllm to generate with vLLM):
    python integrations/examples/trl_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --loss-type dapo
    # any machine, nothing downloaded: a tiny model and tokenizer built here, two steps on CPU
    python integrations/examples/trl_grpo.py --smoke

The line that turns grpo_kernels on is the import of GRPOKernelsTrainer below (`--trl` runs TRL's
own GRPOTrainer instead, to compare). `--grpo-kernels-mode logprobs` keeps TRL's loss code and
moves only the log-prob / entropy computation to grpo_kernels.
"""

from __future__ import annotations

import argparse
import tempfile

from grpo_kernels.integrations.trl import GRPOKernelsTrainer  # <- grpo_kernels on
from trl import GRPOConfig, GRPOTrainer


def reward_length(completions, target_words=20, **kwargs):
    """Completions close to `target_words` words score best (TRL's quickstart reward, in words)."""
    return [-abs(target_words - len(c.split())) / target_words for c in completions]


def reward_letters(completions, **kwargs):
    """The smoke run's reward (its tiny model speaks in the letters a..m): more a's and b's, fewer words."""
    return [c.count("a") + 0.5 * c.count("b") - 0.1 * len(c.split()) for c in completions]


def tiny_model_and_tokenizer(directory: str) -> str:
    """A 2-layer Qwen2 with a 16-word vocabulary and its tokenizer, saved to `directory`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<pad>", "<eos>", "<unk>"] + [chr(ord("a") + i) for i in range(13)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        initializer_range=0.3,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--dataset", default="trl-lib/tldr")
    parser.add_argument(
        "--loss-type", default="dapo", help="any TRL loss_type: grpo, bnpo, dr_grpo, dapo, cispo, ..."
    )
    parser.add_argument(
        "--beta", type=float, default=0.0, help="KL coefficient (> 0 loads a reference model)"
    )
    parser.add_argument("--grpo-kernels-mode", default="fused", choices=["fused", "logprobs"])
    parser.add_argument("--trl", action="store_true", help="run TRL's own GRPOTrainer (the baseline)")
    parser.add_argument("--use-vllm", action="store_true")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--output-dir", default="grpo-kernels-out")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model built here, CPU, two steps, no download"
    )
    args = parser.parse_args()

    if args.smoke:
        from datasets import Dataset

        model = tiny_model_and_tokenizer(tempfile.mkdtemp())
        dataset = Dataset.from_dict({"prompt": ["a b c", "d e", "f g h i", "j k"]})
        config = GRPOConfig(
            output_dir=tempfile.mkdtemp(),
            loss_type=args.loss_type,
            beta=args.beta,
            max_steps=2,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=False,
        )
    else:
        from datasets import load_dataset

        model = args.model
        dataset = load_dataset(args.dataset, split="train")
        config = GRPOConfig(
            output_dir=args.output_dir,
            loss_type=args.loss_type,
            beta=args.beta,
            max_steps=args.max_steps,
            use_vllm=args.use_vllm,
            bf16=True,
            logging_steps=10,
        )

    reward = reward_letters if args.smoke else reward_length
    if args.trl:
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset)
    else:
        trainer = GRPOKernelsTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            grpo_kernels_mode=args.grpo_kernels_mode,
        )
    trainer.train()
    logged = [log for log in trainer.state.log_history if "loss" in log]
    summary = [{k: round(log[k], 4) for k in ("loss", "grad_norm", "reward", "entropy")} for log in logged]
    print(f"{type(trainer).__name__}: trained {trainer.state.global_step} steps: {summary}")


if __name__ == "__main__":
    main()
