"""Ranks of a process group agree before they compute (``tp_group``, ``entropy_group``).

The vocabulary-parallel head (``tp_group``) needs every rank to pass the same hidden states, targets, mask,
per-token inputs, config and scalars, and each rank its own block of the head; the top-entropy quantile over
data-parallel ranks (``entropy_group``) needs the same config and global normalizers on every rank. A rank
that breaks this contract used to return a plausible wrong loss, or one rank raised while its peers waited
in a collective. Here every rank brings to the call's FIRST collective (the all-gather of the vocabulary
block sizes, or of the entropy counts: it exists anyway) a few more int64 slots:

  [MAGIC, error code, size (block rows / entropy count), check on, the function called, block sample,
   target min, target max, one fingerprint per input that must agree (SLOTS)]

so every rank sees every rank's row and decides the same thing, with no extra round trip:
  * a rank whose own checks failed (error code != 0) -> every rank raises that rank's message;
  * fingerprints that differ -> every rank raises one message naming what differs, rank by rank;
  * two non-empty weight blocks with the same sample fingerprint (each rank passing the whole head) -> refused.
Only on failure is a second collective made (``all_gather_object``: the messages), so a failure costs one
more round trip and success none.

Fingerprints: the input's bytes read as int64 words (no copy), multiplied by fixed pseudo-random odd int64
weights (one per position) and summed with int64 wrap-around, plus a hash of the shape and dtype. Integer
sums do not depend on the order of the reduction, so ranks whose inputs agree bitwise always agree; a single
changed element always changes the sum (it changes one word, its weight is odd, so the product is not 0 mod
2^64); several changes collide with probability ~2^-64. Cost: one read of each input and O(bytes / 8) integer
multiply-adds, chunked so the temporaries stay within CHUNK_ELEMENTS x 8 bytes.
``GRPO_KERNELS_CHECK_AGREEMENT=0`` turns the fingerprints off (the error code and the sizes still
travel, so failures stay collective); every rank must set it alike (a mix is refused).
"""

from __future__ import annotations

import hashlib
import os

import torch

ENV_SWITCH = "GRPO_KERNELS_CHECK_AGREEMENT"
MAGIC = 0x6B67_2024  # a row that does not start with it came from another protocol (a different call)
# Inputs that must be equal on every rank, in a fixed order (the payload has the same width for every call)
SLOTS = (
    "hidden", "targets", "mask", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs",
    "is_weights", "token_weights", "logprobs", "entropy", "cu_seqlens", "bias_present", "temperature", "softcap",
    "logit_scale", "config", "num_tokens", "num_sequences", "dp_size", "grad_accum_steps", "ignore_index",
    "compute_entropy", "check_finite", "batch_invariant", "backend", "schedule", "max_extra_memory",
)  # fmt: skip
HEADER = ("magic", "error", "size", "check_on", "function", "block_sample", "target_min", "target_max")
WIDTH = len(HEADER) + len(SLOTS)
NO_ERROR, INPUT_ERROR, OTHER_ERROR = 0, 1, 2
CHUNK_ELEMENTS = 1 << 22  # elements hashed per step: bounds the int64 temporaries (64 MiB)
BLOCK_SAMPLE_ROWS = 64  # rows of a weight block fingerprinted to tell blocks apart (first, last, evenly spaced)

_weights: dict = {}


