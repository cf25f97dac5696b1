"""The loss head (B of docs/design.md §1): every loss-side variant on per-token log-probs.

The names below load on first use: config.py reads the variant registry (variants/) while it is being imported,
before reference.py (which imports config) can load."""


def __getattr__(name):
    if name in ("LossHeadOutput", "policy_loss_reference"):
        from . import reference

        return getattr(reference, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LossHeadOutput", "policy_loss_reference"]
