"""The trainer on a shared cluster, each case through the real CLI in a real process (`python -m
grpo_kernels.train`): a scheduler's signal at several points of a step (while sampling, between two updates, in
the middle of a slowed-down checkpoint write) leaves a complete checkpoint and a resume loses nothing; one
process per run folder (a second is refused naming the first; a stale lock after a kill -9 is taken over; every
rank of torchrun agrees); every printed command works pasted into bash with a space in the run folder's path;
divergence advice that checks the checkpoint it names; a task line read one way (duplicate keys, lone
surrogates); a model folder whose generation config or input template changed is refused on resume.

Runs: the embedded tiny model, 2 prompts x 2 completions per step, 1-5 steps (a second or two of training in
each process, most of a case's time is the process start). The pause points are a test-only hook
(GRPO_KERNELS_TEST_PAUSE, trainer/checkpoint.py's test_pause): the process prints where it is and sleeps
there, and the test sends its signal then."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("safetensors")
pytest.importorskip("tqdm")

CHECKOUT = Path(__file__).resolve().parents[1]
SMALL = ["--prompts-per-step", "2", "--group-size", "2", "--warmup-steps", "0", "--no-progress"]
TIMING = ("step_time_s", "elapsed_s")


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory) -> dict:
    """The environment of every process here: this checkout, one thread, and `grpo-kernels` on PATH running this
    interpreter on this checkout (the command the trainer prints, pasted into bash)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    launcher = bin_dir / "grpo-kernels"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m grpo_kernels "$@"\n')
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT), OMP_NUM_THREADS="1", PATH=f"{bin_dir}:{os.environ['PATH']}")
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "LOCAL_RANK", "GRPO_KERNELS_TEST_PAUSE"):
        env.pop(key, None)
    return env


def train(env, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_kernels.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=CHECKOUT)  # fmt: skip


def bash(env, command: str, timeout=300) -> subprocess.CompletedProcess:
    """A printed command, pasted into bash as it is."""
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout, env=env)


