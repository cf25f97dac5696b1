"""Run TRL's own GRPO trainer tests twice, with TRL's `GRPOTrainer` and with `GRPOKernelsTrainer` swapped in,
and compare the outcome of every test.

    python tools/suites/trl_suite.py --trl-tests PATH/TO/trl/tests [--out trl_suite_run] [-k EXPR]

TRL's tests are not part of its wheel: give the `tests/` folder of a TRL checkout (the version the installed
`trl` was cut from, or near it). Nothing is downloaded: the hub repos the tests load
(`trl-internal-testing/tiny-*` models and the `zen` prompt datasets) are replaced by stand-ins built here,
in code, under `--out` (tiny models of the same classes with a byte-level tokenizer, the chat template
of the model's family as the installed TRL ships it, else ChatML; a Gemma 3 vision-language model with
its processor; the Zen-of-Python prompts, with an image each for `zen-image`), and the runs are offline
(`HF_HUB_OFFLINE=1`). Repos without a stand-in (the vision-language models other than Gemma 3, remote
code, a few architectures) fail the same way in both runs and are listed as such.

The swapped run imports `GRPOKernelsTrainer as GRPOTrainer` right after the test file's own
`from trl import ... GRPOTrainer ...` (the README's one-line change) in its default `fused` mode, and
counts the calls of `gk.fused_linear_grpo_loss` per test, so the record shows which passing tests trained
through the fused loss. Names the test helpers import from `trl.import_utils` that the installed TRL no
longer has are defined as "not available" (their tests skip). On a machine without CUDA, liger-kernel is
hidden from both runs: its Triton kernels need a GPU, and a test that patches a model class with them
would break every later test.

Writes `OUT/trl_suite.json` (versions, the tests' source, per-test outcomes of both runs, the first error
line of each failure, the fused-loss calls, the tests whose outcome differs) and prints a summary. Exit
status 1 when any test's outcome differs between the runs, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SWAP_LINE = "from grpo_kernels.integrations.trl import GRPOKernelsTrainer as GRPOTrainer  # the swap\n"
TEST_FILE = "test_grpo_trainer.py"
HELPERS = ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py")

# --------------------------------------------------------------------------------------------------------
# the source transforms (pure text: unit-tested)
# --------------------------------------------------------------------------------------------------------


def swap_trainer(source: str) -> str:
    """Insert the swap after the test file's `from trl import ...` statement that names GRPOTrainer
    (a one-line or parenthesised import). Raises ValueError when there is none."""
    pattern = re.compile(r"^from trl import (\([^)]*\)|[^\n(]*)\n", re.M)
    for match in pattern.finditer(source):
        if re.search(r"\bGRPOTrainer\b", match.group(1)):
            return source[: match.end()] + SWAP_LINE + source[match.end() :]
    raise ValueError("no `from trl import ... GRPOTrainer` line in the test file: nothing to swap")


def shim_missing_imports(source: str, available: set[str]) -> tuple[str, list[str]]:
    """Drop the names of `from trl.import_utils import (...)` the installed TRL lacks, defining each as a
    function that returns False (its tests skip). Returns the new source and the names shimmed."""
    match = re.search(r"^from trl\.import_utils import \(([^)]*)\)\n", source, re.M)
    if match is None:
        match = re.search(r"^from trl\.import_utils import ([^\n(]*)\n", source, re.M)
    if match is None:
        return source, []
    names = [n.strip() for n in match.group(1).replace("\n", ",").split(",") if n.strip()]
    missing = [n for n in names if n not in available]
    if not missing:
        return source, []
    kept = [n for n in names if n in available]
    new = (f"from trl.import_utils import ({', '.join(kept)})\n" if kept else "")
    new += "".join(f"\n\ndef {n}():  # not in the installed trl: its tests skip\n    return False\n" for n in missing)
    return source[: match.start()] + new + "\n" + source[match.end() :], missing


# --------------------------------------------------------------------------------------------------------
# stand-ins for the hub repos
# --------------------------------------------------------------------------------------------------------

# 4096 embedding rows, more than the tokenizer's 263 ids (as in Qwen2.5: 151936 rows, 151665 ids). Not
# Qwen's 151936: at that width TRL's chunked log-prob kernel ran 29 of the 175 tests in 13 minutes on CPU.
# So the tests whose mocked generations are written in Qwen2.5's token ids fail both ways.
STANDIN_VOCAB_ROWS = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# repo name -> (config class, model class, config extras); hidden 16, 2 layers, 4 heads
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
STANDIN_MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "tiny-Qwen2ForSequenceClassification-2.5": ("Qwen2Config", "Qwen2ForSequenceClassification", {"num_labels": 1}),
    "tiny-Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 4}),
    "tiny-Qwen3ForSequenceClassification": ("Qwen3Config", "Qwen3ForSequenceClassification",
                                            {"head_dim": 4, "num_labels": 1}),
    "tiny-Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 4, **_MOE}),
    "tiny-LlamaForCausalLM-3.2": ("LlamaConfig", "LlamaForCausalLM", {}),
    "tiny-LlamaForSequenceClassification-3.2": ("LlamaConfig", "LlamaForSequenceClassification", {"num_labels": 1}),
    "tiny-MistralForCausalLM-0.2": ("MistralConfig", "MistralForCausalLM", {}),
    "tiny-Gemma2ForCausalLM": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 4}),  # soft-capped logits
    "tiny-Cohere2ForCausalLM": ("Cohere2Config", "Cohere2ForCausalLM", {}),  # logit_scale
}
# the Zen of Python, cut as TRL's prompt-only dataset cuts it (its tests check the first twelve in order)
ZEN_PROMPTS = [
    "Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
    "Sparse is better", "Readability", "Special cases aren't special", "Although practicality beats",
    "Errors should never", "Unless explicitly", "In the face of ambiguity, refuse", "There should be one",
    "Although that way may not be", "Now is better than", "Although never is often better than",
    "If the implementation is hard to explain,", "If the implementation is easy to explain,",
    "Namespaces are one honking great idea",
]
ZEN_TRAIN_ROWS = 17


# the chat template of a stand-in: the installed TRL's own copy of its family's template where TRL ships one
# (TRL recognises these for tool calling), else CHATML
FAMILY_TEMPLATE = {"Qwen2": "qwen2_5.jinja", "Qwen3": "qwen3.jinja", "Qwen3Moe": "qwen3.jinja"}


def family_chat_template(model_class: str) -> str:
    import importlib.resources

    name = FAMILY_TEMPLATE.get(model_class.split("For")[0])
    if name is not None:
        shipped = importlib.resources.files("trl") / "chat_templates" / name
        if shipped.is_file():
            return shipped.read_text()
    return CHATML


def byte_level_core(special_tokens: list[str]):
    """A byte-level BPE without merges (any text round-trips: 256 byte symbols), then `special_tokens`.
    Returns the tokenizers.Tokenizer and its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in special_tokens:
        vocab[token] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return core, vocab


