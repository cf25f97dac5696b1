"""Stand-ins that let a peer's own code run outside its framework (used by the parity tests and the
benchmark suite, which call TRL's GRPOTrainer._compute_loss unbound)."""

from __future__ import annotations


class AcceleratorStandIn:
    """accelerate's Accelerator as GRPOTrainer._compute_loss uses it, for one process: gather, reduce
    and pad are identities (as accelerate's are with one process). `num_processes` only enters TRL's
    dapo / cispo / vespo normalizer, so a test can set it to check that arithmetic."""

    sync_gradients = True

    def __init__(self, num_processes: int = 1):
        self.num_processes = num_processes

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x
