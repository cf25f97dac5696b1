"""The run folder, and checkpoints that load without unpickling: tensors in safetensors, the rest in JSON.

    checkpoints/step_000050/
        model.safetensors       the policy (shared tensors such as tied embeddings stored once)
        reference.safetensors   the reference policy, when the loss has a KL term (ProRL resets it)
        optimizer.safetensors   optimizer state tensors, "state.<param index>.<name>"
        rng.safetensors         torch CPU / CUDA RNG states and the prompt / hook generators
        state.json              step, optimizer param groups and scalars, python RNG, estimator state
A checkpoint folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time

import torch

STEP_PREFIX = "step_"
TEST_PAUSE = "GRPO_KERNELS_TEST_PAUSE"  # tests only: "PHASE@STEP=SECONDS,..." (test_pause)


def test_pause(phase: str, step: int) -> None:
    """Tests only: with GRPO_KERNELS_TEST_PAUSE="sample@3=2,checkpoint@2=2", the run prints "test-pause: PHASE
    step STEP" to stderr at that point and sleeps there (a test sends a signal to a real process at a known
    point of a step: while sampling, between updates, in the middle of a checkpoint write). Unset: nothing."""
    spec = os.environ.get(TEST_PAUSE)
    if not spec:
        return
    import sys

    for item in spec.split(","):
        where, _, seconds = item.partition("=")
        if where == f"{phase}@{step}":
            print(f"test-pause: {phase} step {step}", file=sys.stderr, flush=True)
            time.sleep(float(seconds))


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def list_checkpoints(checkpoints_dir: str) -> list[str]:
    """Complete checkpoint folders, oldest first."""
    if not os.path.isdir(checkpoints_dir):
        return []
    names = [
        n
        for n in os.listdir(checkpoints_dir)
        if n.startswith(STEP_PREFIX) and n[len(STEP_PREFIX) :].isdigit()
    ]
    return [os.path.join(checkpoints_dir, n) for n in sorted(names)]


def has_checkpoint(checkpoints_dir: str) -> bool:
    """A complete checkpoint folder, or one whose replacement was cut short (step_N.old, which
    choose_checkpoint restores)."""
    if list_checkpoints(checkpoints_dir):
        return True
    return os.path.isdir(checkpoints_dir) and any(
        n.startswith(STEP_PREFIX) and n.endswith(".old") and n[len(STEP_PREFIX) : -4].isdigit()
        for n in os.listdir(checkpoints_dir)
    )


def _optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _optimizer_from_flat(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict
) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    for name, value in meta["scalars"].items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


class DamagedCheckpoint(ValueError):
    """A checkpoint file that is missing, truncated, unreadable or holds non-finite values (`path`, `reason`).
    Resume skips such a checkpoint, naming it, in favour of the newest intact one."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class NoCheckpoint(ValueError):
    """--resume of a run folder that holds no complete checkpoint (the message says why and what to do)."""


class RunFolderNotEmpty(ValueError):
    """A new run given a folder that already holds files (the message says what they are and what to do)."""


