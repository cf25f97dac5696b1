"""The training records the README quotes, re-run in full: the main job (main_job_record.py) and the three
lookup runs (lookup_turn_credit.py), 200 steps each on the embedded model.

    python tools/records/records.py            # re-measure both, rewrite their records and README spans
    python tools/records/records.py --check    # what CI runs (.ci/steps/records.sh): compare, write nothing

--check re-runs every step and compares it with the committed record: every step's reward (and, for the
main job, solved fraction) exactly, since the same code and versions sample the same completions (the
sampling is seeded per prompt group); every step's loss to fp32 rounding (1e-5 relative: another CPU's vector
width reorders a sum of a few thousand fp32 terms); the random-policy baseline exactly. It exits 1 naming the
first step that differs and the command that regenerates the records and the README spans (the one above
without --check), and which versions the record was made with, when they are not this environment's (a new
torch or transformers may round differently: the record is of the versions CI installs).

Not re-run here, and why (each is said where the README quotes it): the vLLM rollouts record (2 x 200 steps
with a vLLM engine, about 15 minutes in CI's vLLM environment), the grad_weight error simulation (about 3
minutes of 2 cores for a table that changes only with benchmarks/grad_weight_error.py itself), the
agreement-check and main-job times (timings of a shared machine: they never repeat exactly), the [verl]
install resolve (the day's package index, not this code), and the TRL test-suite run (TRL's tests from its
repository; not on CI's machine). The test-count record has its own check (tests_record.py).

Timing on CI's 2 cores: the four runs in parallel processes, about 2-3 minutes of wall time.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import lookup_turn_credit  # noqa: E402
import main_job_record  # noqa: E402

COMMAND = "python tools/records/records.py"
WRITES = ("docs/records/main_job.json, docs/records/lookup_turn_credit.json and the README spans main-job-figures, "
          "random-policy and lookup-figures")  # fmt: skip
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-7


def compare_steps(what: str, recorded: dict, rerun: dict, exact: tuple[str, ...]) -> tuple[list[str], float]:
    """Problems (first differing step per key) between two per_step dicts, and the largest loss difference."""
    problems = []
    n_rec, n_new = len(recorded["reward"]), len(rerun["reward"])
    if n_rec != n_new:
        problems.append(f"{what}: {n_new} steps re-run, {n_rec} recorded")
    for key in exact:
        for step, (new, old) in enumerate(zip(rerun[key], recorded[key]), 1):
            if new != old:
                problems.append(f"{what}: step {step} {key} {new!r}, recorded {old!r} (the first step that differs)")
                break
    worst = 0.0
    for step, (new, old) in enumerate(zip(rerun["loss"], recorded["loss"]), 1):
        worst = max(worst, abs(new - old))
        if abs(new - old) > LOSS_RTOL * max(1.0, abs(old)) + LOSS_ATOL:
            problems.append(f"{what}: step {step} loss {new!r}, recorded {old!r} (beyond fp32 rounding)")
            break
    return problems, worst


def check_main_job(recorded: dict, rerun: dict) -> tuple[list[str], str]:
    problems, worst = compare_steps("main job", recorded["per_step"], rerun["per_step"], ("reward", "solved"))
    if rerun["random_policy_reward"] != recorded["random_policy_reward"]:
        problems.append(f"main job: random-policy reward {rerun['random_policy_reward']}, recorded "
                        f"{recorded['random_policy_reward']}")  # fmt: skip
    return problems, f"main job: {rerun['steps']} steps, largest loss difference {worst:.2g}"


def check_lookup(recorded: dict, rerun: dict) -> tuple[list[str], str]:
    problems, notes = [], []
    for name in lookup_turn_credit.RUNS:
        found, worst = compare_steps(f"lookup {name}", recorded["runs"][name]["per_step"],
                                     rerun["runs"][name]["per_step"], ("reward",))  # fmt: skip
        problems += found
        notes.append(f"lookup {name}: largest loss difference {worst:.2g}")
    return problems, "; ".join(notes)


def versions_note(recorded: dict, rerun: dict) -> str:
    old, new = recorded.get("versions", {}), rerun.get("versions", {})
    differ = [f"{k} {old.get(k)} (here {new.get(k)})" for k in ("torch", "transformers") if old.get(k) != new.get(k)]
    return ("recorded with " + ", ".join(differ) + ": re-record with the versions CI installs") if differ else ""


def check(main_job: dict, lookup: dict) -> tuple[list[str], list[str]]:
    """(problems, notes) of re-run records against the committed ones."""
    problems, notes = [], []
    for recorded_path, rerun, compare in (
        (main_job_record.RECORD, main_job, check_main_job),
        (lookup_turn_credit.RECORD, lookup, check_lookup),
    ):
        recorded = json.loads(recorded_path.read_text())
        found, note = compare(recorded, rerun)
        notes.append(note)
        if found and versions_note(recorded, rerun):
            found.append(f"{recorded_path.name}: {versions_note(recorded, rerun)}")
        problems += found
    return problems, notes


def failure_text(problems: list[str]) -> str:
    return "\n".join(["The records the README quotes do not hold for this code:", *problems, "",
                      f"Regenerate them with: {COMMAND}", f"(it rewrites {WRITES}; commit them with the change)"])  # fmt: skip


def _measure_main_job() -> dict:
    return main_job_record.measure()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed records, write nothing")
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    if args.check:  # the main job in a process of its own beside the three lookup runs: 4 processes
        with cf.ProcessPoolExecutor(1, mp_context=context) as pool:
            main_job = pool.submit(_measure_main_job)
            lookup = lookup_turn_credit.measure()
            main_job = main_job.result()
        problems, notes = check(main_job, lookup)
        print("\n".join(notes))
        if problems:
            print("\n" + failure_text(problems), file=sys.stderr)
            return 1
        print("every step's reward equals the records (docs/records/main_job.json, lookup_turn_credit.json)")
        return 0
    # writing: the main job alone first (its wall time is in the README), then the three lookup runs
    main_job_record.write(main_job_record.measure())
    lookup_turn_credit.write(lookup_turn_credit.measure())
    print(f"wrote {WRITES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