def standin_tokenizer():
    """The byte-level tokenizer with ChatML's special tokens (Qwen's names) and a ChatML template."""
    from transformers import PreTrainedTokenizerFast

    core, _ = byte_level_core(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=SPECIAL_TOKENS[1:])
    tokenizer.chat_template = CHATML
    return tokenizer


GEMMA3_VLM = "tiny-Gemma3ForConditionalGeneration"
STANDIN_REPOS = (*STANDIN_MODELS, GEMMA3_VLM)  # what --models may name
GEMMA3_TOKENS = ["<pad>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                 "<image_soft_token>"]
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_prompt_dataset(path: Path, configs: dict) -> None:
    """A local dataset repo: for each config name, `make(prompts) -> datasets.Dataset` of the Zen prompts'
    train and test splits, as parquet files, with the card that names them."""
    card = ["---", "configs:"]
    for name, make in configs.items():
        (path / name).mkdir(parents=True, exist_ok=True)
        card += [f"- config_name: {name}", "  data_files:"]
        for split, prompts in {"train": ZEN_PROMPTS[:ZEN_TRAIN_ROWS], "test": ZEN_PROMPTS[ZEN_TRAIN_ROWS:]}.items():
            make(prompts).to_parquet(path / name / f"{split}.parquet")
            card += [f"  - split: {split}", f"    path: {name}/{split}.parquet"]
    (path / "README.md").write_text("\n".join(card + ["---", ""]))


def zen_datasets(org: Path) -> None:
    """`zen` (standard and conversational prompts) and `zen-image` (conversational, a 28 x 28 image each)."""
    import datasets
    import numpy as np
    from PIL import Image

    def chat(prompt, image=False):
        text = {"type": "text", "text": prompt}
        return [{"role": "user", "content": [{"type": "image"}, text] if image else prompt}]

    rng = np.random.default_rng(0)
    image_features = datasets.Features({"prompt": [{"role": datasets.Value("string"), "content": [
        {"type": datasets.Value("string"), "text": datasets.Value("string")}]}], "image": datasets.Image()})
    write_prompt_dataset(org / "zen", {
        "standard_prompt_only": lambda ps: datasets.Dataset.from_dict({"prompt": ps}),
        "conversational_prompt_only": lambda ps: datasets.Dataset.from_dict({"prompt": [chat(p) for p in ps]}),
    })
    write_prompt_dataset(org / "zen-image", {"conversational_prompt_only": lambda ps: datasets.Dataset.from_dict({
        "prompt": [chat(p, image=True) for p in ps],
        "image": [Image.fromarray(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)) for _ in ps],
    }, features=image_features)})


