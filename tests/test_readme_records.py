"""The README's measured figures come from committed records (docs/records/*.json), each written by the
script that measures it; a figure that drifts from its record fails here. Re-measure with the script the
README names, then commit the record and the README together."""

from __future__ import annotations

import importlib
import json
import re
import sys

import pytest
from checkout import CHECKOUT

RECORDS = CHECKOUT / "docs" / "records"
EXAMPLES = CHECKOUT / "integrations" / "examples"


def readme_text() -> str:
    return " ".join((CHECKOUT / "README.md").read_text().split())  # line breaks do not matter


def record_script(name: str):
    """integrations/examples/<name>.py, the script that writes a record and the README spans from it."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
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
        "README main-job figures differ from docs/records/main_job.json: run integrations/examples/main_job_record.py"
    )
    assert spans.read_span("random-policy") == script.random_policy_text(record)
    assert len(record["per_step"]["reward"]) == record["steps"] and record["prefix_steps"] == script.PREFIX_STEPS


def test_main_job_prefix_repeats_the_record(tmp_path):
    """CI re-runs the main job's first steps (a few seconds): the record cannot go stale unnoticed. The run's
    random-policy baseline (the plot's dashed line) is the record's, hence the README's."""
    from grpo_kernels.trainer import TrainConfig, train

    script = record_script("main_job_record")
    record = json.loads((RECORDS / "main_job.json").read_text())
    steps = script.PREFIX_STEPS
    result = train(TrainConfig(steps=steps, run_dir=str(tmp_path / "run")), progress=False, log=quiet)
    assert_prefix_repeats(result.metrics, record["per_step"], steps, "main job")
    assert round(result.random_reward, 4) == record["random_policy_reward"]


@pytest.fixture(scope="module")
def lookup_record():
    return json.loads((RECORDS / "lookup_turn_credit.json").read_text())


def test_lookup_figures_come_from_the_record(lookup_record):
    script = record_script("lookup_turn_credit")
    spans = record_script("readme_spans")
    assert spans.read_span("lookup-figures") == script.figures_sentence(lookup_record), (
        "README lookup figures differ from the record: run integrations/examples/lookup_turn_credit.py"
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


def test_ci_runs_the_readme_test_line_with_its_pins():
    """.ci/run takes the README's test line as it is; the pins a newcomer gets are in that line, and CI
    installs no other Triton or numpy before it."""
    readme = (CHECKOUT / "README.md").read_text()
    after_marker = readme[readme.index("<!-- test-command") :].splitlines()[1:]
    line = next(x for x in after_marker if x.startswith(("pip install", "python")))
    assert '"triton==3.6.0"' in line and '"numpy<2.3"' in line and line.endswith("python -m pytest -q"), line
    ci = (CHECKOUT / ".ci" / "run").read_text()
    first_env = ci[: ci.index('bash -c "$test_command"')]
    assert not re.search(r"pip install.*(triton|numpy)", first_env), "CI pins beside the README's test line"


def test_test_count_and_time_come_from_the_record():
    record = json.loads((RECORDS / "tests.json").read_text())
    expected = (
        f"About {round(record['tests'], -2):,} tests ({record['skipped']} skip: they need CUDA"
        + (f"; {record['xfailed']} strict xfail" if record["xfailed"] else "")
        + f"), about {round(record['seconds'] / 60)} minutes on {record['cpus']} CPU cores"
    )
    assert expected in readme_text(), f"README test figures differ from docs/records/tests.json; expected:\n{expected}"
    assert record["failed"] == 0 and record["error"] == 0, "the recorded run must be a passing one"


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