def enabled() -> bool:
    """The fingerprints are on unless GRPO_KERNELS_CHECK_AGREEMENT=0."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _mixed(index: torch.Tensor) -> torch.Tensor:
    """splitmix64-style odd int64 weights of int64 positions (wrap-around arithmetic)."""
    z = index * _GOLDEN + _MIX2
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    return (z ^ (z >> 31)) | 1


def _position_weights(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _weights:
        _weights[key] = _mixed(torch.arange(CHUNK_ELEMENTS, dtype=torch.int64, device=device))
    return _weights[key]


def _words(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's bytes as int64 words (8 bytes each: 4 bf16, 2 fp32, 8 bools per word; no copy for a contiguous
    tensor) and the < 8 bytes left over, as int64 values of single bytes."""
    flat = x.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    raw = flat.view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # a storage offset that is not a multiple of 8 bytes: copy once
        words = raw[:whole].clone().view(torch.int64)
    return words, raw[whole:].to(torch.int64)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum a * b in int64 wrap-around arithmetic: exact, so the same on every device and in any order
    (torch.dot on CPU, 5x faster there than the product and sum; CUDA's dot has no int64)."""
    return torch.dot(a, b) if a.device.type == "cpu" else (a * b).sum()


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """0-d int64 on x's device: a hash of x's shape and bits (see the module docstring). Its bytes are read as
    int64 words, so an element never straddles two words and one changed element changes one word."""
    words, tail = _words(x)
    weights = _position_weights(words.device)
    total = torch.tensor(value_hash((tuple(x.shape), str(x.dtype))), dtype=torch.int64, device=words.device)
    for step, start in enumerate(range(0, words.numel(), CHUNK_ELEMENTS)):
        part = words[start:start + CHUNK_ELEMENTS]
        # each chunk's sum times its own odd multiplier: the same values in another chunk hash differently
        chunk_sum = _dot(part, weights[: part.numel()])
        total = total + chunk_sum * (_s64(_GOLDEN * (2 * step + 1)) | 1)
    if tail.numel():
        total = total + _dot(tail, weights[-tail.numel():])
    return total


def block_sample(weight: torch.Tensor) -> torch.Tensor | int:
    """Fingerprint of up to BLOCK_SAMPLE_ROWS rows of a weight block (first, last, evenly spaced): two ranks
    holding the same block (the whole head on every rank) give the same value; 0 for an empty block."""
    rows = weight.shape[0]
    if rows == 0:
        return 0
    picks = torch.linspace(0, rows - 1, min(rows, BLOCK_SAMPLE_ROWS), device=weight.device).round().long()
    return fingerprint(weight.detach().index_select(0, picks))


def value_hash(value) -> int:
    """int64 hash of a Python value through its repr (floats' repr round-trips exactly; stable across
    processes, unlike hash())."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return _s64(int.from_bytes(digest, "little"))


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {list(value.shape)}, {str(value.dtype).replace('torch.', '')}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def comm_device(group) -> torch.device:
    """The device a collective of this group runs on (gloo: CPU; NCCL: the current CUDA device)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Agreement:
    """What this rank brings to the first collective of one call over `group` (see the module docstring).

    The functional layer fills it (`tensors`, `values`, `block`, `targets`) while it validates, records a
    failure instead of raising (`failed`), then `exchange` makes the collective and raises the same error
    on every rank, or returns every rank's size. The loss head makes the entropy_group's exchange itself."""

    def __init__(self, group, group_name: str, function: str):
        self.group = group
        self.group_name = group_name
        self.function = function
        self.check = enabled()
        self.failure: BaseException | None = None
        self.tensors: dict[str, torch.Tensor] = {}  # must be bitwise equal on every rank
        self.values: dict[str, object] = {}  # Python values that must be equal on every rank
        self.block = None  # this rank's weight block: must differ from every other rank's
        self.targets = None  # (targets, valid): their min / max travel, checked against the total vocabulary
        self.exchanged = False  # the collective was made (a later failure no longer needs to join it)

    def failed(self, exc: BaseException) -> None:
        self.failure = exc

    # -- the collective ------------------------------------------------------------------------------

    def _payload(self, size: int, device: torch.device) -> torch.Tensor:
        head = [MAGIC, NO_ERROR, int(size), int(self.check), value_hash(self.function), 0, 0, -1]
        slots = [0] * len(SLOTS)
        on_device = []  # (position, 0-d int64 tensor): gathered in one copy to the communication device
        if self.failure is not None:
            head[1] = INPUT_ERROR if isinstance(self.failure, ValueError) else OTHER_ERROR
        elif self.check:
            for name, value in self.values.items():
                slots[SLOTS.index(name)] = value_hash(value)
            for name, tensor in self.tensors.items():
                if tensor is not None:
                    on_device.append((len(HEADER) + SLOTS.index(name), fingerprint(tensor)))
            if self.block is not None:
                sample = block_sample(self.block)
                if isinstance(sample, torch.Tensor):
                    on_device.append((HEADER.index("block_sample"), sample))
        if self.failure is None and self.targets is not None:
            targets, valid = self.targets
            t = targets.reshape(-1).long()
            v = valid.reshape(-1)
            big = torch.iinfo(torch.int64).max
            on_device.append((HEADER.index("target_min"), torch.where(v, t, big).min() if t.numel() else
                              torch.tensor(0, device=t.device)))  # fmt: skip
            on_device.append((HEADER.index("target_max"), torch.where(v, t, -1).max() if t.numel() else
                              torch.tensor(-1, device=t.device)))  # fmt: skip
        payload = torch.tensor(head + slots, dtype=torch.int64, device=device)
        if on_device:
            where = torch.tensor([p for p, _ in on_device], device=device)
            payload[where] = torch.stack([v.to(torch.int64).reshape(()) for _, v in on_device]).to(device)
        return payload

    def exchange(self, size: int) -> list[dict]:
        """The call's first collective: an all-gather of every rank's row. Returns the rows (dicts keyed by
        HEADER and SLOTS) in group order, or raises the same error on every rank."""
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        device = comm_device(self.group)
        mine = self._payload(size, device)
        self.exchanged = True
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=self.group)
        table = [dict(zip(HEADER + SLOTS, row.tolist())) for row in rows]
        self._decide(table)
        return table

    def _decide(self, table: list[dict]) -> None:
        import torch.distributed as dist

        where = f"{self.group_name} (in {self.function})"
        if any(row["magic"] != MAGIC for row in table):
            bad = [r for r, row in enumerate(table) if row["magic"] != MAGIC]
            raise RuntimeError(f"grpo_kernels: rank(s) {bad} of {where} sent something else to this collective: "
                               "the ranks are not making the same call")  # fmt: skip
        failing = [r for r, row in enumerate(table) if row["error"] != NO_ERROR]
        if failing:
            messages = [None] * len(table)
            mine = None
            if self.failure is not None:
                mine = (type(self.failure).__name__, str(self.failure))
            dist.all_gather_object(messages, mine, group=self.group)
            first = failing[0]
            kind, text = messages[first] or ("RuntimeError", "(no message)")
            others = f" (also rank(s) {failing[1:]})" if len(failing) > 1 else ""
            message = (f"{text} [rank {first} of {where} refused its inputs{others}; every rank of the group raises "
                       "this error]")  # fmt: skip
            error = ValueError(message) if kind == "ValueError" else RuntimeError(f"{kind}: {message}")
            if self.failure is not None:
                raise error from self.failure
            raise error
        checks = {row["check_on"] for row in table}
        if len(checks) > 1:
            on = [r for r, row in enumerate(table) if row["check_on"]]
            raise ValueError(f"grpo_kernels: {ENV_SWITCH}=0 is set on some ranks of {where} but not on rank(s) "
                             f"{on}: set it alike on every rank")  # fmt: skip
        differ = [key for key in ("function",) + SLOTS if len({row[key] for row in table}) > 1]
        if differ:
            self._disagreement(table, differ, where)
        if self.check:
            seen: dict[int, int] = {}
            for r, row in enumerate(table):
                if row["size"] == 0 or row["block_sample"] == 0:
                    continue
                if row["block_sample"] in seen:
                    raise ValueError(
                        f"grpo_kernels: ranks {seen[row['block_sample']]} and {r} of {where} hold the same weight "
                        f"block ({row['size']} rows each, equal on {BLOCK_SAMPLE_ROWS} sampled rows): with "
                        "tp_group each rank passes its own block of the head's rows (rank r's rows follow ranks "
                        "0..r-1's), not the whole head; pass tp_group=None to compute with the whole head on "
                        f"each rank [every rank of the group raises this error; {ENV_SWITCH}=0 turns the check off]"
                    )  # fmt: skip
                seen[row["block_sample"]] = r

    def _disagreement(self, table, differ, where) -> None:
        import torch.distributed as dist

        mine = {}
        for key in differ:
            if key == "function":
                mine[key] = self.function
            elif key in self.tensors:
                mine[key] = describe(self.tensors[key]) if self.tensors[key] is not None else "None"
            else:
                mine[key] = describe(self.values.get(key))
        described = [None] * len(table)
        dist.all_gather_object(described, mine, group=self.group)
        parts = []
        for key in differ:
            groups: dict[int, list[int]] = {}
            for r, row in enumerate(table):
                groups.setdefault(row[key], []).append(r)
            ranks = "; ".join(
                f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {described[rs[0]][key]}"
                + ("" if key in ("function",) or key not in self.tensors else f" #{h & 0xFFFFFFFF:08x}")
                for h, rs in groups.items()
            )  # fmt: skip
            parts.append(f"{key} ({ranks})")
        contract = ("with tp_group, hidden, targets, mask and every per-token input, the config and the scalar "
                    "arguments must be the same on every rank" if self.group_name == "tp_group" else
                    "with entropy_group, the config, the global normalizers (num_tokens, num_sequences, dp_size, "
                    "grad_accum_steps) and the options must be the same on every rank")  # fmt: skip
        raise ValueError(
            f"grpo_kernels: the ranks of {where} disagree on {', '.join(differ)}: " + "; ".join(parts)
            + f". {contract[0].upper() + contract[1:]} (found by fingerprints in the call's first collective; "
            f"every rank of the group raises this error; {ENV_SWITCH}=0 turns the check off)"
        )

    def fail_together(self, check) -> None:
        """A check that every rank knows (from the exchanged rows) fails on some rank: each rank runs it,
        the messages are gathered (a second collective, on failure only) and every rank raises the first."""
        import torch.distributed as dist

        mine = None
        try:
            check()
        except ValueError as exc:
            mine = str(exc)
        messages = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(messages, mine, group=self.group)
        first = next((r for r, m in enumerate(messages) if m is not None), None)
        if first is None:  # pragma: no cover - the rows said a rank would fail
            raise RuntimeError(f"grpo_kernels: ranks of {self.group_name} disagree on a check that passed everywhere")
        raise ValueError(f"{messages[first]} [on rank {first} of {self.group_name}; every rank of the group raises "
                         "this error]")  # fmt: skip


def join_failed(agreement: Agreement, exc: BaseException) -> None:
    """A rank whose own checks failed still makes the group's first collective, carrying the error, so
    its peers raise the same error instead of waiting; then raises it here too."""
    agreement.failed(exc)
    agreement.exchange(0)
    raise exc  # pragma: no cover - exchange raised