def _metrics_steps(run_dir: str) -> int:
    """The last step recorded in the run's metrics.jsonl (0: none, or unreadable)."""
    last = 0
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    last = max(last, int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError:
        pass
    return last


def _never_checkpointed(run_dir: str) -> str:
    """Why a run folder has no complete checkpoint: how far it got, and a write cut short."""
    steps = _metrics_steps(run_dir)
    done = f"{steps} step(s) recorded in metrics.jsonl, none checkpointed" if steps else "no step completed"
    checkpoints_dir = os.path.join(run_dir, "checkpoints")
    partial = sorted(n for n in os.listdir(checkpoints_dir) if n.endswith(".partial")) if os.path.isdir(
        checkpoints_dir) else []  # fmt: skip
    cut = f"; {partial[-1]} is a checkpoint write that was cut short" if partial else ""
    return f"it stopped before its first checkpoint was complete ({done}{cut})"


def no_checkpoint_message(run_dir: str) -> str:
    import shlex

    if not os.path.isfile(os.path.join(run_dir, "config.json")):
        return f"cannot resume {run_dir!r}: it holds no run (no config.json there)"
    return (f"cannot resume {run_dir!r}: {_never_checkpointed(run_dir)}, so there is nothing to continue from; "
            f"start it again: remove the folder (rm -r {shlex.quote(run_dir)}) and run the command that started it "
            "(or the same options with another --run-dir)")  # fmt: skip


def check_new_run_folder(run_dir: str) -> None:
    """A new run's folder is absent or empty (its lock file aside); RunFolderNotEmpty says what it holds: a
    run to resume, a run that never reached a checkpoint, or other files."""
    import shlex

    from .runlock import LOCK_NAME

    if not os.path.isdir(run_dir) or not [n for n in os.listdir(run_dir) if n != LOCK_NAME]:
        return
    quoted = shlex.quote(run_dir)
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        found = list_checkpoints(os.path.join(run_dir, "checkpoints"))
        if found:
            step = int(os.path.basename(found[-1])[len(STEP_PREFIX):])
            raise RunFolderNotEmpty(
                f"run folder {run_dir!r} already holds a run, checkpointed at step {step}: continue it with: "
                f"grpo-kernels train --resume {quoted} (with --steps N to go past its own --steps), or use another "
                "--run-dir"
            )
        raise RunFolderNotEmpty(
            f"run folder {run_dir!r} holds a run that {_never_checkpointed(run_dir).removeprefix('it ')}: nothing "
            f"to resume; remove it (rm -r {quoted}) and run this command again, or use another --run-dir"
        )
    raise RunFolderNotEmpty(f"run folder {run_dir!r} exists and is not empty (it holds no run: no config.json); "
                            "use another --run-dir")  # fmt: skip


class CheckpointMismatch(ValueError):
    """An intact checkpoint of another model (architecture, shapes, config or tokenizer): resume refuses it."""


# bytes per element of each safetensors dtype, to check a header's offsets against its shapes
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def file_mode() -> int:
    """The mode a new file gets under this process's umask (0o666 & ~umask): safetensors writes through a
    private temporary file (mode 0600), so its files are set to this afterwards."""
    try:
        with open("/proc/self/status") as f:  # Linux: read without changing it
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def apply_umask(folder: str) -> None:
    """Every file directly in `folder` gets the mode of a file created under the user's umask."""
    mode = file_mode()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            os.chmod(path, mode)


def swap_in(partial: str, folder: str) -> None:
    """`partial` (complete) becomes `folder`: a folder of that name is moved aside first and removed after,
    so that at every instant `folder` is either the old complete one, absent, or the new complete one."""
    old = folder + ".old"
    if os.path.exists(folder):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
    os.replace(partial, folder)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    folder: str, *, model, reference, optimizer, rng_tensors: dict[str, torch.Tensor], state: dict
) -> None:
    """Writes the checkpoint under `<folder>.partial`, then renames it: a checkpoint folder is complete or
    absent (a kill -9 mid-write leaves a .partial folder, never listed and removed by the next save).
    Files get the user's umask. OSError / SafetensorError propagate (the trainer names what it wrote)."""
    from safetensors.torch import save_file, save_model  # the train extra: imported when used (cli --help without it)

    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        save_model(model, os.path.join(partial, "model.safetensors"))
        test_pause("checkpoint", state["step"])  # tests only: a slow write, to signal the process in its middle
        if reference is not None:
            save_model(reference, os.path.join(partial, "reference.safetensors"))
        optimizer_tensors, optimizer_meta = _optimizer_to_flat(optimizer)
        save_file(optimizer_tensors, os.path.join(partial, "optimizer.safetensors"))
        save_file({k: v.contiguous() for k, v in rng_tensors.items()}, os.path.join(partial, "rng.safetensors"))
        with open(os.path.join(partial, "state.json"), "w") as f:
            json.dump({**state, "optimizer": optimizer_meta}, f)
        apply_umask(partial)
        swap_in(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


# ---- verification before a resume: nothing on disk is trusted ----------------------------------------


def read_safetensors_header(path: str) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header ({name: {dtype, shape, data_offsets}}), after
    checking the file against it: 8 bytes of header length, a JSON header that fits the file, each tensor's
    byte range matching its dtype and shape, and the data ending exactly at the end of the file (a
    truncated or zero-length file fails here with what is missing). Raises DamagedCheckpoint."""
    if not os.path.isfile(path):
        raise DamagedCheckpoint(path, "missing")
    size = os.path.getsize(path)
    if size < 8:
        raise DamagedCheckpoint(path, f"truncated to {size} bytes (a safetensors file starts with 8 bytes of "
                                      "header length)")  # fmt: skip
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        if 8 + header_size > size:
            raise DamagedCheckpoint(path, f"truncated: {size} bytes, shorter than its own header "
                                          f"({header_size} bytes after the first 8)")  # fmt: skip
        raw = f.read(header_size)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise DamagedCheckpoint(path, f"its header is not valid JSON ({exc})") from None
    header.pop("__metadata__", None)
    data_size, end = size - 8 - header_size, 0
    for name, entry in header.items():
        try:
            begin, stop = entry["data_offsets"]
            numel = math.prod(entry["shape"])
            expected = numel * _DTYPE_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise DamagedCheckpoint(path, f"its header entry for {name!r} is malformed: {entry!r}") from None
        if stop - begin != expected or begin < 0:
            raise DamagedCheckpoint(path, f"its header gives tensor {name!r} bytes {begin}..{stop}, not the "
                                          f"{expected} its shape {entry['shape']} needs")  # fmt: skip
        end = max(end, stop)
    if end != data_size:
        raise DamagedCheckpoint(path, f"truncated: its header declares {end} bytes of tensor data, the file "
                                      f"holds {data_size}")  # fmt: skip
    return header


def _check_finite_tensors(path: str, header: dict) -> None:
    """Every floating-point tensor of the file is finite (read one tensor at a time)."""
    from safetensors import safe_open

    names = [n for n, e in header.items() if e["dtype"] in _FLOAT_DTYPES]
    try:
        with safe_open(path, framework="pt") as f:
            for name in names:
                tensor = f.get_tensor(name)
                bad = int((~torch.isfinite(tensor)).sum())
                if bad:
                    raise DamagedCheckpoint(path, f"tensor {name!r} holds {bad} non-finite value(s) (NaN / inf) "
                                                  f"of {tensor.numel()}")  # fmt: skip
    except DamagedCheckpoint:
        raise
    except Exception as exc:  # SafetensorError: unreadable despite a header that fits
        raise DamagedCheckpoint(path, f"unreadable ({type(exc).__name__}: {exc})") from None


def _check_model_tensors(path: str, header: dict, model) -> None:
    """The file's tensors are the model's: names and shapes (a tensor shared by several names, such as
    tied embeddings, stored under one of them). A difference is another architecture: CheckpointMismatch."""
    state = model.state_dict()
    groups: dict[tuple, list[str]] = {}  # names that share one storage (tied weights)
    for name, tensor in state.items():
        groups.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)),
                          []).append(name)  # fmt: skip
    unexpected = sorted(set(header) - set(state))
    missing = sorted(names[0] for names in groups.values() if not any(n in header for n in names))
    shapes = [f"{n} {list(header[n]['shape'])} in the checkpoint, {list(state[n].shape)} in the model"
              for n in sorted(set(header) & set(state)) if list(header[n]["shape"]) != list(state[n].shape)]  # fmt: skip
    if missing or unexpected or shapes:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("other shapes", shapes)):
            if items:
                parts.append(f"{label} ({len(items)}): " + ", ".join(items[:4]) + (" ..." if len(items) > 4 else ""))
        raise CheckpointMismatch(
            f"{path} holds another architecture than the model {type(model).__name__}: " + "; ".join(parts)
        )


def _check_optimizer_tensors(path: str, header: dict, optimizer, meta: dict) -> None:
    """optimizer.safetensors against the optimizer: parameter groups of the same sizes, per-parameter
    moments of each parameter's shape."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_groups = meta.get("param_groups")
    if not isinstance(saved_groups, list) or [len(g.get("params", [])) for g in saved_groups] != [
        len(g["params"]) for g in optimizer.param_groups
    ]:
        raise CheckpointMismatch(f"{path}: the optimizer state is for other parameters than the model's "
                                 f"({len(params)} parameters)")  # fmt: skip
    for name, entry in header.items():
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
            raise DamagedCheckpoint(path, f"unexpected tensor name {name!r}")
        index = int(parts[1])
        if index >= len(params):
            raise CheckpointMismatch(f"{path}: optimizer state for parameter {index}, the model has {len(params)}")
        if parts[2] in ("exp_avg", "exp_avg_sq") and list(entry["shape"]) != list(params[index].shape):
            raise CheckpointMismatch(f"{path}: {name} has shape {entry['shape']}, its parameter "
                                     f"{list(params[index].shape)}")  # fmt: skip


def read_state(folder: str) -> dict:
    """state.json of a checkpoint folder, checked for the keys a resume reads (DamagedCheckpoint if not)."""
    path = os.path.join(folder, "state.json")
    if not os.path.isfile(path):
        raise DamagedCheckpoint(path, "missing")
    try:
        with open(path) as f:
            state = json.load(f)
    except (UnicodeDecodeError, ValueError) as exc:
        raise DamagedCheckpoint(path, f"not valid JSON ({exc})") from None
    keys = ("step", "python_rng", "estimator_state", "config", "optimizer")
    absent = [k for k in keys if not isinstance(state, dict) or k not in state]
    if absent:
        raise DamagedCheckpoint(path, f"lacks {absent}")
    step = int(os.path.basename(folder)[len(STEP_PREFIX):])
    if state["step"] != step:
        raise DamagedCheckpoint(path, f"says step {state['step']}, its folder step {step}")
    return state


def verify_checkpoint(folder: str, *, model, reference, optimizer, fingerprint: dict | None = None) -> dict:
    """Checks every file of a checkpoint before anything is loaded from it; returns its state.json.

    state.json parses and holds what a resume reads; the model it was written with (`fingerprint`: class,
    config, tokenizer) is the model of this run; model.safetensors (and reference.safetensors when the run
    has a reference), optimizer.safetensors and rng.safetensors have headers that fit their sizes, the
    model's tensor names and shapes, and only finite floating-point values.

    Raises DamagedCheckpoint (a file missing, truncated, unparseable or non-finite) or CheckpointMismatch
    (an intact checkpoint of another model, config or tokenizer)."""
    state = read_state(folder)
    saved = state.get("model")
    if fingerprint is not None and saved is not None:
        differences = fingerprint_differences(saved, fingerprint)
        if differences:
            raise CheckpointMismatch(
                f"{folder} was written with another model than this run now loads ({'; '.join(differences)})"
            )
    files = [("model.safetensors", model)]
    if reference is not None:
        files.append(("reference.safetensors", reference))
    for name, module in files:
        path = os.path.join(folder, name)
        header = read_safetensors_header(path)
        _check_model_tensors(path, header, module)
        _check_finite_tensors(path, header)
    path = os.path.join(folder, "optimizer.safetensors")
    header = read_safetensors_header(path)
    _check_optimizer_tensors(path, header, optimizer, state["optimizer"])
    _check_finite_tensors(path, header)
    path = os.path.join(folder, "rng.safetensors")
    absent = {"torch_cpu", "prompt_generator", "hook_generator"} - set(read_safetensors_header(path))
    if absent:
        raise DamagedCheckpoint(path, f"lacks {sorted(absent)}")
    return state


def fingerprint_differences(saved: dict, now: dict) -> list[str]:
    """What differs between the model a checkpoint was written with and the one loaded now (empty: same)."""
    differences = []
    if saved.get("class") != now.get("class"):
        differences.append(f"the model class was {saved.get('class')}, is {now.get('class')}")
    old_config, new_config = saved.get("config", {}), now.get("config", {})
    changed = sorted(k for k in set(old_config) | set(new_config) if old_config.get(k) != new_config.get(k))
    if changed:
        shown = ", ".join(f"{k} {old_config.get(k)!r} -> {new_config.get(k)!r}" for k in changed[:4])
        differences.append(f"its config differs: {shown}" + (" ..." if len(changed) > 4 else ""))
    if saved.get("tokenizer_sha256") != now.get("tokenizer_sha256"):
        differences.append(
            f"its tokenizer differs ({saved.get('tokenizer_size')} tokens then, {now.get('tokenizer_size')} now"
            + (", other tokens or ids" if saved.get("tokenizer_size") == now.get("tokenizer_size") else "") + ")"
        )
    if "generation" in saved and "generation" in now:  # checkpoints written before these were recorded: unchecked
        old_gen, new_gen = saved["generation"], now["generation"]
        changed = sorted(k for k in set(old_gen) | set(new_gen) if old_gen.get(k) != new_gen.get(k))
        if changed:
            shown = ", ".join(f"{k} {old_gen.get(k)!r} -> {new_gen.get(k)!r}" for k in changed[:4])
            differences.append(f"its generation config (generation_config.json) differs: {shown}"
                               + (" ..." if len(changed) > 4 else ""))  # fmt: skip
    if "input_template" in saved and "input_template" in now and saved["input_template"] != now["input_template"]:
        old_t, new_t = saved["input_template"], now["input_template"]
        text = next((t for t in sorted(set(old_t) | set(new_t)) if old_t.get(t) != new_t.get(t)), None)

        def ids(entry):
            return entry[0] if isinstance(entry, list) else entry

        differences.append(f"its tokenizer's input template differs (special tokens such as a BOS added around a "
                           f"prompt: {text!r} encoded to {ids(old_t.get(text))} then, {ids(new_t.get(text))} now)")  # fmt: skip
    return differences


def choose_checkpoint(checkpoints_dir: str, verify, log) -> tuple[str, dict]:
    """The newest checkpoint that `verify(folder) -> state` accepts: (folder, state).

    A damaged one (DamagedCheckpoint) is named in a warning, renamed `<name>.damaged` (kept for a look, never
    listed again) and the next older one tried; CheckpointMismatch propagates (the model changed: no older
    checkpoint of this run can match it either). NoCheckpoint (a ValueError) when there is none, ValueError when
    every one is damaged."""
    if os.path.isdir(checkpoints_dir):  # a kill between swap_in's two renames: the complete old folder is back
        for name in sorted(os.listdir(checkpoints_dir)):
            base = os.path.join(checkpoints_dir, name.removesuffix(".old"))
            if name.endswith(".old") and not os.path.exists(base):
                os.replace(os.path.join(checkpoints_dir, name), base)
                log(f"note: {base} restored from {name} (a checkpoint write was interrupted while replacing it)")
    checkpoints = list_checkpoints(checkpoints_dir)
    if not checkpoints:
        raise NoCheckpoint(no_checkpoint_message(os.path.dirname(checkpoints_dir)))
    damaged = []
    for folder in reversed(checkpoints):
        try:
            return folder, verify(folder)
        except DamagedCheckpoint as exc:
            damaged.append(f"{os.path.basename(folder)} ({exc})")
            aside = folder + ".damaged"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(folder, aside)
            older = "the next older checkpoint" if folder != checkpoints[0] else "none left"
            log(f"warning: checkpoint {folder} is damaged: {exc}; moved to {aside}, trying {older}")
    raise ValueError(
        f"cannot resume {os.path.dirname(checkpoints_dir)!r}: every checkpoint is damaged: " + "; ".join(damaged)
    )


def load_checkpoint(folder: str, *, model, reference, optimizer) -> tuple[dict, dict[str, torch.Tensor]]:
    """Loads weights and optimizer state in place (after verify_checkpoint); returns (state.json, RNG
    tensors)."""
    from safetensors.torch import load_file, load_model

    device = str(next(model.parameters()).device)
    load_model(model, os.path.join(folder, "model.safetensors"), device=device)
    if reference is not None:
        load_model(reference, os.path.join(folder, "reference.safetensors"), device=device)
    state = read_state(folder)
    # on CPU, like torch.load(map_location="cpu"): load_state_dict moves the state next to each parameter
    optimizer_tensors = load_file(os.path.join(folder, "optimizer.safetensors"))
    _optimizer_from_flat(optimizer, optimizer_tensors, state["optimizer"])
    return state, load_file(os.path.join(folder, "rng.safetensors"))


def model_distance(folder: str, other: str | dict) -> tuple[float, float]:
    """(||a - b||, ||b||), 2-norms over every tensor of `folder`/model.safetensors (a) and `other` (b): another
    checkpoint folder or a {name: tensor} state dict. One tensor in memory at a time, in fp64."""
    from safetensors import safe_open

    def tensors(source):
        if isinstance(source, dict):
            return source
        return safe_open(os.path.join(source, "model.safetensors"), framework="pt")

    a, b = tensors(folder), tensors(other)
    diff = norm = 0.0
    for name in a.keys():
        x = a.get_tensor(name).double()
        y = (b[name] if isinstance(b, dict) else b.get_tensor(name)).detach().cpu().double()
        diff += float(((x - y) ** 2).sum())
        norm += float((y**2).sum())
    return math.sqrt(diff), math.sqrt(norm)


def prune_checkpoints(checkpoints_dir: str, keep: int) -> None:
    for folder in list_checkpoints(checkpoints_dir)[:-keep]:
        shutil.rmtree(folder)


def capture_rng(prompt_generator: torch.Generator, hook_generator: torch.Generator) -> tuple[dict, list]:
    """(RNG tensors for rng.safetensors, the python RNG state as JSON)."""
    tensors = {
        "torch_cpu": torch.get_rng_state(),
        "prompt_generator": prompt_generator.get_state(),
        "hook_generator": hook_generator.get_state(),
    }
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    version, internal, gauss = random.getstate()
    return tensors, [version, list(internal), gauss]


def restore_rng(tensors: dict, python_state: list, prompt_generator, hook_generator) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[f"cuda.{i}"] for i in range(sum(k.startswith("cuda.") for k in tensors))]
    if cuda_states:
        torch.cuda.set_rng_state_all(cuda_states)
    prompt_generator.set_state(tensors["prompt_generator"])
    hook_generator.set_state(tensors["hook_generator"])
    version, internal, gauss = python_state
    random.setstate((version, tuple(internal), gauss))


