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
import os
import random
import shutil
import time

import torch

STEP_PREFIX = "step_"


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


def save_checkpoint(
    folder: str, *, model, reference, optimizer, rng_tensors: dict[str, torch.Tensor], state: dict
) -> None:
    from safetensors.torch import save_file, save_model  # the train extra: imported when used (cli --help without it)

    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_model(model, os.path.join(partial, "model.safetensors"))
    if reference is not None:
        save_model(reference, os.path.join(partial, "reference.safetensors"))
    optimizer_tensors, optimizer_meta = _optimizer_to_flat(optimizer)
    save_file(optimizer_tensors, os.path.join(partial, "optimizer.safetensors"))
    save_file({k: v.contiguous() for k, v in rng_tensors.items()}, os.path.join(partial, "rng.safetensors"))
    with open(os.path.join(partial, "state.json"), "w") as f:
        json.dump({**state, "optimizer": optimizer_meta}, f)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)


def load_checkpoint(folder: str, *, model, reference, optimizer) -> tuple[dict, dict[str, torch.Tensor]]:
    """Loads weights and optimizer state in place; returns (state.json, RNG tensors)."""
    from safetensors.torch import load_file, load_model

    device = next(model.parameters()).device
    missing, unexpected = load_model(model, os.path.join(folder, "model.safetensors"), device=str(device))
    if missing or unexpected:
        raise ValueError(
            f"{folder}: the checkpoint does not match the model (missing {missing}, unexpected {unexpected})"
        )
    if reference is not None:
        load_model(reference, os.path.join(folder, "reference.safetensors"), device=str(device))
    with open(os.path.join(folder, "state.json")) as f:
        state = json.load(f)
    # on CPU, like torch.load(map_location="cpu"): load_state_dict moves the state next to each parameter
    optimizer_tensors = load_file(os.path.join(folder, "optimizer.safetensors"))
    _optimizer_from_flat(optimizer, optimizer_tensors, state["optimizer"])
    return state, load_file(os.path.join(folder, "rng.safetensors"))


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


def open_run_folder(config, resume: bool) -> tuple[str, int]:
    """(run folder, last completed step). A new run gets a fresh folder (never an existing non-empty one)
    with config.json and an empty metrics.jsonl; a resumed run keeps its folder, its config.json takes the
    new step count, and metrics.jsonl is cut back to the checkpoint's step (later steps are re-run)."""
    if resume:
        run_dir = config.run_dir
        checkpoints = list_checkpoints(os.path.join(run_dir, "checkpoints"))
        if not checkpoints:
            raise FileNotFoundError(f"cannot resume {run_dir!r}: it has no checkpoint")
        step = int(os.path.basename(checkpoints[-1])[len(STEP_PREFIX) :])
        if step >= config.steps:
            raise ValueError(f"{run_dir!r} already reached step {step}; pass --steps N with N > {step}")
        metrics_path = os.path.join(run_dir, "metrics.jsonl")
        with open(metrics_path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with open(metrics_path, "w") as f:
            f.writelines(kept)
        _write_json(os.path.join(run_dir, "config.json"), config.to_json_dict())
        return run_dir, step
    run_dir = config.run_dir
    if run_dir is None:  # runs/<timestamp>, with a suffix if two runs start in the same second
        stamp = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        run_dir, suffix = stamp, 1
        while os.path.exists(run_dir):
            run_dir, suffix = f"{stamp}-{suffix}", suffix + 1
    if os.path.isdir(run_dir) and os.listdir(run_dir):
        raise FileExistsError(
            f"run folder {run_dir!r} exists and is not empty; resume it or use another --run-dir"
        )
    os.makedirs(run_dir, exist_ok=True)
    _write_json(os.path.join(run_dir, "config.json"), {**config.to_json_dict(), "run_dir": run_dir})
    open(os.path.join(run_dir, "metrics.jsonl"), "w").close()
    return run_dir, 0


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
