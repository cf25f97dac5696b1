"""Every public name documents itself: `help()` answers what each argument means and what comes back.

Public names: the `__all__` of grpo_kernels, grpo_kernels.advantages and grpo_kernels.trainer, every
registered advantage estimator, and the integrations' entry points. Each has its own docstring of at least
three lines; a function's docstring names every parameter; a dataclass names every field in its docstring
or comments it where it is declared (the comment is its documentation, and the CLI's help text)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re

import pytest

import grpo_kernels as gk

MODULES = ("grpo_kernels", "grpo_kernels.advantages", "grpo_kernels.trainer")
INTEGRATIONS = {
    "grpo_kernels.integrations.trl": ("policy_loss_config", "loss_normalizers", "log_trl_metrics",
                                      "unsupported_settings", "KernelOptions", "check_fsdp2_head"),
    "grpo_kernels.integrations.verl": ("policy_loss", "register_policy_losses", "linear_cross_entropy",
                                       "install_linear_cross_entropy"),
    # importing it does not import OpenRLHF
    "grpo_kernels.integrations.openrlhf": ("launch", "runtime_env", "install", "uninstall", "ray_worker_setup",
                                           "PolicyLoss", "policy_loss_config", "unsupported_options",
                                           "kl_config", "actor_forward", "logit_transform",
                                           "check_openrlhf_options", "install_actor_forward",
                                           "uninstall_actor_forward"),
    "grpo_kernels.integrations.unsloth": ("use_grpo_kernels", "UnslothLogProbsKernel", "KernelOptions",
                                          "bypass_reasons", "loss_settings", "policy_loss_config",
                                          "loss_normalizers", "unmapped_settings"),
}  # fmt: skip
# integration modules whose import imports their trainer (verl's plugin discovery loads the module to register)
PEER_AT_IMPORT = {"grpo_kernels.integrations.verl": "verl"}


def public_objects():
    found = []
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # the trainer needs the train extra
            pytest.skip(f"{module_name}: {exc}")
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                found.append((f"{module_name}.{name}", obj))
    for name, spec in gk.advantages.available().items():  # rewards / group_index: documented in estimate()
        if spec.fn.__module__.startswith("grpo_kernels."):  # not estimators other tests register
            found.append((f"estimator {name}", spec.fn))
    for module_name, names in INTEGRATIONS.items():
        peer = PEER_AT_IMPORT.get(module_name)
        if peer is not None and importlib.util.find_spec(peer) is None:
            continue  # checked where the peer is installed (the README's test environment)
        module = importlib.import_module(module_name)
        found += [(f"{module_name}.{n}", getattr(module, n)) for n in names]
    return found


def own_doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__ or "") if "__doc__" in vars(obj) or inspect.isfunction(obj) else ""


def test_every_public_name_has_a_docstring_that_names_its_arguments():
    problems = []
    for qualified, obj in public_objects():
        doc = own_doc(obj)
        if len([line for line in doc.splitlines() if line.strip()]) < 3:
            problems.append(f"{qualified}: a docstring of {len(doc.splitlines())} line(s)")
            continue
        words = set(re.findall(r"\w+", doc))
        if inspect.isfunction(obj):
            convention = ("rewards", "group_index", "num_groups") if qualified.startswith("estimator") else ()
            missing = [p for p in inspect.signature(obj).parameters if p not in words and p not in convention]
            if missing:
                problems.append(f"{qualified}: parameters not in the docstring: {missing}")
        elif dataclasses.is_dataclass(obj):
            source = inspect.getsource(obj)
            commented = set(re.findall(r"^\s+(\w+): [^\n]*#", source, flags=re.M))
            missing = [f.name for f in dataclasses.fields(obj) if f.name not in words and f.name not in commented]
            if missing:
                problems.append(f"{qualified}: fields neither in the docstring nor commented: {missing}")
    assert not problems, "\n".join(problems)
