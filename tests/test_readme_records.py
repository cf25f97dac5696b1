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
