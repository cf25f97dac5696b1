"""`grpo-kernels train`: one --option per TrainConfig field (help text from the field's comment),
--preset, repeated KEY=VALUE options for the loss / advantage / hook, and --resume RUN_DIR.

Exit status: 0 done, 2 bad input (unknown preset or option, missing model, bad config, a task or model
the checks before the run refuse, no intact checkpoint to resume, a run folder another process holds), 1 a
failure during the run (a reward function that raises or returns NaN, a write that fails, a divergence),
128 + the signal's number when stopped by one after writing what it keeps: 130 Ctrl-C (SIGINT), 143 SIGTERM,
138 SIGUSR1 (the status a shell reports for a process killed by that signal, which schedulers read as
"terminated by the signal": SLURM requeues a preempted job, Kubernetes restarts the container).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import shlex
import signal
import sys

from .config import BACKENDS, DEVICES, DTYPES, HOOKS, PRESETS, ROLLOUT_ENGINES, VLLM_DTYPES, TrainConfig

CHOICES = {
    "device": DEVICES,
    "dtype": DTYPES,
    "backend": BACKENDS,
    "rollout_engine": ROLLOUT_ENGINES,
    "vllm_dtype": VLLM_DTYPES,
    "hook": [h for h in HOOKS if h is not None],
}
OPTION_DICTS = {
    "loss_options": "--loss-option",
    "advantage_options": "--advantage-option",
    "hook_options": "--hook-option",
}


def _field_comments() -> dict[str, str]:
    """TrainConfig's field comments (`name: type = default  # comment`), the single source of help text."""
    comments = {}
    for line in inspect.getsource(TrainConfig).splitlines():
        match = re.match(r"\s+(\w+): [^=]+=.*?#\s*(.*)$", line)
        if match:
            comments[match.group(1)] = match.group(2).replace("%", "%%")
    return comments


def _value_parser(annotation: str):
    optional = "None" in annotation
    base = annotation.replace("| None", "").strip()
    convert = {"int": int, "float": float, "str": str}[base]

    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        return convert(text)

    parse.__name__ = base  # argparse names the type in its error messages
    return parse


def _key_value(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)  # numbers, true / false / null, quoted strings
    except json.JSONDecodeError:
        value = raw  # a bare word: a string
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-kernels train",
        description="Train a causal LM with a GRPO-family method on a verifiable task. With no options: the "
        "embedded tiny Llama learns the built-in 'copy' task on CPU in a few minutes.",
        epilog="On a shared cluster: one process per run folder (RUN_DIR/run.lock names the holder). SIGTERM or "
        "SIGUSR1 stops the run: a step whose updates have not started is abandoned at once (resume redoes it), "
        "else its updates finish; then a checkpoint is written, the --resume command printed, and the exit "
        "status is 128 + the signal (143 SIGTERM, 138 SIGUSR1; 130 Ctrl-C). Give the scheduler a grace period "
        "of one step's updates plus one checkpoint write (step_time_s in metrics.jsonl is a step's whole time, "
        "an upper bound), e.g. SLURM #SBATCH --signal=TERM@120 --requeue, Kubernetes "
        "terminationGracePeriodSeconds: 120. Exit status: 0 done, 1 failure during the run, 2 bad input.",
    )
    parser.add_argument(
        "--preset", default=argparse.SUPPRESS, choices=sorted(PRESETS),
        help="algorithm preset (fills the fields below; default: grpo)",
    )  # fmt: skip
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=argparse.SUPPRESS,
        help="continue RUN_DIR from its last intact checkpoint, with its config.json (only --steps and --lr "
        "may change)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    comments = _field_comments()
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        if field.name == "preset":
            continue
        common = {"dest": field.name, "default": argparse.SUPPRESS}  # only options given on the command line
        help_text = f"{comments.get(field.name, '')} (default: {getattr(defaults, field.name)})"
        if field.name in OPTION_DICTS:
            help_text = f"{comments.get(field.name, '')} (repeatable; VALUE is JSON or a bare string)"
            parser.add_argument(
                OPTION_DICTS[field.name],
                metavar="KEY=VALUE",
                type=_key_value,
                action="append",
                help=help_text,
                **common,
            )
        elif field.type == "bool":
            flag = "--" + field.name.replace("_", "-")
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, **common)
        else:
            flag = "--" + field.name.replace("_", "-")
            value_type, choices = _value_parser(field.type), CHOICES.get(field.name)
            parser.add_argument(flag, type=value_type, choices=choices, help=help_text, **common)
    return parser