class Paused:
    """`grpo-kernels train ARGS` started with GRPO_KERNELS_TEST_PAUSE=PAUSE: wait() returns once the process
    prints that it reached the pause point (and sleeps there); finish() collects its exit status and output."""

    def __init__(self, env, pause: str, *args):
        self.proc = subprocess.Popen([sys.executable, "-m", "grpo_kernels.train", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=dict(env, GRPO_KERNELS_TEST_PAUSE=pause),
                                     cwd=CHECKOUT)  # fmt: skip
        self.err = ""

    def wait(self) -> None:
        for line in self.proc.stderr:  # blocks until the process writes a line or ends
            self.err += line
            if line.startswith("test-pause:"):
                return
        self.finish()
        pytest.fail(f"the process ended before its pause point: {self.proc.returncode}\n{self.err[-3000:]}")

    def send(self, signum) -> None:
        os.kill(self.proc.pid, signum)

    def finish(self, timeout=300) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        self.err += err
        return self.proc.returncode, out, self.err


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def assert_same_run(got: Path, want: Path) -> None:
    """Nothing lost: every step's record (timings aside) and the final weights as the uninterrupted run's."""
    from safetensors.torch import load_file

    a, b = metrics(got), metrics(want)
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for m1, m2 in zip(a, b):
        assert {k: v for k, v in m1.items() if k not in TIMING} == pytest.approx(
            {k: v for k, v in m2.items() if k not in TIMING}, rel=1e-6, abs=1e-7), m1["step"]  # fmt: skip
    pa, pb = load_file(got / "final_model" / "model.safetensors"), load_file(want / "final_model" / "model.safetensors")
    worst = max((pa[k] - pb[k]).abs().max().item() for k in pb)
    assert worst <= 1e-6, f"final weights differ by {worst}"


def printed_command(err: str, after: str) -> str:
    """The command printed after `after` on its line (to its end, or to " (" that begins a remark)."""
    line = next(line for line in err.splitlines() if after in line)
    return line.split(after, 1)[1].strip()


@pytest.fixture(scope="module")
def straight(tmp_path_factory, shell_env) -> Path:
    """5 steps without a stop: what every stopped and resumed run must equal."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    proc = train(shell_env, "--steps", "5", "--run-dir", str(run_dir), *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


# ---- 1. a scheduler's signal: a complete checkpoint, the resume command, 128 + the signal ------------------

STOPS = {  # pause point, signal, --save-every, the checkpoint the stop leaves, what the log says
    "SIGTERM while sampling": ("sample@3=30", signal.SIGTERM, 100, 2, "stopped in step 3 by SIGTERM before its first update"),
    "SIGTERM between updates": ("update@3=2", signal.SIGTERM, 100, 3, "stopped after step 3 (SIGTERM)"),
    "SIGUSR1 in a checkpoint write": ("checkpoint@2=2", signal.SIGUSR1, 2, 2, "stopped after step 2 (SIGUSR1)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(STOPS))
def test_a_signal_mid_step_leaves_a_checkpoint_and_the_resume_loses_nothing(case, straight, shell_env, tmp_path):
    """The stop's checkpoint is complete (no .partial beside it, every file verified by the resume), the exit
    status is 128 + the signal, and the printed command, pasted into bash with a space in the path, continues to
    the end: every step and the final weights are those of the run that was never stopped."""
    pause, signum, save_every, kept, said = STOPS[case]
    run_dir = tmp_path / "my runs" / "run 1"
    run = Paused(shell_env, pause, "--steps", "5", "--save-every", str(save_every), "--run-dir", str(run_dir), *SMALL)
    run.wait()
    run.send(signum)
    code, out, err = run.finish()
    assert code == 128 + signum, err[-3000:]
    assert said in out, out[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{kept:06d}"]
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, kept + 1))
    command = printed_command(err, "continue with: ")
    assert command == f"grpo-kernels train --resume '{run_dir}'"
    resumed = bash(shell_env, command + " --no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed {run_dir} at step {kept}" in resumed.stdout
    assert_same_run(run_dir, straight)
    assert (run_dir / "run.lock").read_text() == ""  # released


def test_a_signal_before_the_first_step_completes_keeps_nothing_and_the_same_command_starts_again(shell_env, tmp_path):
    run_dir = tmp_path / "run 1"
    args = ["--steps", "1", "--run-dir", str(run_dir), *SMALL]
    run = Paused(shell_env, "sample@1=30", *args)
    run.wait()
    run.send(signal.SIGTERM)
    code, _, err = run.finish()
    assert code == 143 and "run the same command again" in err, err[-3000:]
    assert not run_dir.exists()
    again = train(shell_env, *args)
    assert again.returncode == 0, again.stderr[-3000:]


def test_help_says_what_a_scheduler_should_send(shell_env):
    proc = train(shell_env, "--help")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0
    for phrase in ("SIGTERM", "143 SIGTERM", "--signal=TERM@120", "terminationGracePeriodSeconds", "run.lock"):
        assert phrase in text, phrase


# ---- 2. one process per run folder -----------------------------------------------------------------------


def test_a_second_process_is_refused_naming_the_first_and_a_stale_lock_is_taken_over(shell_env, tmp_path):
    import socket

    run_dir = tmp_path / "run 1"
    first = Paused(shell_env, "sample@2=60", "--steps", "3", "--save-every", "1", "--run-dir", str(run_dir), *SMALL)
    first.wait()
    try:
        for args in (["--resume", str(run_dir), "--no-progress"], ["--run-dir", str(run_dir), *SMALL]):
            other = train(shell_env, *args)
            assert other.returncode == 2, other.stderr[-3000:]
            assert (f"run folder {str(run_dir)!r} is in use by pid {first.proc.pid} on host {socket.gethostname()} "
                    "(since ") in other.stderr, other.stderr[-3000:]  # fmt: skip
            assert "Traceback" not in other.stderr
    finally:
        first.send(signal.SIGKILL)  # a crash: the lock file still names it
        first.finish()
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == first.proc.pid
    assert [m["step"] for m in metrics(run_dir)] == [1]  # the refused processes wrote nothing
    resumed = train(shell_env, "--resume", str(run_dir), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"named pid {first.proc.pid} on host" in resumed.stdout and "lock taken over" in resumed.stdout
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]


@pytest.mark.distributed
def test_every_rank_of_torchrun_learns_the_refusal(shell_env, tmp_path):
    from grpo_kernels.testing.distributed import free_port

    run_dir = tmp_path / "run"
    first = Paused(shell_env, "sample@2=60", "--steps", "3", "--save-every", "1", "--run-dir", str(run_dir), *SMALL)
    first.wait()
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "grpo_kernels.train",
                               "--resume", str(run_dir), "--no-progress"],
                              capture_output=True, text=True, timeout=300, env=shell_env)  # fmt: skip
    finally:
        first.send(signal.SIGTERM)
        code, _, _ = first.finish()
    assert proc.returncode != 0
    assert proc.stderr.count(f"is in use by pid {first.proc.pid}") == 2, proc.stderr[-3000:]  # rank 0 and rank 1
    assert code == 143 and [m["step"] for m in metrics(run_dir)] == [1]


# ---- 3. a run without a complete checkpoint; divergence advice -------------------------------------------


def test_a_run_killed_before_its_first_checkpoint_says_so_and_the_printed_commands_work(shell_env, tmp_path):
    """kill -9 in the middle of the first checkpoint write (step 2): --resume and the original command both say
    that the run never completed a checkpoint (and that a write was cut short), not that the folder cannot be
    written; the printed `rm -r` followed by the original command starts the run again."""
    run_dir = tmp_path / "my runs" / "run 1"
    args = ["--steps", "2", "--save-every", "2", "--run-dir", str(run_dir), *SMALL]
    run = Paused(shell_env, "checkpoint@2=60", *args)
    run.wait()
    run.send(signal.SIGKILL)
    run.finish()
    reason = ("stopped before its first checkpoint was complete (2 step(s) recorded in metrics.jsonl, none "
              "checkpointed; step_000002.partial is a checkpoint write that was cut short)")  # fmt: skip
    resume = train(shell_env, "--resume", str(run_dir))
    assert resume.returncode == 2 and reason in resume.stderr, resume.stderr[-3000:]
    assert "cannot write" not in resume.stderr
    again = train(shell_env, *args)
    assert again.returncode == 2 and reason in again.stderr, again.stderr[-3000:]
    assert "cannot write" not in again.stderr
    remove = re.search(r"\((rm -r .*?)\)", again.stderr).group(1)
    assert bash(shell_env, remove).returncode == 0 and not run_dir.exists()
    assert train(shell_env, *args).returncode == 0


DIVERGING = ["--lr", "2", "--warmup-steps", "3", "--save-every", "1", "--steps", "6", "--prompts-per-step", "2",
             "--group-size", "2", "--no-progress"]  # fmt: skip


def test_divergence_whose_last_checkpoint_is_past_the_blow_up_says_to_start_over(shell_env, tmp_path):
    """The rate 2 over a 3-step warmup: step 1 (rate 0.67) moves the weights ~20 times their norm and step 2
    goes non-finite. Resuming step 1's checkpoint at any lower rate diverges again, so the advice is to start
    over, at a rate that would have moved the weights about 1% per step."""
    run_dir = tmp_path / "run 1"
    proc = train(shell_env, *DIVERGING, "--run-dir", str(run_dir))
    assert proc.returncode == 1
    err = " ".join(proc.stderr.split())
    if "training diverged at step 2" not in err:
        pytest.skip(f"this machine's run diverged elsewhere: {err[-500:]}")
    assert "the checkpoint of step 1 is itself past the blow-up: its weights are" in err
    assert "from the initial model" in err and "no kept checkpoint is before it: start over" in err
    assert f"rm -r '{run_dir}'" in err and "--resume" not in err
    rate = float(re.search(r"about 1% per step \(--lr ([0-9.e+-]+)\)", err).group(1))
    assert rate < 2e-3  # a rate of the order of the sound default (1e-3), not a tenth of the diverging one


def test_divergence_names_the_last_sound_checkpoint_and_its_command_continues(shell_env, tmp_path):
    """Three sound steps, then step 3's checkpoint blown up (its weights x30: the state a too-high rate leaves),
    resumed at rate 1: step 4 diverges. The advice names step 2 and prints a command that moves step 3 aside
    and resumes from step 2; pasted into bash (a space in the path) it runs to the end."""
    from safetensors.torch import load_file, save_file

    run_dir = tmp_path / "my runs" / "run 1"
    base = train(shell_env, "--steps", "3", "--save-every", "1", "--keep-checkpoints", "5", "--run-dir", str(run_dir),
                 *SMALL)  # fmt: skip
    assert base.returncode == 0, base.stderr[-3000:]
    path = run_dir / "checkpoints" / "step_000003" / "model.safetensors"
    save_file({k: v * 30 for k, v in load_file(path).items()}, path)
    proc = train(shell_env, "--resume", str(run_dir), "--lr", "1", "--steps", "6", "--no-progress")
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and "training diverged at step 4" in err, err[-3000:]
    assert "the checkpoint of step 3 is itself past the blow-up" in err and "the last sound checkpoint is step 2" in err
    command = err.split("at the rate that reached it (or a tenth of this run's, if lower): ", 1)[1]
    assert command.endswith(f"grpo-kernels train --resume '{run_dir}' --lr 0.001"), command
    pasted = bash(shell_env, command + " --steps 4 --no-progress")
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    assert f"resumed {run_dir} at step 2" in pasted.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_000001", "step_000002", "step_000003", "step_000003.diverged", "step_000004"]  # fmt: skip


# ---- 4. a file read one way ------------------------------------------------------------------------------


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "1 =", "answer": "1", "prompt": "2 ="}', 'the key "prompt" is given twice in one object'),
    ('{"prompt": "1 \\ud83d =", "answer": "1"}', "the 'prompt' value holds a lone surrogate \\ud83d at character 3"),
])  # fmt: skip
def test_a_task_line_read_two_ways_is_refused_with_file_and_line(shell_env, tmp_path, line, message):
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "0 =", "answer": "0"}\n' + line + "\n")
    proc = train(shell_env, "--task", str(task), "--run-dir", str(tmp_path / "run"), *SMALL)
    assert proc.returncode == 2 and f"{task}:2: {message}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def model_run(tmp_path_factory, shell_env):
    """A 1-step run of a tiny Llama folder (test_trainer_user_data.py's), to be copied and changed."""
    from test_trainer_user_data import build, save

    root = tmp_path_factory.mktemp("model_run")
    model_dir = save(*build("llama"), root / "model")
    proc = train(shell_env, "--model", model_dir, "--steps", "1", "--run-dir", str(root / "run"), *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _change_generation_config(model_dir: Path) -> None:
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = [2, 5]  # "+" now ends a completion too
    path.write_text(json.dumps(config))


def _change_input_template(model_dir: Path) -> None:
    path = model_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    data["post_processor"] = None  # no <bos> before a prompt any more
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("change,message", [
    (_change_generation_config, "its generation config (generation_config.json) differs: eos_token_id 2 -> [2, 5]"),
    (_change_input_template, "its tokenizer's input template differs (special tokens such as a BOS added around a "
                             "prompt: '0' encoded to [1, 6] then, [6] now)"),
])  # fmt: skip
def test_a_model_folder_that_samples_or_scores_otherwise_is_refused_on_resume(model_run, shell_env, tmp_path, change,
                                                                              message):  # fmt: skip
    shutil.copytree(model_run, tmp_path / "copy")
    model_dir, run_dir = tmp_path / "copy" / "model", tmp_path / "copy" / "run"
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "model": str(model_dir), "run_dir": str(run_dir)}))
    change(model_dir)
    proc = train(shell_env, "--resume", str(run_dir), "--steps", "3")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "was written with another model than this run now loads (" + message in " ".join(proc.stderr.split())


def test_preset_with_resume_is_refused_like_the_other_options(model_run, shell_env):
    for preset in ("dapo", "grpo"):  # even the default: the run's preset is its config.json's
        proc = train(shell_env, "--resume", str(model_run / "run"), "--preset", preset, "--steps", "2")
        assert proc.returncode == 2
        assert "only --steps and --lr may be given (got ['--preset'])" in proc.stderr, proc.stderr[-3000:]
