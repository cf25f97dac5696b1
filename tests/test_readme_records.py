"""The README's measured figures come from committed records (docs/records/*.json), each written by the
script that measures it; a figure that drifts from its record fails here. Re-measure with the script the
README names, then commit the record and the README together."""

from __future__ import annotations

import json

from checkout import CHECKOUT

RECORDS = CHECKOUT / "docs" / "records"


def readme_text() -> str:
    return " ".join((CHECKOUT / "README.md").read_text().split())  # line breaks do not matter


def test_main_job_figures_come_from_the_record():
    record = json.loads((RECORDS / "main_job.json").read_text())
    r = record["reward_at"]
    expected = (
        f"torch {record['versions']['torch']}, transformers {record['versions']['transformers']}): "
        f"**200 steps in {record['train_seconds']} s of training, {record['wall_seconds']} s wall**; "
        f"mean reward **{r['1']:.3f}** at step 1, {r['25']:.3f} at step 25, {r['50']:.3f} at step 50, "
        f"{r['75']:.3f} at step 75, {r['100']:.3f} at step 100, above 0.9 from step "
        f"{record['first_step_above_0.9']}, **{record['reward_last10']:.3f}** over the last 10 steps; the "
        f"solved fraction (exact answer, sampled at temperature 1) goes from {record['solved_first']:.2f} to "
        f"{record['solved_last']:.2f}."
    )
    assert expected in readme_text(), f"README main-job figures differ from the record; expected:\n{expected}"


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
