"""The loss head (B of docs/design.md §1): every loss-side variant on per-token log-probs."""

from .reference import LossHeadOutput, policy_loss_reference

__all__ = ["LossHeadOutput", "policy_loss_reference"]
