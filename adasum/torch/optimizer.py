"""``DistributedOptimizer``: any torch optimizer, data-parallel over MPI with Adasum on weight deltas
(docs/design.md), or with a plain sum/mean of the gradients, with local micro-batch accumulation.

Adasum combines what each rank's optimizer *would do*: at a boundary every rank takes its own local step,
the per-parameter deltas (new - start) are combined with Adasum, one layer per parameter tensor, and every
rank sets its parameters to start + combined delta. Optimizer state (momentum, Adam moments) stays local.
With ``op="sum"`` or ``"mean"`` the gradients are reduced before the local step, as data-parallel training
usually does, and the optimizer state stays identical on every rank.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Any, Callable

import torch
from mpi4py import MPI

from ..allreduce import Op, adasum_allreduce_inplace
from ..context import library_comm
from ..launch import check_launch
from .accumulate import AccumulationWindow

__all__ = ["DistributedOptimizer"]

_log = logging.getLogger("adasum")


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` (SGD, Adam, AdamW, anything with ``param_groups`` and ``step()``) for training on
    every rank of ``comm``. It holds the wrapped optimizer (``.optimizer``) rather than re-implementing it:
    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own.

    Collective: every rank of ``comm`` constructs it with the same settings and the same parameter shapes,
    and calls ``step()`` the same number of times. The constructor checks the settings across ranks.

    The training loop (Accelerate's convention)::

        for i, (x, y) in enumerate(shard):
            loss_fn(model(x), y).backward()
            if i == len(shard) - 1:
                optimizer.force_boundary()  # a short last window is averaged by its own count
            optimizer.step()                # reduces and updates only where a window closes
            scheduler.step()                # a BoundaryScheduler: once per window
            optimizer.zero_grad()           # does nothing while a window is open

    Args:
        optimizer: the torch optimizer to wrap; it keeps doing the actual update.
        op: ``"adasum"`` (reduce the weight deltas of each rank's local step with Adasum), ``"sum"`` or
            ``"mean"`` (reduce the gradients before the local step).
        accumulation_steps: micro-batches per window. Their gradients add up in ``.grad``; at the boundary
            they are divided by the number of micro-batches the window actually held, so the loss of each
            micro-batch should be a mean over its samples and must not be divided by ``accumulation_steps``.
        comm: an mpi4py intracommunicator; default ``MPI.COMM_WORLD``.
        start_copy: ``op="adasum"`` only: where the parameters' starting values are kept during a boundary.
            ``"device"``: next to the parameters (one extra copy of the parameters in device memory, kept
            between steps). ``"host"``: in host memory (pinned for CUDA parameters); device memory grows only
            by the largest parameter tensor, at the price of one device-to-host copy of the parameters
            before the local step and two host-to-device copies after it. The same for CPU models.
        grad_scaler: a ``torch.amp.GradScaler`` whose ``scale(loss).backward()`` produced the gradients. The
            optimizer then unscales at the boundary and updates the scale itself, from the non-finite check
            that all ranks share, so every rank keeps the same scale. Do not call the scaler's ``step``,
            ``unscale_`` or ``update`` yourself.
        hierarchical: ``op="adasum"`` only: the deltas are averaged over the ranks of each node, then combined
            with Adasum across nodes (``adasum_allreduce(..., hierarchical=True)``): fewer bytes between
            nodes, Adasum's benefit kept for the node count.
        skip_nonfinite: skip an update, on every rank, when the reduced gradients (sum/mean) or weight deltas
            (adasum) hold a NaN or Inf; the parameters are left as they were, ``skipped_updates`` counts it
            and rank 0 logs it once (logger ``"adasum"``). With adasum a rank whose own gradients are
            non-finite skips its local step (its optimizer state stays finite); the other ranks have taken
            theirs, and their optimizer state keeps it. Off: non-finite values reach the parameters.

    Attributes:
        is_boundary: whether the last ``step()`` closed a window.
        step_was_skipped: whether that boundary's update was skipped for non-finite values.
        skipped_updates: boundaries skipped so far.
        boundaries: windows closed so far.
    """

    # GradScaler.step(opt) hands scaling over to optimizers that say this; step() then tells the user to
    # pass the scaler to the constructor instead (the scaler's own update would diverge across ranks).
    _step_supports_amp_scaling = True

    def __init__(self, optimizer, *, op: str | Op = "adasum", accumulation_steps: int = 1,
                 comm: MPI.Intracomm | None = None, start_copy: str = "device", grad_scaler=None,
                 skip_nonfinite: bool = True, hierarchical: bool = False):
        # torch.optim.Optimizer.__init__ is not called: the wrapped optimizer owns groups, state, defaults.
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer; wrap the torch optimizer only once")
        if not callable(getattr(optimizer, "step", None)) or not hasattr(optimizer, "param_groups"):
            raise TypeError(f"optimizer must be a torch optimizer with param_groups and step(), got "
                            f"{type(optimizer).__name__}")
        try:
            self.op = Op(op).value
        except ValueError:
            raise ValueError(f"op must be one of 'adasum', 'sum', 'mean', got {op!r}") from None
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py intracommunicator, got {type(comm).__name__}")
        check_launch()  # a job whose processes MPI does not see raises here
        if start_copy not in ("device", "host"):
            raise ValueError(f"start_copy must be 'device' or 'host', got {start_copy!r}")
        if hierarchical and self.op != "adasum":
            raise ValueError(f"hierarchical=True needs op 'adasum', got op '{self.op}'")
        if grad_scaler is not None and not all(callable(getattr(grad_scaler, m, None))
                                               for m in ("scale", "update", "get_scale", "is_enabled")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        self.optimizer = optimizer
        self.comm = comm
        self.start_copy = start_copy
        self.grad_scaler = grad_scaler
        self.skip_nonfinite = bool(skip_nonfinite)
        self.hierarchical = bool(hierarchical)
        self._window = AccumulationWindow(accumulation_steps)
        self.is_boundary = False
        self.step_was_skipped = False
        self.skipped_updates = 0
        self.boundaries = 0
        self._prepared = False       # the closing window's gradients are averaged (and reduced) already
        self._scaler_good_steps = 0  # boundaries since the scale last changed (GradScaler's growth tracker)
        self._start: list[torch.Tensor] = []
        self._check_agreement()

    # --- the wrapped optimizer's own attributes ------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer. Collective in effect: every rank must add the same shapes."""
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str):
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __getstate__(self):
        raise TypeError("a DistributedOptimizer cannot be pickled or copied (it holds an MPI communicator); "
                        "save its state_dict() instead")

    def __repr__(self) -> str:
        return (f"DistributedOptimizer(op={self.op!r}, accumulation_steps={self.accumulation_steps}, "
                f"size={self.comm.Get_size()}, optimizer={self.optimizer!r})")

    # --- accumulation ----------------------------------------------------------------------------------------

    @property
    def accumulation_steps(self) -> int:
        return self._window.steps

    @property
    def micro_steps(self) -> int:
        """Micro-batches recorded in the open window (0 right after a boundary)."""
        return self._window.seen

    @property
    def sync_gradients(self) -> bool:
        """Whether the next ``step()`` closes a window (the moment to clip, see :meth:`finalize_gradients`)."""
        return self._window.closes_next

    def force_boundary(self) -> None:
        """Make the next ``step()`` close the window, however few micro-batches it holds (the end of the
        data, before evaluating or saving). Every rank must force the same step."""
        self._window.force()

    def flush(self) -> bool:
        """Close the open window now, without a new micro-batch, if it holds any; returns whether it did.

        For loops that learn only after the last micro-batch that the data ended. Collective: every rank
        must have the same number of micro-batches in its window.
        """
        self.is_boundary = self.step_was_skipped = False
        if self._window.seen == 0:
            return False
        self._close_window(None, self._window.seen)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, unless a window is open (then the gradients are still accumulating)."""
        if self._window.seen:
            return
        inner = getattr(self.optimizer, "zero_grad", None)
        if callable(inner):
            inner(set_to_none=set_to_none)
            return
        for p in self._params():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def finalize_gradients(self) -> bool:
        """If the next ``step()`` closes a window, make ``.grad`` what the local step will use, now: divided
        by the window's micro-batch count, unscaled by the ``grad_scaler``, and for ``op="sum"``/``"mean"``
        reduced over the ranks (collective). Returns whether it did; off the boundary it does nothing.

        Call it before clipping or inspecting gradients::

            if optimizer.finalize_gradients():
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        """
        if not self._window.closes_next:
            return False
        if not self._prepared:
            self._prepare(self._params(), self._window.seen + 1)
        return True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **kwargs) -> torch.Tensor | None:
        """At a boundary: :meth:`finalize_gradients`, then ``torch.nn.utils.clip_grad_norm_`` over the
        parameters, returning the total norm; off the boundary nothing, returning None.

        With ``op="sum"``/``"mean"`` this clips the reduced gradient (the same norm on every rank), with
        ``op="adasum"`` each rank's own averaged gradient before its local step.
        """
        if not self.finalize_gradients():
            return None
        return torch.nn.utils.clip_grad_norm_(self._params(), max_norm, norm_type, **kwargs)

    # --- the step --------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None):
        """Record one micro-batch; where it closes a window, reduce and update (collective there).

        Returns the wrapped optimizer's return value at a boundary (the closure's loss), else None. A
        closure is evaluated only at boundaries, and only with ``op="adasum"`` or on one rank: with
        ``"sum"``/``"mean"`` it would replace the reduced gradients by local ones.
        """
        if "grad_scale" in self.__dict__ or "found_inf" in self.__dict__:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise RuntimeError("DistributedOptimizer was passed to GradScaler.step(); instead give the scaler "
                               "to the constructor (DistributedOptimizer(..., grad_scaler=scaler)) and call "
                               "optimizer.step() directly: the scaler's own update would differ across ranks")
        if closure is not None and self.op != "adasum" and self.comm.Get_size() > 1:
            raise ValueError(f"a closure re-computes the gradients after op '{self.op}' has reduced them; "
                             "use op='adasum' or step without a closure")
        if closure is not None and self._scaler_enabled():
            raise ValueError("a closure cannot be used together with grad_scaler")
        self.is_boundary = self.step_was_skipped = False
        if not self._window.record():
            return None
        return self._close_window(closure, self._window.seen)

    def _close_window(self, closure, count: int):
        try:
            params = self._params()
            if not self._prepared:
                self._prepare(params, count)
            scale = self._scale()
            if self.op == "adasum" and self.comm.Get_size() > 1:
                ok, loss = self._adasum_step(params, closure)
            else:
                ok = not self.skip_nonfinite or _all_finite(_grads(params))
                loss = self._local_step(closure) if ok else None
            if not ok:
                self._record_skip()
            self._update_scaler(scale, ok)
        finally:
            self._window.close()
            self._prepared = False
        self.boundaries += 1
        self.is_boundary = True
        return loss

    def _local_step(self, closure):
        return self.optimizer.step() if closure is None else self.optimizer.step(closure)

    def _prepare(self, params: list[torch.Tensor], count: int) -> None:
        """Average over the window (and unscale) in one pass; for sum/mean reduce the gradients."""
        grads = _grads(params)
        for i, p in enumerate(params):
            if p.grad is not None and p.grad.is_sparse:
                raise TypeError(f"parameter {i} of the optimizer has a sparse gradient; DistributedOptimizer "
                                "reduces dense gradients only")
        # One division by count·scale: with a power-of-two scale it rounds exactly as a division by count.
        divisor = float(count) * self._scale()
        if divisor != 1.0 and grads:
            torch._foreach_div_(grads, divisor)
        if self.op != "adasum" and self.comm.Get_size() > 1 and params:
            self._reduce_gradients(params)
        self._prepared = True

    def _reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum or mean of the gradients in one fused call. A parameter without a gradient takes part with
        zeros; it gets the reduced gradient if some rank had one, else it stays without (so the wrapped
        optimizer skips it on every rank alike). One extra layer carries which ranks had gradients."""
        ref = params[0]
        have = torch.tensor([p.grad is not None for p in params], dtype=ref.dtype, device=ref.device)
        tensors, missing = [], []
        for i, p in enumerate(params):
            if p.grad is None:
                missing.append(i)
                tensors.append(torch.zeros_like(p, memory_format=torch.contiguous_format))
            else:
                tensors.append(p.grad)
        adasum_allreduce_inplace(tensors + [have], op=self.op, comm=self.comm)
        if missing:
            somewhere = (have > 0).tolist()
            for i in missing:
                if somewhere[i]:
                    params[i].grad = tensors[i]

    def _adasum_step(self, params: list[torch.Tensor], closure):
        """Local step, Adasum of the deltas, start + combined delta; (False, …) and no change if non-finite."""
        local_ok = not self.skip_nonfinite or _all_finite(_grads(params))
        start = self._keep_start(params)
        # A rank with non-finite gradients skips its own step so that its optimizer state stays finite, and
        # marks its delta so that the reduction tells every rank to skip.
        loss = self._local_step(closure) if local_ok else None
        with torch.no_grad():
            deltas = [p.detach() for p in params]
            self._apply_start(deltas, start, "sub")
            if not local_ok:
                for d in deltas:
                    if d.numel():
                        d.fill_(float("nan"))
                        break
            adasum_allreduce_inplace(deltas, op="adasum", comm=self.comm, hierarchical=self.hierarchical)
            ok = not self.skip_nonfinite or _all_finite(deltas)
            self._apply_start(deltas, start, "add" if ok else "copy")
        return ok, loss

    def _keep_start(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copy the parameters into the kept start buffers, (re)allocating them when the parameters changed."""
        host = self.start_copy == "host"
        start = self._start
        if len(start) != len(params) or any(
                s.shape != p.shape or s.dtype != p.dtype or (not host and s.device != p.device)
                for s, p in zip(start, params)):
            start = self._start = [_host_like(p) if host else torch.empty_like(p) for p in params]
        with torch.no_grad():
            if host:
                for s, p in zip(start, params):
                    s.copy_(p.detach(), non_blocking=True)
            elif start:
                torch._foreach_copy_(start, [p.detach() for p in params])
        return start

    def _apply_start(self, deltas: list[torch.Tensor], start: list[torch.Tensor], how: str) -> None:
        """``delta -= start``, ``delta += start`` or ``delta = start``, in place."""
        if not deltas:
            return
        if self.start_copy == "device":
            {"sub": torch._foreach_sub_, "add": torch._foreach_add_, "copy": torch._foreach_copy_}[how](deltas, start)
            return
        for d, s in zip(deltas, start):
            s = s.to(d.device, non_blocking=True)  # one parameter's worth of device memory at a time
            if how == "sub":
                d.sub_(s)
            elif how == "add":
                d.add_(s)
            else:
                d.copy_(s)

    # --- non-finite updates and the loss scale ----------------------------------------------------------------

    def _record_skip(self) -> None:
        self.skipped_updates += 1
        self.step_was_skipped = True
        if self.comm.Get_rank() == 0:
            what = "weight deltas" if self.op == "adasum" and self.comm.Get_size() > 1 else "gradients"
            _log.warning("adasum: update %d skipped on every rank: the %s %s hold a NaN or Inf; parameters "
                         "left unchanged (%d skipped so far)", self.boundaries + 1,
                         "reduced" if self.comm.Get_size() > 1 else "local", what, self.skipped_updates)

    def _scaler_enabled(self) -> bool:
        return self.grad_scaler is not None and self.grad_scaler.is_enabled()

    def _scale(self) -> float:
        return float(self.grad_scaler.get_scale()) if self._scaler_enabled() else 1.0

    def _update_scaler(self, scale: float, ok: bool) -> None:
        """GradScaler's rule (back off on a skip, grow after ``growth_interval`` good boundaries), driven by
        the all-rank decision so that every rank keeps the same scale."""
        if not self._scaler_enabled():
            return
        s = self.grad_scaler
        if not ok:
            new, self._scaler_good_steps = scale * s.get_backoff_factor(), 0
        else:
            self._scaler_good_steps += 1
            new = scale
            if self._scaler_good_steps >= s.get_growth_interval():
                grown = scale * s.get_growth_factor()
                if math.isfinite(grown):
                    new = grown
                self._scaler_good_steps = 0
        s.update(float(new))

    # --- state ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus one key, ``"adasum"``: the window's micro-batch count and
        forced flag, the boundary and skip counters, the loss-scale growth tracker, and, while a window is
        open, the accumulated gradients (one entry per parameter, None where there is none). Per rank: with
        ``op="adasum"`` the wrapped optimizer's state differs between ranks."""
        state = dict(self.optimizer.state_dict())
        own: dict[str, Any] = {**self._window.state_dict(), "boundaries": self.boundaries,
                               "skipped_updates": self.skipped_updates,
                               "scaler_good_steps": self._scaler_good_steps}
        if self._window.seen:
            own["accumulated_grads"] = [None if p.grad is None else p.grad.detach() for p in self._params()]
        state["adasum"] = own
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, or a plain state of the wrapped optimizer (the counters then
        start from zero)."""
        state = dict(state_dict)
        own = state.pop("adasum", None) or {}
        grads = own.get("accumulated_grads")
        params = self._params()
        if grads is not None and len(grads) != len(params):
            raise ValueError(f"the state holds accumulated gradients for {len(grads)} parameters, the optimizer "
                             f"has {len(params)}")
        for i, (p, g) in enumerate(zip(params, grads or [])):
            if g is not None and tuple(g.shape) != tuple(p.shape):
                raise ValueError(f"accumulated gradient {i} has shape {tuple(g.shape)}, parameter {i} has "
                                 f"{tuple(p.shape)}")
        self.optimizer.load_state_dict(state)
        self._window.load_state_dict(own)
        self.boundaries = int(own.get("boundaries", 0))
        self.skipped_updates = int(own.get("skipped_updates", 0))
        self._scaler_good_steps = int(own.get("scaler_good_steps", 0))
        self.is_boundary = self.step_was_skipped = self._prepared = False
        if grads is not None:
            for p, g in zip(params, grads):
                p.grad = None if g is None else g.detach().to(device=p.device, dtype=p.dtype, copy=True)

    # --- helpers ----------------------------------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        """The parameters that train, each once, in the order of the param groups (the same on every rank)."""
        seen: set[int] = set()
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _check_agreement(self) -> None:
        """Every rank must use the same settings and parameter shapes; raise on every rank if not."""
        lcomm = library_comm(self.comm)
        if lcomm.Get_size() == 1:
            return
        mine = {"op": self.op, "accumulation_steps": self._window.steps, "start_copy": self.start_copy,
                "skip_nonfinite": self.skip_nonfinite, "hierarchical": self.hierarchical,
                "grad_scaler": self._scaler_enabled(),
                "parameters": len(self._params())}
        shapes = hashlib.blake2b(repr([(tuple(p.shape), str(p.dtype)) for p in self._params()]).encode(),
                                 digest_size=8).hexdigest()
        everyone = lcomm.allgather((mine, shapes))
        rank = self.comm.Get_rank()
        first, first_shapes = everyone[0]
        for key in first:
            odd = [r for r, (s, _) in enumerate(everyone) if s[key] != first[key]]
            if odd:
                raise ValueError(f"(raised on rank {rank}) ranks disagree on {key} of DistributedOptimizer: "
                                 + ", ".join(f"rank {r} has {everyone[r][0][key]!r}" for r in odd)
                                 + f", rank 0 has {first[key]!r}")
        odd = [r for r, (_, h) in enumerate(everyone) if h != first_shapes]
        if odd:
            raise ValueError(f"(raised on rank {rank}) the parameter shapes or dtypes of rank(s) "
                             f"{', '.join(map(str, odd))} differ from rank 0's")


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite: torch's fused check of GradScaler, one pass and one
    host synchronisation per device. It multiplies by 1.0 on the way, which changes no value."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    for device, ts in by_device.items():
        flags = _flags.get(device)
        if flags is None:
            flags = _flags[device] = (torch.zeros(1, device=device), torch.ones(1, device=device))
        found, one = flags
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, one)
        if found.item():
            return False
    return True


# Per device: the "found a non-finite value" flag and the factor 1.0 that _all_finite hands to torch.
_flags: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _host_like(p: torch.Tensor) -> torch.Tensor:
    """An empty host tensor for ``p``'s values, page-locked where ``p`` is on a GPU."""
    return torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.device.type == "cuda")