def build_gemma3_vlm(path: Path) -> None:
    """Gemma 3 with images: a SigLIP tower (28 x 28 images, 16 patches pooled to 4 image tokens), a
    soft-capped Gemma 3 language model whose sliding window spans every prompt (the completion sees the
    image), its processor (the byte-level tokenizer with Gemma's turn and image tokens)."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    core, vocab = byte_level_core(GEMMA3_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<end_of_turn>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    )  # fmt: skip
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessor(size={"height": 28, "width": 28}), tokenizer=tokenizer,
        chat_template=GEMMA3_TEMPLATE, image_seq_length=4,
    )  # fmt: skip
    text = dict(vocab_size=STANDIN_VOCAB_ROWS, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=512,
                sliding_window=512, pad_token_id=vocab["<pad>"], bos_token_id=vocab["<bos>"],
                eos_token_id=vocab["<end_of_turn>"])  # fmt: skip
    # Gemma 3 reads the patch features: no pooling head (its parameters would get no gradient)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=7, vision_use_head=False)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=vocab["<start_of_image>"],
        eoi_token_index=vocab["<end_of_image>"], image_token_index=vocab["<image_soft_token>"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(path)
    processor.save_pretrained(path)


def build_standins(root: Path, models: list[str] | None = None, log=print) -> dict:
    """Write `root/trl-internal-testing/<repo>` for each stand-in model (all by default) and the `zen` /
    `zen-image` datasets. Returns {repo: "built" | the reason it could not be built}."""
    import datasets
    import torch
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    org = root / "trl-internal-testing"
    tokenizer = standin_tokenizer()
    common = dict(vocab_size=STANDIN_VOCAB_ROWS, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.pad_token_id)
    built = {}
    for repo in [m for m in models if m in STANDIN_MODELS] if models is not None else list(STANDIN_MODELS):
        config_class, model_class, extra = STANDIN_MODELS[repo]
        try:
            torch.manual_seed(0)
            model = getattr(transformers, model_class)(getattr(transformers, config_class)(**common, **extra))
            model.save_pretrained(org / repo)
            tokenizer.chat_template = family_chat_template(model_class)
            tokenizer.save_pretrained(org / repo)
            built[repo] = "built"
        except Exception as error:  # this transformers lacks the class: its tests fail both ways
            built[repo] = f"{type(error).__name__}: {error}"
        log(f"  stand-in {repo}: {built[repo]}")
    if models is None or GEMMA3_VLM in models:
        try:
            build_gemma3_vlm(org / GEMMA3_VLM)
            built[GEMMA3_VLM] = "built"
        except Exception as error:
            built[GEMMA3_VLM] = f"{type(error).__name__}: {error}"
        log(f"  stand-in {GEMMA3_VLM}: {built[GEMMA3_VLM]}")
    zen_datasets(org)
    built["zen"] = built["zen-image"] = "built"
    return built


# --------------------------------------------------------------------------------------------------------
# the two runs
# --------------------------------------------------------------------------------------------------------

ROOT_CONFTEST = '''import json, os, sys
{hide_liger}
SWAPPED = {swapped}
if SWAPPED:  # count the fused loss's calls per test
    import grpo_kernels as gk

    CALLS, _fused = {{}}, gk.fused_linear_grpo_loss

    def _counting(*args, **kwargs):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        CALLS[test] = CALLS.get(test, 0) + 1
        return _fused(*args, **kwargs)

    gk.fused_linear_grpo_loss = _counting

    def pytest_sessionfinish(session):
        with open("fused_calls.json", "w") as f:
            json.dump(CALLS, f, indent=1)
'''
HIDE_LIGER = ('sys.modules["liger_kernel"] = None  # no CUDA: its Triton kernels cannot run, and a test that '
              "patches a model class with them breaks every later test")


def prepare_run(work: Path, trl_tests: Path, standins: Path, *, swapped: bool, hide_liger: bool) -> list[str]:
    """work/tests/ (the test file and its helpers), work/conftest.py, work/trl-internal-testing -> stand-ins.
    Returns the helper names shimmed."""
    import importlib

    import_utils = importlib.import_module("trl.import_utils")  # `trl` is a lazy module: no attribute access
    if work.exists():
        shutil.rmtree(work)
    (work / "tests").mkdir(parents=True)
    for name in HELPERS + (TEST_FILE,):
        if (trl_tests / name).exists():
            shutil.copy(trl_tests / name, work / "tests" / name)
    if (trl_tests / "data").is_dir():
        shutil.copytree(trl_tests / "data", work / "tests" / "data")
    (work / "tests" / "__init__.py").touch()
    shimmed = []
    helpers = work / "tests" / "testing_utils.py"
    if helpers.exists():
        text, shimmed = shim_missing_imports(helpers.read_text(), set(dir(import_utils)))
        helpers.write_text(text)
    if swapped:
        test_file = work / "tests" / TEST_FILE
        test_file.write_text(swap_trainer(test_file.read_text()))
    (work / "conftest.py").write_text(ROOT_CONFTEST.format(hide_liger=HIDE_LIGER if hide_liger else "", swapped=swapped))
    (work / "trl-internal-testing").symlink_to(standins / "trl-internal-testing", target_is_directory=True)
    return shimmed


def outcomes(junit: Path) -> dict[str, dict]:
    """test id -> {"outcome": passed | failed | skipped | xfailed, "error": first line of the failure}."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = case.get("classname").split(".")[-1] + "::" + case.get("name")
        entry = {"outcome": "passed"}
        for child in case:
            if child.tag in ("failure", "error"):
                message = (child.get("message") or child.text or "").strip().splitlines()
                entry = {"outcome": "failed", "error": message[0][:300] if message else ""}
            elif child.tag == "skipped":
                entry = {"outcome": "xfailed" if "xfail" in (child.get("type") or "") else "skipped",
                         "reason": (child.get("message") or "")[:200]}
        result[test] = entry
    return result


