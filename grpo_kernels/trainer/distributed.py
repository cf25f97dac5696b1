"""The reference trainer on several processes: `torchrun --nproc_per_node=K -m grpo_kernels.train ...`.

Data parallel, with every rank holding the same global batch and doing 1/K of the work:
  rollouts   the step's prompts are drawn on every rank alike; each rank generates its contiguous block
             of prompt groups (in one generate call), each group's tokens drawn from a generator seeded by
             (seed, step, call, group), and the completions are all-gathered: the global batch is the same
             whatever K is, and the same as a plain run's (one process without torchrun samples every group
             under the same seeds), so one seed is one run however it is launched
  rewards,   on the global batch, identically on every rank (cheap next to the model)
  advantages
  log-probs  old-policy / reference / entropy passes: each rank its block of rows, all-gathered
  updates    each rank its block of rows, the loss normalised by the GLOBAL token and sequence counts
             with dp_size = K; the policy runs inside DistributedDataParallel, whose gradient average
             then gives the single-process gradient; metrics are reduced over ranks
  files      run folder, metrics, plots, checkpoints and the final model from rank 0 only
Backends: gloo on CPU, NCCL on CUDA (one GPU per process, LOCAL_RANK).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world: int
    device: torch.device
    owns_group: bool  # this module initialised the process group (and destroys it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def block(self, n: int) -> slice:
        """This rank's contiguous block of n items (the first n % world ranks get one more)."""
        base, extra = divmod(n, self.world)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    def all_gather_objects(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def from_main(self, make):
        """Run make() on rank 0 and hand its result (or its exception, re-raised) to every rank."""
        box = [None]
        if self.is_main:
            try:
                box[0] = ("ok", make())
            except Exception as exc:  # noqa: BLE001 - every rank raises it, none waits forever
                box[0] = ("error", exc)
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise value
        return value

    def gather_rows(self, local: torch.Tensor, n_rows: int) -> torch.Tensor:
        """[rows of this block, ...] -> [n_rows, ...] on every rank (blocks in rank order)."""
        sizes = [self.block_size(n_rows, r) for r in range(self.world)]
        width = max(sizes)
        padded = torch.zeros((width, *local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)])

    def block_size(self, n: int, rank: int) -> int:
        base, extra = divmod(n, self.world)
        return base + (1 if rank < extra else 0)

    def sum(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t)
        return float(t.item())

    @property
    def comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def init_from_env(device_name: str) -> DistContext | None:
    """A DistContext when started by torchrun (WORLD_SIZE / RANK / MASTER_ADDR set), else None."""
    if not launched_by_torchrun():
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    return DistContext(rank=rank, world=world, device=device, owns_group=owns)


def group_seed(seed: int, step: int, call: int, group: int) -> int:
    """The generator seed of one prompt group's sampling: the same on any rank and for any K."""
    return (seed * 1_000_003 + step * 10_007 + call * 101 + group) % (2**63 - 1)


class ShardedSampler:
    """Wraps a sampler: each rank generates its block of groups (consecutive rows of `group_rows`), each
    group under its own seed, and every rank gets all the completions. Every run samples through it: with
    ctx None (a plain run, one process) the one process generates every group under the same seeds, so a
    plain run, torchrun with 1 process and torchrun with K processes draw the same completions.

    A sampler with `generate_groups` (rollout.HFSampler) takes a rank's groups in one call per prompt width,
    each group still drawn from its own seed; `batched = False` (or GRPO_KERNELS_PER_GROUP_SAMPLING=1)
    keeps one call per group, the reference the tests compare it with."""

    def __init__(self, inner, ctx: DistContext | None, group_rows: int, seed: int):
        self.inner, self.ctx, self.group_rows, self.seed = inner, ctx, group_rows, seed
        per_group = os.environ.get("GRPO_KERNELS_PER_GROUP_SAMPLING", "0")
        if per_group not in ("0", "1"):
            raise ValueError(f"GRPO_KERNELS_PER_GROUP_SAMPLING must be 0 or 1, got {per_group!r}")
        self.batched = per_group == "0"
        self.step, self.calls = 0, 0

    def begin_step(self, step: int) -> None:
        self.step, self.calls = step, 0

    def sync_weights(self, model) -> None:
        self.inner.sync_weights(model)

    def generate(self, prompt_tokens: list[list[int]], max_new_tokens: int):
        unit = self.group_rows if len(prompt_tokens) % self.group_rows == 0 else 1
        groups = [prompt_tokens[i : i + unit] for i in range(0, len(prompt_tokens), unit)]
        mine = range(len(groups)) if self.ctx is None else range(len(groups))[self.ctx.block(len(groups))]
        call = self.calls
        self.calls += 1
        seeds = [group_seed(self.seed, self.step, call, g) for g in mine]
        if self.batched and getattr(self.inner, "groups_exact", False) and seeds:
            # the same draws in one generate call per prompt width (rollout.HFSampler.generate_groups)
            local = self.inner.generate_groups([groups[g] for g in mine], seeds, max_new_tokens)
        else:  # one call per group, each after seeding torch's global generator with the group's seed
            local = []
            for g, seed in zip(mine, seeds):
                torch.manual_seed(seed)
                completions, truncated, logprobs = self.inner.generate(groups[g], max_new_tokens)
                local.append((completions, truncated, logprobs))
        blocks = [local] if self.ctx is None else self.ctx.all_gather_objects(local)
        parts = [item for block in blocks for item in block]
        completions = [c for part in parts for c in part[0]]
        truncated = [t for part in parts for t in part[1]]
        logprobs = None if any(part[2] is None for part in parts) else [x for part in parts for x in part[2]]
        return completions, truncated, logprobs


class LossModule(torch.nn.Module):
    """The policy and a loss computed inside forward, so DistributedDataParallel sees every parameter
    (the LM-head weight included) used in its forward and averages every gradient."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, compute_loss, *args, **kwargs):
        return compute_loss(self.policy, *args, **kwargs)


class FSDPState:
    """--fsdp: the policy sharded by FSDP2 (fully_shard on each decoder layer, the decoder and the root),
    with an unsharded mirror of the model and its optimizer that checkpoints, the reference reset and
    the final model are read from and written to (the checkpoint format stays that of one process)."""

    def __init__(self, policy, ctx: DistContext, make_optimizer):
        import copy

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.policy, self.ctx = policy, ctx
        self.mirror = copy.deepcopy(policy)
        self.mirror_optimizer = make_optimizer(self.mirror)
        mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        decoder = policy.get_decoder()
        for layer in getattr(decoder, "layers", []):
            fully_shard(layer, mesh=mesh)
        fully_shard(decoder, mesh=mesh)
        fully_shard(policy, mesh=mesh)
        self.optimizer = make_optimizer(policy)  # over the sharded (DTensor) parameters

    def pull(self) -> None:
        """Mirror <- the sharded policy and optimizer (a collective: every rank calls it)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        self.mirror.load_state_dict(get_model_state_dict(self.policy, options=full))
        optim_state = get_optimizer_state_dict(self.policy, self.optimizer, options=full)
        set_optimizer_state_dict(self.mirror, self.mirror_optimizer, optim_state_dict=optim_state, options=full)

    def push(self) -> None:
        """The sharded policy and optimizer <- mirror (after a checkpoint was loaded into the mirror)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.policy, self.mirror.state_dict(), options=full)
        optim_state = get_optimizer_state_dict(self.mirror, self.mirror_optimizer, options=full)
        set_optimizer_state_dict(self.policy, self.optimizer, optim_state_dict=optim_state, options=full)