# options a resume may change: the run's length, and its learning rate (to go back to the last checkpoint with a
# lower one after a divergence; the rate is constant after warmup, so a change applies from the next step on)
RESUME_OPTIONS = ("steps", "lr")


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, bool]:
    """(config, resume) from parsed arguments: the preset, then the options given on the command line."""
    given = {k: v for k, v in vars(args).items() if k not in ("preset", "resume", "no_progress")}
    if hasattr(args, "resume"):
        extra = sorted(set(given) - set(RESUME_OPTIONS))
        if extra or hasattr(args, "preset"):  # the run's preset is in its config.json, even --preset grpo
            flags = ["--" + k.replace("_", "-") for k in extra] + (["--preset"] if hasattr(args, "preset") else [])
            raise ValueError(
                f"--resume uses the run's own config.json; only --steps and --lr may be given (got {flags})"
            )
        path = os.path.join(args.resume, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"cannot resume {args.resume!r}: no config.json there")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise ValueError(f"a JSON {type(data).__name__}, not an object")
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(
                f"cannot resume {args.resume!r}: {path} is not a valid run config ({exc}); each checkpoint's "
                "state.json holds the run's settings under \"config\": restore config.json from it"
            ) from None
        config = TrainConfig.from_json_dict(data)
        return config.replace(run_dir=args.resume, **given), True
    base = TrainConfig.from_preset(getattr(args, "preset", "grpo"))
    for name in OPTION_DICTS:
        if name in given:  # KEY=VALUE pairs extend the preset's own options
            given[name] = {**getattr(base, name), **dict(given[name])}
    return base.replace(**given), False


def join_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--lr -1e-3` as `--lr=-1e-3`: argparse reads a value that starts with '-' as an option unless it is a
    plain negative integer or decimal ('-1e-3', '-inf' are not), and stops with 'expected one argument'. A
    value option followed by a number (any form float() reads) gets it as its value, which the config then
    checks like any other (`lr must be > 0, got -0.001`)."""
    takes_value = {flag for action in parser._actions if action.nargs is None and action.option_strings
                   and not isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction))
                   for flag in action.option_strings}  # fmt: skip
    joined, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token in takes_value and i + 1 < len(argv) and argv[i + 1].startswith("-") and _is_number(argv[i + 1]):
            joined.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        joined.append(token)
        i += 1
    return joined


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# what the `train` extra installs (pyproject.toml), by import name: needed to train, not for --help
TRAIN_EXTRA_MODULES = ("transformers", "safetensors", "matplotlib", "tqdm")
INSTALL_TRAIN_EXTRA = 'pip install -e ".[train]" (from a clone; or pip install "grpo-kernels[train]")'


def missing_train_extra() -> list[str]:
    """The train extra's modules that do not import here."""
    import importlib

    missing = []
    for name in TRAIN_EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(join_negative_values(parser, argv))  # unknown options and bad values: usage + exit 2
    try:
        config, resume = config_from_args(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"grpo-kernels train: error: {exc}", file=sys.stderr)
        return 2
    missing = missing_train_extra()
    if missing:
        print(f"grpo-kernels train: error: training needs the `train` extra ({', '.join(missing)} not installed): "
              f"{INSTALL_TRAIN_EXTRA}", file=sys.stderr)  # fmt: skip
        return 2
    from .trainer import TrainingError, TrainingInterrupted, train
    try:
        train(config, resume=resume, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"grpo-kernels train: error: {exc}", file=sys.stderr)
        return 2
    except TrainingError as exc:
        print(f"grpo-kernels train: error: {exc}", file=sys.stderr)
        return 1
    except TrainingInterrupted as stop:
        how = "interrupted" if stop.signal == signal.SIGINT else f"stopped by {signal.Signals(stop.signal).name}"
        if stop.step > 0:
            where = (f"checkpoint at step {stop.step}; continue with: grpo-kernels train --resume "
                     f"{shlex.quote(stop.run_dir)}")  # fmt: skip
        elif stop.discarded or stop.run_dir is None or not os.path.isdir(stop.run_dir):
            removed = f" (the run folder {stop.run_dir} was removed)" if stop.discarded else ""
            where = f"no step completed, nothing to keep{removed}: run the same command again to start it"
        else:
            where = f"no checkpoint was written, nothing to resume ({stop.run_dir} holds no checkpoint)"
        print(f"\n{how}; {where}", file=sys.stderr)
        return 128 + stop.signal
    except KeyboardInterrupt:  # before the run folder existed (model loading)
        print("\ninterrupted before the first step", file=sys.stderr)
        return 130
    return 0
