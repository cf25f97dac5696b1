"""What the OpenRLHF tests share: `require_openrlhf` (skip, or fail where the environment must have it), and
test-only stand-ins for the GPU packages OpenRLHF 0.11.2 imports unconditionally, so that its modules load on
a CPU machine (as OpenRLHF's own CPU tests do). The adapter needs none of the stand-ins: on OpenRLHF's
supported setup flash-attn and vLLM are installed.

* flash_attn: `openrlhf/models/ring_attn_utils.py` (reached from `openrlhf.models`) imports
  `flash_attn.bert_padding` (unpad_input, pad_input, index_first_axis, rearrange) and
  `flash_attn.utils.distributed.all_gather`. The stand-ins below compute what flash-attn's do (packing a
  padded batch into one row and back), so OpenRLHF's packed-samples path runs for real in the tests.
* vllm: `openrlhf/trainer/ray/__init__.py` imports its vLLM engine module, which imports vllm at the top;
  the PPO actor module lives in that package. Nothing in the tests calls vLLM: a module whose attributes are
  placeholders is enough.

Each stand-in is put in `sys.modules` only when the real package cannot be imported.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
from unittest.mock import MagicMock

import torch


SUPPORTED = "0.11.2"
ENVIRONMENT = (
    "the OpenRLHF test environment of .ci/steps/openrlhf.sh (README, 'Use with OpenRLHF': "
    f"pip install --no-deps openrlhf=={SUPPORTED} beside the [parity] extra)"
)


def require_openrlhf() -> None:
    """Skip the calling test module unless OpenRLHF 0.11.2 is installed; with GRPO_KERNELS_REQUIRE_OPENRLHF=1
    (the CI step that installs it) fail instead, so that a broken install cannot pass as skipped tests."""
    import pytest

    try:
        version = importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version == SUPPORTED:
        return
    reason = (
        f"OpenRLHF is not installed; these tests run in {ENVIRONMENT}"
        if version is None
        else f"openrlhf=={version} is installed, the adapter is pinned to {SUPPORTED}"
    )
    if os.environ.get("GRPO_KERNELS_REQUIRE_OPENRLHF") == "1":
        pytest.fail(f"GRPO_KERNELS_REQUIRE_OPENRLHF=1: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__grpo_kernels_test_stub__ = True
    return module


def _missing(name: str) -> bool:
    if name in sys.modules:
        return False
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _flash_attn_modules() -> dict[str, types.ModuleType]:
    from einops import rearrange

    def index_first_axis(x, indices):  # rows of x (flattened [B * S, ...]) at indices
        return x.index_select(0, indices)

    def unpad_input(hidden_states, attention_mask, unused_mask=None):
        """[B, S, ...] + [B, S] mask -> ([N, ...] kept rows, their flat indices, cu_seqlens, max length,
        lengths), flash-attn 2.7+'s five outputs."""
        lengths = attention_mask.sum(dim=-1, dtype=torch.int32)
        indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
        flat = rearrange(hidden_states, "b s ... -> (b s) ...")
        return index_first_axis(flat, indices), indices, cu_seqlens, int(lengths.max()), lengths

    def pad_input(hidden_states, indices, batch, seqlen):
        """[N, ...] rows back to [B, S, ...] at their flat indices, zeros elsewhere (differentiable)."""
        out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
        out = out.index_put((indices,), hidden_states)
        return rearrange(out, "(b s) ... -> b s ...", b=batch)

    def all_gather(input_, process_group):  # concatenation along dim 0 over the group
        world = torch.distributed.get_world_size(process_group)
        out = input_.new_empty((world * input_.shape[0], *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, input_.contiguous(), group=process_group)
        return out

    root = _module("flash_attn")
    bert_padding = _module("flash_attn.bert_padding")
    bert_padding.index_first_axis = index_first_axis
    bert_padding.unpad_input = unpad_input
    bert_padding.pad_input = pad_input
    bert_padding.rearrange = rearrange
    utils = _module("flash_attn.utils")
    distributed = _module("flash_attn.utils.distributed")
    distributed.all_gather = all_gather
    root.bert_padding, root.utils, utils.distributed = bert_padding, utils, distributed
    return {m.__name__: m for m in (root, bert_padding, utils, distributed)}


def _vllm_modules() -> dict[str, types.ModuleType]:
    modules = {}
    for name in ("vllm", "vllm.inputs", "vllm.utils"):
        module = _module(name)
        module.__getattr__ = lambda attr, _name=name: MagicMock(name=f"{_name}.{attr}")
        modules[name] = module
    modules["vllm"].__version__ = "0.0.0+grpo-kernels-test-stub"
    return modules


def install_stubs() -> list[str]:
    """Put the stand-ins of whichever of flash_attn / vllm cannot be imported into sys.modules; returns the
    names of the modules stubbed. For a process of its own (a subprocess, a Ray worker); in the test process
    use `stubs()`, which takes them out again."""
    stubbed = []
    for top, make in (("flash_attn", _flash_attn_modules), ("vllm", _vllm_modules)):
        if _missing(top):
            modules = make()
            sys.modules.update(modules)
            stubbed += list(modules)
    return stubbed


@contextlib.contextmanager
def stubs():
    """The stand-ins while OpenRLHF's modules are imported (they bind what they import), then out of
    sys.modules again, as OpenRLHF's own CPU test does: a later test that looks for vLLM or flash-attn in the
    same process must not find them."""
    stubbed = install_stubs()
    try:
        yield stubbed
    finally:
        for name in stubbed:
            if name in sys.modules and vars(sys.modules[name]).get("__grpo_kernels_test_stub__"):
                del sys.modules[name]


def eager_compute_entropy() -> None:
    """OpenRLHF wraps `compute_entropy` (softmax entropy of the full logits, its own path) in torch.compile at
    import; on a CPU its first call compiles for about two minutes in every test process. Run it eagerly, as
    OpenRLHF's own CPU test does: the same formula (the value differs at most in fp32 rounding)."""
    import openrlhf.models.actor as actor
    import openrlhf.models.utils as utils

    eager = getattr(utils.compute_entropy, "_torchdynamo_orig_callable", None)
    if eager is not None:
        utils.compute_entropy = actor.compute_entropy = eager