def open_run_folder(config, resume: bool, choose=None, lock=None) -> tuple[str, int]:
    """(run folder, last completed step). A new run gets a fresh folder (never an existing non-empty one)
    with config.json and an empty metrics.jsonl; a resumed run keeps its folder, its config.json takes the
    new settings, and metrics.jsonl is cut back to the checkpoint's step (later steps are re-run).

    `choose(checkpoints_dir) -> (folder, state)` picks the checkpoint to resume from (choose_checkpoint with
    the run's verification); by default the newest, unverified. Files are replaced whole (written aside,
    then renamed), so a kill at any point leaves the previous version or the new one. `lock(run_dir)` takes
    the run folder's lock (runlock.py) before anything in it is written (a new folder: right after it is made).
    """
    if resume:
        run_dir = config.run_dir
        if lock is not None:
            lock(run_dir)
        checkpoints_dir = os.path.join(run_dir, "checkpoints")
        if choose is None:
            found = list_checkpoints(checkpoints_dir)
            if not found:
                raise NoCheckpoint(no_checkpoint_message(run_dir))
            folder = found[-1]
        else:
            folder, _ = choose(checkpoints_dir)
        step = int(os.path.basename(folder)[len(STEP_PREFIX) :])
        if step >= config.steps:
            raise ValueError(f"{run_dir!r} already reached step {step}; pass --steps N with N > {step}")
        metrics_path = os.path.join(run_dir, "metrics.jsonl")
        _write_text(metrics_path, "".join(_metrics_up_to(metrics_path, step)))
        _write_json(os.path.join(run_dir, "config.json"), config.to_json_dict())
        return run_dir, step
    run_dir = config.run_dir
    if run_dir is None:  # runs/<timestamp>, with a suffix if two runs start in the same second
        run_dir = new_run_dir_name()
    check_new_run_folder(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    if lock is not None:
        lock(run_dir)
        check_new_run_folder(run_dir)  # another process may have written there before the lock was ours
    _write_json(os.path.join(run_dir, "config.json"), {**config.to_json_dict(), "run_dir": run_dir})
    open(os.path.join(run_dir, "metrics.jsonl"), "w").close()
    return run_dir, 0


def new_run_dir_name() -> str:
    """runs/<timestamp>, with a suffix if that folder exists (two runs started in the same second)."""
    stamp = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    run_dir, suffix = stamp, 1
    while os.path.exists(run_dir):
        run_dir, suffix = f"{stamp}-{suffix}", suffix + 1
    return run_dir


def _metrics_up_to(path: str, step: int) -> list[str]:
    """The lines of metrics.jsonl for steps <= step. A last line cut short (no newline: the process was
    killed while writing it) belongs to a step after the checkpoint and is dropped; any other line that is
    not a step record is refused with the file and line."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            line_step = record["step"]
        except (ValueError, KeyError, TypeError) as exc:
            if number == len(lines) and not line.endswith("\n"):
                continue  # the unfinished last write of a killed run
            raise ValueError(f"cannot resume: {path}:{number} is not a step record ({type(exc).__name__}: {exc}); "
                             "remove or repair that line") from None  # fmt: skip
        if line_step <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def _write_text(path: str, text: str) -> None:
    """`path` replaced whole: written to `<path>.partial`, then renamed over it."""
    partial = path + ".partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def _write_json(path: str, data: dict) -> None:
    _write_text(path, json.dumps(data, indent=2))
