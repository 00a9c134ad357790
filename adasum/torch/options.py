"""The settings of data-parallel training with adasum, defined once: :class:`Options`. ``DistributedOptimizer``,
the Lightning strategy and the DDP delta hook's state take them as keywords (or as an ``Options``), check
them here, and every rank agrees on them at construction."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from ..call.allreduce import Op
from ..runtime import exchange

__all__ = ["Options"]

_UNEXPECTED = "got unexpected keyword argument(s)"

# The names ``compression`` takes (adasum.torch.window.compress reads the same names).
_WIRES = (None, "none", "fp16", "float16", "bf16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Options:
    """How the ranks train together (every rank the same).

    Attributes:
        op: ``"adasum"`` (reduce the weight deltas of each rank's local step with Adasum), ``"sum"`` or
            ``"mean"`` (reduce the gradients before the local step).
        accumulation_steps: micro-batches per window. Their gradients add up in ``.grad``; at the boundary
            they are divided by the number of micro-batches the window actually held, so the loss of each
            micro-batch should be a mean over its samples and must not be divided by ``accumulation_steps``.
        start_copy: ``op="adasum"`` only: where the window's starting values are kept, ``"device"`` (next to
            the parameters) or ``"host"`` (pinned host memory for CUDA parameters; device memory grows only
            by the largest parameter, at the price of copies).
        skip_nonfinite: skip an update, on every rank, when the reduced gradients (sum/mean) or weight deltas
            (adasum) hold a NaN or Inf; the parameters are left as they were, ``skipped_updates`` counts it
            and rank 0 logs it once (logger ``"adasum"``). With adasum a rank whose own gradients are
            non-finite skips its local step (its optimizer state stays finite). Off: non-finite values reach
            the parameters.
        hierarchical: ``op="adasum"`` only: the deltas are averaged over the ranks of each node, then combined
            with Adasum across nodes: fewer bytes between nodes, Adasum's benefit kept for the node count.
        overlap: communicate during backward (default off: where every rank has one core, the thread
            competes with backward for it). On the backward that closes a window, buckets of parameters go
            to the lane as backward finishes them; ``step()`` waits and applies. Bitwise the results of
            ``overlap=False`` for adasum.
        bucket_bytes: with ``overlap``, the smallest bucket in bytes of parameters (the last may be smaller).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the deltas (adasum) or gradients (sum/mean) travel
            as 16-bit floats, half the bytes, and are combined in float32 or wider (fp16 travels scaled per
            layer by an agreed power of two).
        buffers: with the optimizer's ``module``, how its buffers are kept alike at the end of every window
            (collective there): ``"average"`` (each buffer's change since the last boundary averaged over
            the ranks), ``"broadcast"`` (rank 0's copied to every rank) or None (left alone).
        local_steps: local steps between combines (1: a combine at every window). With H > 1 the wrapped
            optimizer takes a plain step at every window (no MPI call), and every H windows the ranks combine
            each parameter's delta since the window's start.
        outer_lr: the outer optimizer's rate at each combine: DiLoCo's outer SGD on g = -(combined delta):
            v <- mu·v + g, params = start - outer_lr·(g + mu·v).
        outer_momentum: mu above, Nesterov where > 0 (0: params = start + combined delta).
        delay: 0 (the combine runs in the ``step()`` of the H-th local step) or 1 (it runs on a lane during
            the next window's local steps and is merged at its end).
    """

    op: str = "adasum"
    accumulation_steps: int = 1
    start_copy: str = "device"
    skip_nonfinite: bool = True
    hierarchical: bool = False
    overlap: bool = False
    bucket_bytes: int = 25 << 20
    compression: str | None = None
    buffers: str | None = "average"
    local_steps: int = 1
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    delay: int = 0

    def __post_init__(self) -> None:
        # Nothing raises here: a value that is wrong on one rank must raise on every rank, so the entry
        # points (DistributedOptimizer, DeltaState, the Lightning strategy, Horovod's wrapper) ask
        # problems() and raise what any rank found, together.
        try:
            object.__setattr__(self, "op", Op(self.op).value)
        except ValueError:
            pass  # problems() names it

    def problems(self) -> list[str]:
        """What is wrong with these settings on this rank (empty where nothing is): the one check of every
        field, which every entry point runs on every rank before it uses any of them."""
        found = list(getattr(self, "_argument_problems", ()))
        if self.op not in ("adasum", "sum", "mean"):
            found.append(f"op must be one of 'adasum', 'sum', 'mean', got {self.op!r}")
        for name in ("accumulation_steps", "bucket_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                found.append(f"{name} must be a positive integer, got {value!r}")
        if self.start_copy not in ("device", "host"):
            found.append(f"start_copy must be 'device' or 'host', got {self.start_copy!r}")
        if self.buffers not in (None, "average", "broadcast"):
            found.append(f"buffers must be 'average', 'broadcast' or None, got {self.buffers!r}")
        for name in ("skip_nonfinite", "hierarchical", "overlap"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                found.append(f"{name} must be True or False, got {value!r}")
        if self.hierarchical is True and self.op != "adasum":
            found.append(f"hierarchical=True needs op 'adasum', got op '{self.op}'")
        key = self.compression.lower() if isinstance(self.compression, str) else self.compression
        if key not in _WIRES:
            found.append(f"compression must be None, 'fp16' or 'bf16', got {self.compression!r}")
        found += self._local_problems()
        return found

    def _local_problems(self) -> list[str]:
        h, lr, mu, delay = self.local_steps, self.outer_lr, self.outer_momentum, self.delay
        found = []
        if isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1:
            found.append(f"local_steps must be an integer >= 1, got {h!r}")
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not lr > 0 or lr == float("inf"):
            found.append(f"outer_lr must be a number > 0, got {lr!r}")
        if isinstance(mu, bool) or not isinstance(mu, numbers.Real) or not 0 <= mu < 1:
            found.append(f"outer_momentum must be a number in [0, 1), got {mu!r}")
        if isinstance(delay, bool) or delay not in (0, 1):
            found.append(f"delay must be 0 or 1, got {delay!r}")
        if not found and self.overlap is True and self.uses_local_steps:
            found.append("overlap=True overlaps a combine with the backward that closes it; with local_steps > 1 "
                         "or an outer optimizer the combine follows the H-th local step instead: construct the "
                         "optimizer with overlap=False")
        return found

    @property
    def uses_local_steps(self) -> bool:
        """Whether these settings take local steps between combines (anything but ``local_steps=1``,
        ``outer_lr=1``, ``outer_momentum=0``, ``delay=0``)."""
        return not (self.local_steps == 1 and self.outer_lr == 1.0 and self.outer_momentum == 0.0
                    and self.delay == 0)

    def raise_problems(self, comm, who: str, more: str | None = None) -> None:
        """Collective over ``comm``: where any rank's settings have a problem (or ``more``, a problem of
        this rank's other arguments), raise on every rank, naming each rank and its problems: TypeError
        where a rank passed a keyword that is not a setting, else ValueError."""
        mine = "; ".join(self.problems() + ([more] if more else [])) or None
        found = exchange.failures(comm, mine, f"{who}'s settings")
        if found is not None:
            kind = TypeError if _UNEXPECTED in found else ValueError
            exchange.raise_found(comm.Get_rank(), found, kind)

    @classmethod
    def of(cls, options: "Options | None", settings: dict[str, Any], who: str,
           allowed: frozenset | None = None) -> "Options":
        """``options`` with ``settings`` (keywords) replacing its fields. A keyword that is not a setting
        (or not one of ``allowed``) does not raise here: :meth:`problems` names it with ``who`` and the
        settings there are, so that every rank raises it."""
        names = [f.name for f in dataclasses.fields(cls)]
        known = set(names) if allowed is None else set(allowed)
        unknown = sorted(set(settings) - known)
        out = dataclasses.replace(options or cls(), **{k: v for k, v in settings.items() if k in set(names)})
        extra = []
        if unknown:
            extra.append(f"{who} {_UNEXPECTED} {', '.join(map(repr, unknown))}; its settings are "
                         f"{', '.join(n for n in names if n in known)}")
        if allowed is not None and options is not None:  # an Options object: its other fields left as they are
            default = cls()
            changed = [n for n in names if n not in allowed and getattr(options, n) != getattr(default, n)]
            if changed:
                extra.append(f"{who} takes the settings {', '.join(sorted(allowed))}; the options given set "
                             f"{', '.join(f'{n}={getattr(options, n)!r}' for n in changed)}")
        object.__setattr__(out, "_argument_problems", tuple(extra))
        return out

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
