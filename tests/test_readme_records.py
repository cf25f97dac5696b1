"""The README's measured figures come from committed records (docs/records/*.json), each written by the
script that measures it; a figure that drifts from its record fails here. Re-measure with the script the
README names, then commit the record and the README together."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys

import pytest
from checkout import CHECKOUT

RECORDS = CHECKOUT / "docs" / "records"
RECORD_SCRIPTS = CHECKOUT / "tools" / "records"


def readme_text() -> str:
    return " ".join((CHECKOUT / "README.md").read_text().split())  # line breaks do not matter


def record_script(name: str):
    """tools/records/<name>.py, the script that writes a record and the README spans from it."""
    if str(RECORD_SCRIPTS) not in sys.path:
        sys.path.insert(0, str(RECORD_SCRIPTS))
    return importlib.import_module(name)


def quiet(*args, **kwargs):
    pass


def assert_prefix_repeats(metrics: list[dict], per_step: dict, steps: int, what: str):
    """The re-run's first steps against the record's: the rewards exactly (the same completions: sampling is
    seeded per group, the model and data deterministic), the losses to fp32 rounding (a loss sums a few
    thousand fp32 terms; another CPU's vector width reorders them: 1e-5 relative is ~100 ulp)."""
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    rewards = [m["reward"] for m in metrics]
    assert rewards == per_step["reward"][:steps], (
        f"{what}: the first {steps} rewards differ from the record: re-run {rewards}, recorded "
        f"{per_step['reward'][:steps]}. The trainer changed the trajectory: re-measure with the record's script"
    )
    for m, recorded in zip(metrics, per_step["loss"]):
        assert abs(m["loss"] - recorded) <= 1e-5 * max(1.0, abs(recorded)) + 1e-7, (what, m["step"], m["loss"],
                                                                                      recorded)  # fmt: skip


def test_main_job_figures_come_from_the_record():
    """The README's main-job figures and random-policy baseline are the record's, as its script writes them."""
    script = record_script("main_job_record")
    spans = record_script("readme_spans")
    record = json.loads((RECORDS / "main_job.json").read_text())
    assert spans.read_span("main-job-figures") == script.figures_sentence(record), (
        "README main-job figures differ from docs/records/main_job.json: run tools/records/main_job_record.py"
    )
    assert spans.read_span("random-policy") == script.random_policy_text(record)
    assert len(record["per_step"]["reward"]) == record["steps"] and record["prefix_steps"] == script.PREFIX_STEPS


def test_main_job_prefix_repeats_the_record(tmp_path):
    """The main job's first steps (a few seconds; CI re-runs all 200 in .ci/steps/records.sh): a change of the
    trajectory shows in the suite too. The run's random-policy baseline (the plot's dashed line) is the
    record's, hence the README's."""
    from grpo_kernels.trainer import TrainConfig, train

    script = record_script("main_job_record")
    record = json.loads((RECORDS / "main_job.json").read_text())
    steps = script.PREFIX_STEPS
    result = train(TrainConfig(steps=steps, run_dir=str(tmp_path / "run")), progress=False, log=quiet)
    assert_prefix_repeats(result.metrics, record["per_step"], steps, "main job")
    assert round(result.random_reward, 4) == record["random_policy_reward"]


def test_records_check_names_the_first_differing_step_and_the_command():
    """records.py --check (CI's full re-run, .ci/steps/records.sh) against the committed records: the records
    themselves pass; a reward changed at one step, or a loss moved beyond fp32 rounding, fails naming that
    step and the command that regenerates records and README spans."""
    import copy

    records = record_script("records")
    main_job = json.loads((RECORDS / "main_job.json").read_text())
    lookup = json.loads((RECORDS / "lookup_turn_credit.json").read_text())
    assert records.check(main_job, lookup)[0] == []
    rounding = copy.deepcopy(main_job)
    rounding["per_step"]["loss"] = [x * (1 + 3e-6) for x in rounding["per_step"]["loss"]]
    assert records.check(rounding, lookup)[0] == []
    moved = copy.deepcopy(main_job)
    moved["per_step"]["reward"][64] += 0.001
    moved["per_step"]["loss"][70] *= 1.001
    problems = records.check(moved, lookup)[0]
    assert len(problems) == 2 and "step 65 reward" in problems[0] and "step 71 loss" in problems[1], problems
    assert records.COMMAND in records.failure_text(problems)
    other = copy.deepcopy(lookup)
    other["runs"]["gigpo"]["per_step"]["reward"][2] = -1.0
    assert records.check(main_job, other)[0] == ["lookup gigpo: step 3 reward -1.0, recorded "
                                                 f"{lookup['runs']['gigpo']['per_step']['reward'][2]!r} (the first step that differs)"]  # fmt: skip


@pytest.fixture(scope="module")
def lookup_record():
    return json.loads((RECORDS / "lookup_turn_credit.json").read_text())


def test_lookup_figures_come_from_the_record(lookup_record):
    script = record_script("lookup_turn_credit")
    spans = record_script("readme_spans")
    assert spans.read_span("lookup-figures") == script.figures_sentence(lookup_record), (
        "README lookup figures differ from the record: run tools/records/lookup_turn_credit.py"
    )


@pytest.mark.parametrize("name", ["grpo", "mt_grpo", "gigpo"])
def test_lookup_prefix_repeats_the_record(name, lookup_record, tmp_path):
    from grpo_kernels.trainer import TrainConfig, train

    script = record_script("lookup_turn_credit")
    fields = script.RUNS[name]
    steps = script.PREFIX_STEPS
    config = TrainConfig.from_preset(fields["preset"], **{k: v for k, v in fields.items() if k != "preset"},
                                     steps=steps, run_dir=str(tmp_path / "run"))  # fmt: skip
    result = train(config, progress=False, log=quiet)
    assert_prefix_repeats(result.metrics, lookup_record["runs"][name]["per_step"], steps, f"lookup {name}")


def test_verl_install_changes_come_from_the_record():
    """The README's sentence on what [verl] changes on top of [train] is generated from a real resolve."""
    script = record_script("verl_install_record")
    spans = record_script("readme_spans")
    record = json.loads((RECORDS / "verl_install.json").read_text())
    assert spans.read_span("verl-install") == script.readme_sentence(record)
    assert record["changed"] and all(c["from"] != c["to"] for c in record["changed"])


def test_unsloth_install_changes_come_from_the_record():
    """The README's sentence on what [unsloth] changes on top of the base install is generated from a real resolve."""
    script = record_script("unsloth_install_record")
    spans = record_script("readme_spans")
    record = json.loads((RECORDS / "unsloth_install.json").read_text())
    assert spans.read_span("unsloth-install") == script.readme_sentence(record)
    assert any(a["name"] == "trl" for a in record["added"])


def readme_test_line(tier: str) -> str:
    """The line .ci/run runs for a test-command marker: the first `pip install` / `python` line after it that
    installs no torch (CI installs its CPU torch itself)."""
    readme = (CHECKOUT / "README.md").read_text()
    after = readme[readme.index(f"<!-- test-command: {tier}") :].splitlines()[1:]
    return next(x for x in after if x.startswith(("pip install", "python")) and not re.match(r"pip install torch[ =]", x))


def test_ci_runs_the_readme_test_lines_with_their_pins():
    """.ci/run takes the README's two test lines as they are: the quick tier (with the pins a newcomer gets)
    then the full suite; CI installs no other Triton or numpy before them, and the CPU torch line the README
    shows first is the torch CI installs."""
    quick, full = readme_test_line("quick"), readme_test_line("full")
    assert '"triton==3.6.0"' in quick and '"numpy<2.3"' in quick and quick.endswith("python -m pytest -q -m quick"), quick
    assert full == "python -m pytest -q", full
    ci = (CHECKOUT / ".ci" / "run").read_text()
    first_env = ci[: ci.index('bash -c "$quick_command"')]
    assert not re.search(r"pip install.*(triton|numpy)", first_env), "CI pins beside the README's test line"
    assert "pip install -q torch==2.13.0" in first_env
    readme = (CHECKOUT / "README.md").read_text()
    block = readme[readme.index("<!-- test-command: quick") :].split("```")[1]
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in block.splitlines()[1]
    # the line-reading rule .ci/run uses (awk) is the one above
    proc = subprocess.run(["bash", "-c", ci[ci.index("readme_line() {") : ci.index("quick_command=")]
                           + 'readme_line quick; readme_line full'], cwd=CHECKOUT, capture_output=True, text=True)  # fmt: skip
    assert proc.stdout.splitlines() == [quick, full], proc.stdout + proc.stderr


def test_test_counts_and_times_come_from_the_record():
    """The README's test-figures span is generated from docs/records/tests.json (tests_record.py), the record
    of passing runs of the two README commands; CI checks its counts against each run (.ci/steps/test_counts.sh)."""
    script = record_script("tests_record")
    spans = record_script("readme_spans")
    record = json.loads((RECORDS / "tests.json").read_text())
    assert spans.read_span("test-figures") == script.readme_sentence(record), (
        f"README test figures differ from docs/records/tests.json: run {script.COMMAND} after a clean-clone .ci/run"
    )
    for tier in ("quick", "full"):
        assert record[tier]["failed"] == 0 and record[tier]["error"] == 0, f"{tier}: the recorded run must pass"


def test_test_count_check_fails_on_other_counts(tmp_path):
    """tests_record.py --check against runs whose counts differ from the record: exit 1 naming the refresh."""
    script = record_script("tests_record")
    record = json.loads((RECORDS / "tests.json").read_text())
    paths = []
    for tier in ("quick", "full"):
        run = dict(record[tier], tests=record[tier]["tests"] + (tier == "full"))
        paths.append(tmp_path / f"{tier}.json")
        paths[-1].write_text(json.dumps(run))
    proc = subprocess.run([sys.executable, str(RECORD_SCRIPTS / "tests_record.py"), "--check", *map(str, paths)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and script.COMMAND in proc.stderr and "full:" in proc.stderr, proc.stderr
    paths[1].write_text(json.dumps(record["full"]))
    proc = subprocess.run([sys.executable, str(RECORD_SCRIPTS / "tests_record.py"), "--check", *map(str, paths)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def trl_suite_sentence(record: dict) -> str:
    """The integrations README's summary of the recorded run of TRL's own GRPO tests (trl_suite.py)."""
    stock = record["counts"]["stock"]
    tests = sum(stock.values())
    skipped = stock.get("skipped", 0) + stock.get("xfailed", 0)
    v = record["versions"]
    return (
        f"TRL's tests at {record['trl_tests']['ref']}, trl {v['trl']}, transformers {v['transformers']}, "
        f"torch {v['torch']}, grpo_kernels at {record['grpo_kernels_git_sha'][:7]}): **{tests} tests, "
        f"{len(record['differ'])} with a different outcome**. {record['passed_both']} pass both ways, "
        f"{record['passed_both_through_fused_loss']} of them training through the fused loss; "
        f"{record['failed_both']} fail both ways ({len(record['failed_both_no_standin'])} load a hub repo that "
        f"has no stand-in, {len(record['failed_both_otherwise'])} fail on TRL's own trainer for the reasons "
        f"below); {skipped} skip both ways"
    )


def test_trl_suite_figures_come_from_the_record():
    record = json.loads((RECORDS / "trl_suite.json").read_text())
    text = " ".join((CHECKOUT / "integrations" / "README.md").read_text().split())
    expected = trl_suite_sentence(record)
    assert expected in text, f"integrations/README.md differs from docs/records/trl_suite.json; expected:\n{expected}"
    assert record["counts"]["stock"] == record["counts"]["swapped"] and not record["differ"], (
        "the recorded run must give every test the same outcome both ways"
    )


def openrlhf_suite_sentence(record: dict) -> str:
    """The integrations README's summary of the recorded run of OpenRLHF's own loss tests
    (openrlhf_suite.py)."""
    stock = record["counts"]["stock"]
    v = record["versions"]
    return (
        f"openrlhf {v['openrlhf']}, transformers {v['transformers']}, deepspeed {v['deepspeed']}, "
        f"torch {v['torch']}, grpo_kernels at {record['grpo_kernels_git_sha'][:7]}): "
        f"**{sum(stock.values())} tests, {stock['passed']} pass stock; with the adapter "
        f"{record['passed_both']} pass both ways ({record['passed_both_through_the_adapter']} of them "
        f"through it) and {len(record['differ'])} differ**"
    )


def test_openrlhf_suite_figures_come_from_the_record():
    record = json.loads((RECORDS / "openrlhf_suite.json").read_text())
    text = " ".join((CHECKOUT / "integrations" / "README.md").read_text().split())
    expected = openrlhf_suite_sentence(record)
    assert expected in text, (
        f"integrations/README.md differs from docs/records/openrlhf_suite.json; expected:\n{expected}"
    )
    assert not record["unexplained"] and not record["explained_but_not_seen"], "every difference explained"
    assert all(d["reason"] and d["stock"] == "passed" for d in record["differ"]), record["differ"]


def test_agreement_check_cost_comes_from_the_record():
    record = json.loads((RECORDS / "agreement_cost.json").read_text())
    fp, size, e2e = record["fingerprints"], record["bytes"], record["end_to_end"]
    text = readme_text()
    for expected in (
        f"{size['row_bytes']} bytes per rank in that all-gather instead of {size['row_bytes_before']}",
        f"the fingerprints take {fp['on_ms']} ms per call",
        f"{e2e['on_ms']} ms with the check, {e2e['off_ms']} ms without",
    ):
        assert expected in text, f"README agreement-check figures differ from the record; expected:\n{expected}"


def _grad_weight_error_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("grad_weight_error", CHECKOUT / "benchmarks" / "grad_weight_error.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grad_weight_error_table_comes_from_the_record():
    """The README's grad_weight error table is the record's (benchmarks/grad_weight_error.py writes both), and
    the chunk bound "auto" uses (ops/fused/accuracy.py) is the one the record gives."""
    from grpo_kernels.ops.fused.accuracy import MAX_INPLACE_CHUNKS_BF16, max_chunks_from_record

    record = json.loads((RECORDS / "grad_weight_error.json").read_text())
    table = _grad_weight_error_module().readme_table(record)
    assert " ".join(table.split()) in readme_text(), f"README error table differs from the record; expected:\n{table}"
    k_max = max_chunks_from_record(record)
    assert MAX_INPLACE_CHUNKS_BF16 == k_max, (MAX_INPLACE_CHUNKS_BF16, k_max)
    assert f"at most {k_max} chunks" in readme_text()
    # what the bound rests on: at every simulated shape and chunking, in place is within PyTorch's error
    for run in record["runs"]:
        for chunk, count in run["chunks"].items():
            assert count <= k_max or run["rel_l2"][f"bf16 in place, {chunk}-token chunks"] <= run["rel_l2"]["PyTorch bf16"]


def test_grad_weight_error_script_runs_quick():
    """The simulation runs (N = 2048) and keeps the order the bound rests on: the float64 floor below fp32
    accumulation, below in place, below PyTorch bf16."""
    module = _grad_weight_error_module()
    r = module.simulate(2048, [512], rows_top=256, rows_sampled=512, cols=32, seed=1)["rel_l2"]
    assert r["bf16 floor"] <= r["fp32 acc, 512-token chunks"] <= r["bf16 in place, 512-token chunks"] <= r["PyTorch bf16"], r


def vllm_rollouts_sentence(record: dict) -> str:
    """The README's figures of the main job with --rollout-engine vllm (tools/records/vllm_rollout_record.py)."""
    v, fp32, bf16 = record["versions"], record["engine_default"], record["engine_bfloat16"]
    r = fp32["reward_at"]

    def mismatch(run: dict) -> str:
        return (
            f"|log r| mean {run['logp_diff_mean']:.2g}, max {run['logp_diff_max']:.2g}, k3 KL "
            f"{run['k3_kl_mean']:.2g}, share of r outside [1/2, 2] at most "
            f"{run['ratio_outside_0.5_2_max']:.2g}, IS weights applied within "
            f"[{run['is_weight_min']:.4f}, {run['is_weight_max']:.4f}]"
        )

    return (
        f"torch {v['torch']}, transformers {v['transformers']}, vllm {v['vllm']}; load average "
        f"{record['load_average_1min_at_start']} at the start): the main job with `--rollout-engine vllm`, "
        f"fp32 engine: start **{fp32['engine_start_s']} s**, **{fp32['step_s_median']} s per step** (median; "
        f"weight sync {fp32['sync_s_median']} s, generation {fp32['generate_s_median']} s), 200 steps in "
        f"{fp32['train_seconds']} s; mean reward **{r['1']:.3f}** at step 1, {r['50']:.3f} at step 50, "
        f"{r['100']:.3f} at step 100, {r['200']:.3f} at step 200, **{fp32['reward_last10']:.3f}** over the "
        f"last 10 steps; sampler vs trainer on the sampled tokens over the run: {mismatch(fp32)}. bf16 "
        f"engine (`--vllm-dtype bfloat16`): start {bf16['engine_start_s']} s, {bf16['step_s_median']} s per "
        "step; "
        f"{mismatch(bf16)}; reward **{bf16['reward_last10']:.3f}** over the last 10 steps."
    )


def test_vllm_rollout_figures_come_from_the_record():
    record = json.loads((RECORDS / "vllm_rollouts.json").read_text())
    expected = vllm_rollouts_sentence(record)
    assert expected in readme_text(), f"README differs from records/vllm_rollouts.json; expected:\n{expected}"


def test_readme_says_what_a_jsonl_task_needs_on_the_embedded_model(tmp_path):
    """The README's paragraph on `.jsonl` tasks states the trainer's own numbers: prompts per step, the
    embedded model's words, the task's default reward and budget."""
    from grpo_kernels.trainer import TrainConfig
    from grpo_kernels.trainer.model import EMBEDDED_VOCAB
    from grpo_kernels.trainer.task import jsonl_task

    text = readme_text()
    words = EMBEDDED_VOCAB[4:]  # after <pad> <bos> <eos> <unk>
    assert set(words) == {str(d) for d in range(10)} | {"=", "+"}
    assert f"needs at least {TrainConfig().prompts_per_step} distinct prompts" in text
    assert f"model's {len(words)} words only: the digits `0` to `9`, `=` and `+`" in text
    path = tmp_path / "task.jsonl"
    path.write_text('{"prompt": "3 + 4 =", "answer": "7"}\n')
    task = jsonl_task(str(path))
    assert f"is `{task.reward}`, its budget {task.max_new_tokens} new tokens" in text


def test_every_install_block_starts_with_the_cpu_torch():
    """Every shell block of the docs that pip-installs the package starts with the CPU torch (the CPU index, or
    torch==2.13.0 with the line saying it is the CPU build): a plain torch requirement installs the CUDA build,
    about 5 GB that cannot run on a CPU-only machine. A block opening with "# on a GPU machine" is exempt."""
    pages = [CHECKOUT / "README.md", CHECKOUT / "integrations" / "README.md", CHECKOUT / "tests" / "README.md",
             *sorted((CHECKOUT / "docs").rglob("*.md"))]  # fmt: skip
    bad = []
    for page in pages:
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", page.read_text(), flags=re.S):
            if block.startswith("# on a GPU machine"):
                continue  # said to be for a GPU machine, where the CUDA torch is the one wanted
            installs = [line for line in block.splitlines() if re.match(r"\s*pip install", line)]
            if not any(re.search(r"pip install (-e |-q |--no-deps )*['\"]?\.", line) for line in installs):
                continue  # installs no grpo_kernels (e.g. only tools)
            first = installs[0]
            cpu = "download.pytorch.org/whl/cpu" in first or ("torch==" in first and "CPU" in first.upper())
            if not (re.match(r"\s*pip install torch[ =]", first) and cpu):
                bad.append(f"{page.relative_to(CHECKOUT)}: {first.strip()}")
    assert not bad, f"install blocks that do not start with the CPU torch: {bad}"