def _progress(log: Path) -> str:
    """Tests finished so far, from pytest -q's progress characters."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = re.findall(r"^([.FEsxX]+)(?: +\[\s*\d+%\])?$", text, re.M)
    return f"{sum(len(line) for line in lines)} tests done"


def run_both(runs: dict[str, Path], pytest_args: list[str], env: dict, log=print) -> dict[str, int]:
    """The two pytest runs side by side (one core each), with a progress line every 20 s."""
    procs = {}
    for name, work in runs.items():
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/{TEST_FILE}",
               "--junitxml=junit.xml", "-rfE", *pytest_args]
        procs[name] = subprocess.Popen(cmd, cwd=work, env=env, stdout=open(work / "pytest.log", "w"),
                                       stderr=subprocess.STDOUT)
    start = time.monotonic()
    while any(p.poll() is None for p in procs.values()):
        time.sleep(1)
        if time.monotonic() - start >= 20 and any(p.poll() is None for p in procs.values()):
            start = time.monotonic()
            log("  " + ", ".join(f"{n} {_progress(runs[n] / 'pytest.log')}" for n in runs))
    return {name: p.returncode for name, p in procs.items()}


# what an offline load of a hub repo without a stand-in raises (transformers, huggingface_hub, datasets)
NO_STANDIN = re.compile(r"OfflineModeIsEnabled|LocalEntryNotFoundError|couldn't connect to 'https://huggingface.co'|"
                        r"outgoing traffic has been disabled|Couldn't reach '")


def compare(stock: dict, swapped: dict, fused_calls: dict) -> dict:
    counts = {side: {} for side in ("stock", "swapped")}
    for side, result in (("stock", stock), ("swapped", swapped)):
        for entry in result.values():
            counts[side][entry["outcome"]] = counts[side].get(entry["outcome"], 0) + 1
    differ = sorted(t for t in set(stock) | set(swapped)
                    if stock.get(t, {}).get("outcome") != swapped.get(t, {}).get("outcome"))
    calls = {}
    for key, n in fused_calls.items():  # PYTEST_CURRENT_TEST: tests/test_grpo_trainer.py::Class::test[params]
        test = "::".join(key.split("::")[1:])
        calls[test] = calls.get(test, 0) + n
    def both(outcome):
        return [t for t in stock if stock[t]["outcome"] == outcome == swapped.get(t, {}).get("outcome")]

    passed_both, failed_both = both("passed"), both("failed")
    no_standin = [t for t in failed_both if NO_STANDIN.search(stock[t].get("error", ""))]
    return dict(
        counts=counts,
        differ=[dict(test=t, stock=stock.get(t), swapped=swapped.get(t)) for t in differ],
        failed_both=len(failed_both),
        failed_both_no_standin=no_standin,  # the test loads a hub repo this harness has no stand-in for
        failed_both_otherwise=sorted(set(failed_both) - set(no_standin)),
        passed_both=len(passed_both),
        passed_both_through_fused_loss=sum(1 for t in passed_both if calls.get(t, 0) > 0),
        fused_loss_calls=calls,
    )


def _git_sha(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-tests", type=Path, required=True, help="the tests/ folder of a TRL checkout")
    parser.add_argument("--trl-ref", help="what the tests are (e.g. a TRL commit); default: the folder's git HEAD")
    parser.add_argument("--out", type=Path, default=Path("trl_suite_run"), help="work folder (replaced)")
    parser.add_argument("--models", help="comma-separated stand-ins to build (default: all)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (default: every test)")
    args = parser.parse_args(argv)

    if not (args.trl_tests / TEST_FILE).is_file():
        parser.error(f"{args.trl_tests / TEST_FILE} does not exist: --trl-tests must be TRL's tests/ folder")
    unknown = [m for m in (args.models or "").split(",") if m and m not in STANDIN_REPOS]
    if unknown:
        parser.error(f"no stand-in for {unknown}; known: {sorted(STANDIN_REPOS)}")
    try:
        swap_trainer((args.trl_tests / TEST_FILE).read_text())
    except ValueError as error:
        parser.error(str(error))

    import torch
    import transformers
    import trl

    import grpo_kernels

    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}; "
          f"tests from {args.trl_tests}")
    print("building the stand-ins")
    models = [m for m in args.models.split(",") if m] if args.models else None
    standins = build_standins(out, models)
    hide_liger = not torch.cuda.is_available()
    shimmed = []
    runs = {"stock": out / "stock", "swapped": out / "swapped"}
    for name, work in runs.items():
        shimmed = prepare_run(work, args.trl_tests.resolve(), out, swapped=name == "swapped", hide_liger=hide_liger)
    # a datasets cache of this run's own: a cache of another `trl-internal-testing/zen` is not read
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(out / "datasets_cache"), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    print("running TRL's tests: stock and swapped, side by side")
    started = time.monotonic()
    codes = run_both(runs, ["-k", args.keyword] if args.keyword else [], env)
    seconds = round(time.monotonic() - started)
    if not all((work / "junit.xml").exists() for work in runs.values()):
        tails = {n: (w / "pytest.log").read_text()[-2000:] for n, w in runs.items()}
        print(f"a run wrote no results (exit codes {codes}):\n" + "\n".join(f"--- {n}\n{t}" for n, t in tails.items()))
        return 2
    fused_file = runs["swapped"] / "fused_calls.json"
    stock, swapped = (outcomes(runs[side] / "junit.xml") for side in ("stock", "swapped"))
    result = compare(stock, swapped, json.loads(fused_file.read_text()) if fused_file.exists() else {})
    record = dict(
        trl_tests=dict(ref=args.trl_ref or _git_sha(args.trl_tests), file=TEST_FILE, keyword=args.keyword),
        versions=dict(trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__,
                      python=sys.version.split()[0], grpo_kernels=grpo_kernels.__version__),
        grpo_kernels_git_sha=_git_sha(Path(__file__).resolve().parent),
        cuda=torch.cuda.is_available(), liger_hidden=hide_liger, shimmed_helpers=shimmed,
        standins=standins, seconds=seconds, **result, stock=stock, swapped=swapped,
    )
    (out / "trl_suite.json").write_text(json.dumps(record, indent=1) + "\n")
    c = result["counts"]
    print(f"stock:   {c['stock']}\nswapped: {c['swapped']}  ({seconds} s)")
    print(f"passed both ways: {result['passed_both']}, {result['passed_both_through_fused_loss']} of them through "
          f"the fused loss")
    for d in result["differ"]:
        print(f"DIFFERS {d['test']}: stock {d['stock']}, swapped {d['swapped']}")
    print(f"record: {out / 'trl_suite.json'}")
    return 1 if result["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
