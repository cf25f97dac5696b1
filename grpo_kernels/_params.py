"""LM-head parameters as distributed trainers hand them over: FSDP2 DTensors and DeepSpeed ZeRO-3 stubs.

Called by the functional layer before any other check, for `weight` and `bias`:

* a DTensor sharded or replicated over a 1-D device mesh (FSDP2's `fully_shard`, outside the module's
  forward) is gathered with `full_tensor(grad_placements=[Partial("avg")])`: the gradient that flows
  back is marked as a per-rank partial to be averaged, so FSDP's reduce-scatter averages the ranks'
  gradients exactly as it does for the rest of the model (with the default Replicate placement each
  rank would keep only its own rows of its own gradient: silently wrong);
* a DTensor over a mesh of more dimensions (FSDP x TP, HSDP) is refused with what to pass instead;
* a ZeRO-3 partitioned parameter (a `ds_id` attribute, 0 elements outside the engine's forward) is
  refused, naming the two ways out.
"""

from __future__ import annotations

import torch

from . import _checks as chk


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without torch.distributed
        return None
    return DTensor


def gather_lm_head_param(name: str, param, tp_group=None):
    """The parameter as a plain tensor the kernels can read (see the module docstring)."""
    if param is None or not isinstance(param, torch.Tensor):
        return param
    if hasattr(param, "ds_id") and param.numel() == 0:
        chk.fail(
            f"{name} is a DeepSpeed ZeRO-3 partitioned parameter (ds_id={param.ds_id}, 0 elements on this "
            "rank outside the model's forward). Either call grpo_kernels inside the model's forward (ZeRO-3 "
            f"gathers the parameter there), or wrap the call in `with deepspeed.zero.GatheredParameters("
            f"[{name}]):` (add modifier_rank=None; gradients then reach the partitioned parameter)"
        )
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(param, dtensor):
        return param
    from torch.distributed.tensor import Partial

    if tp_group is not None:
        chk.fail(
            f"{name} is a DTensor and tp_group was given: with tp_group, pass this rank's block of rows as a "
            f"plain tensor ({name}.to_local())"
        )
    mesh = param.device_mesh
    if mesh.ndim != 1:
        chk.fail(
            f"{name} is a DTensor over a {mesh.ndim}-D device mesh (placements {param.placements}): gathering "
            "it here could not keep each dimension's gradient reduction right. For a vocabulary-parallel "
            "(tensor-parallel) head pass the local block (`.to_local()`) with tp_group= (the TP group); "
            "otherwise pass `full_tensor(grad_placements=...)` with the placements your sharding needs"
        )
    return param.full_tensor(grad_placements=[Partial("avg")])
