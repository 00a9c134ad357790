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
import weakref
from typing import Any, Callable

import torch
from mpi4py import MPI

from ..allreduce import Op, adasum_allreduce_inplace
from ..context import library_comm
from ..launch import check_launch
from .accumulate import AccumulationWindow
from .compress import reduce_16bit, wire_dtype
from .overlap import BucketPlan, CommThread

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
        overlap: communicate during backward (default off: on hosts where every rank has one core, the
            communication thread competes with backward for it, see the README). On the backward that
            closes a window, a hook on every
            parameter collects the parameters into buckets as backward finishes them; each complete bucket
            is handed to a background thread at once, which for ``op="adasum"`` takes that bucket's local
            step and reduces its deltas, and for ``"sum"``/``"mean"`` reduces its gradients (the local step
            then runs in ``step()``). ``step()`` waits for the buckets and applies them. The results are
            bitwise those of ``overlap=False`` for adasum (within float rounding for sum/mean). The first
            boundary runs without overlap and records the order in which backward produced the gradients
            (rank 0's order, shared by every rank). A boundary that uses a closure, or a loop that calls
            :meth:`finalize_gradients` / :meth:`clip_grad_norm_` with ``op="adasum"`` (clipping by the norm
            of all gradients before the local step), runs without overlap. See the README for the rules.
        bucket_bytes: with ``overlap``, the smallest bucket in bytes of parameters (the last may be smaller).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the deltas (adasum) or gradients (sum/mean) travel
            as 16-bit floats, half the bytes; the dot products, norms and the combine (adasum) or the sums
            (sum/mean) run in float32 or wider on the values that arrived, and the result is rounded to 16
            bits once before it is applied. ``"fp16"`` overflows to Inf beyond 65504 (an update is then
            skipped); ``"bf16"`` keeps float32's range with 8 bits of precision.

    Attributes:
        is_boundary: whether the last ``step()`` closed a window.
        step_was_skipped: whether that boundary's update was skipped for non-finite values.
        skipped_updates: boundaries skipped so far.
        boundaries: windows closed so far.
        overlapped_boundaries: boundaries whose buckets were reduced during backward (``overlap``).
        buckets_started_in_backward: of the last such boundary, how many buckets were handed to the
            thread before ``step()`` was called.
    """

    # GradScaler.step(opt) hands scaling over to optimizers that say this; step() then tells the user to
    # pass the scaler to the constructor instead (the scaler's own update would diverge across ranks).
    _step_supports_amp_scaling = True

    def __init__(self, optimizer, *, op: str | Op = "adasum", accumulation_steps: int = 1,
                 comm: MPI.Intracomm | None = None, start_copy: str = "device", grad_scaler=None,
                 skip_nonfinite: bool = True, hierarchical: bool = False, overlap: bool = False,
                 bucket_bytes: int = 25 << 20, compression: str | None = None):
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
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        self.optimizer = optimizer
        self.comm = comm
        self.compression = None if wire_dtype(compression) is None else compression
        self._wire = wire_dtype(compression)
        self.bucket_bytes = bucket_bytes
        # Overlap needs a second thread in MPI; without MPI_THREAD_MULTIPLE every boundary runs in step().
        self.overlap = bool(overlap) and comm.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
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
        # Overlap state: the thread's own duplicate of comm, the thread, the hooks, the bucket plan (None
        # until a boundary has been observed), this backward's progress, and why overlap is off for good.
        self._ocomm: MPI.Intracomm | None = None  # public as overlap_comm
        self._thread: CommThread | None = None
        self._hooks: list = []
        self._hooked: list[int] = []
        self._plan: BucketPlan | None = None
        self._bw: dict[str, Any] | None = None
        self._in_close = False
        self._no_overlap: str | None = None
        self.overlapped_boundaries = 0       # boundaries whose buckets were reduced during backward
        self.buckets_started_in_backward = 0  # of the last such boundary, buckets handed over before step()
        if self.overlap:
            self._ocomm = comm.Dup()
            library_comm(self._ocomm)  # the library's own duplicate, made here on the main thread
            self._thread = CommThread(f"adasum-overlap-{self._ocomm.Get_rank()}")
            self._finalizer = weakref.finalize(self, _release, self._thread, self._ocomm, self._hooks)
            self._install_hooks()

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
        if self.overlap:
            self._install_hooks()

    @property
    def overlap_comm(self) -> MPI.Intracomm | None:
        """The communicator the overlap thread reduces on (a duplicate of ``comm``; None without overlap):
        ``adasum.count_traffic(opt.overlap_comm)`` counts what the overlapped buckets send."""
        return self._ocomm if self.overlap else None

    def close(self) -> None:
        """Stop the overlap thread, remove the hooks and free the thread's communicator (done on garbage
        collection too). Later boundaries run without overlap. Collective: every rank closes alike."""
        if self.overlap:
            self._finish_overlap(self._params(), raise_errors=False)
            self._finalizer()
            self.overlap = False

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
                f"overlap={self.overlap}, compression={self.compression!r}, size={self.comm.Get_size()}, "
                f"optimizer={self.optimizer!r})")

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
            params = self._params()
            if self.op == "adasum":
                # Processing all gradients before the local step cannot overlap with adasum: from now on
                # every boundary runs in step().
                self._no_overlap = "finalize_gradients"
                if self._bw is not None and not self._bw["observe"]:
                    self._finish_overlap(params, raise_errors=False)
                    with torch.no_grad():
                        self._apply_start([p.detach() for p in params], self._start, "copy")
                    self._bw = None
                    raise RuntimeError(
                        "finalize_gradients()/clip_grad_norm_() was called at a boundary whose local steps "
                        "already ran during backward (overlap with op='adasum'); the parameters are restored "
                        "to the window's start. Call it at every boundary from the first one on (overlap then "
                        "stays off), or construct the optimizer with overlap=False")
            if not self._finish_overlap(params):
                self._prepare(params, self._window.seen + 1)
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
        self._in_close = True
        try:
            params = self._params()
            if closure is not None and self._bw is not None and not self._bw["observe"]:
                self._finish_overlap(params, raise_errors=False)
                with torch.no_grad():
                    self._apply_start([p.detach() for p in params], self._start, "copy")
                raise RuntimeError("step(closure) at a boundary whose buckets were already reduced during "
                                   "backward; use overlap=False with closures")
            scale = self._scale() if self._bw is None else self._bw["scale"]
            overlapped = self._finish_overlap(params)
            if not overlapped and not self._prepared:
                self._prepare(params, count)
            if self.op == "adasum" and self.comm.Get_size() > 1:
                if overlapped:
                    ok, loss = self._apply_combined(params), None
                else:
                    ok, loss = self._adasum_step(params, closure)
            else:
                ok = not self.skip_nonfinite or _all_finite(_grads(params))
                loss = self._local_step(closure) if ok else None
            if not ok:
                self._record_skip()
            self._update_scaler(scale, ok)
            if self.overlap and (self._plan is None or [id(p) for p in params] != self._hooked):
                self._make_plan(params)
        finally:
            self._window.close()
            self._prepared = False
            self._in_close = False
            self._bw = None
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
            for p, g in self._reduce_gradients(params, self.comm):
                p.grad = g
        self._prepared = True

    def _reduce_gradients(self, params: list[torch.Tensor], comm: MPI.Intracomm) -> list:
        """Sum or mean of the gradients in one fused call. A parameter without a gradient takes part with
        zeros; it gets the reduced gradient if some rank had one, else it stays without (so the wrapped
        optimizer skips it on every rank alike). One extra layer carries which ranks had gradients.
        Returns the (parameter, gradient) pairs to set: the caller sets them (on the main thread)."""
        ref = params[0]
        have = torch.tensor([p.grad is not None for p in params], dtype=ref.dtype, device=ref.device)
        tensors, missing = [], []
        for i, p in enumerate(params):
            if p.grad is None:
                missing.append(i)
                tensors.append(torch.zeros_like(p, memory_format=torch.contiguous_format))
            else:
                tensors.append(p.grad)
        if self._wire is None:
            adasum_allreduce_inplace(tensors + [have], op=self.op, comm=comm)
        else:
            reduce_16bit(tensors + [have], self._wire, comm, self.op == "mean")
        out = []
        if missing:
            somewhere = (have > 0).tolist()
            for i in missing:
                if somewhere[i]:
                    out.append((params[i], tensors[i]))
        return out

    def _reduce_deltas(self, deltas: list[torch.Tensor], comm: MPI.Intracomm) -> None:
        """Adasum of the deltas in place, travelling as the ``compression`` dtype where one is set."""
        if self._wire is None:
            adasum_allreduce_inplace(deltas, op="adasum", comm=comm, hierarchical=self.hierarchical)
            return
        wire = [d.to(self._wire) for d in deltas]
        adasum_allreduce_inplace(wire, op="adasum", comm=comm, hierarchical=self.hierarchical)
        for d, w in zip(deltas, wire):
            d.copy_(w)

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
            self._reduce_deltas(deltas, self.comm)
            ok = not self.skip_nonfinite or _all_finite(deltas)
            self._apply_start(deltas, start, "add" if ok else "copy")
        return ok, loss

    def _keep_start(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copy the parameters into the kept start buffers, (re)allocating them when the parameters changed."""
        start = self._ensure_start(params)
        self._copy_start(start, params)
        return start

    def _ensure_start(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        host = self.start_copy == "host"
        start = self._start
        if len(start) != len(params) or any(
                s.shape != p.shape or s.dtype != p.dtype or (not host and s.device != p.device)
                for s, p in zip(start, params)):
            start = self._start = [_host_like(p) if host else torch.empty_like(p) for p in params]
        return start

    def _copy_start(self, start: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        with torch.no_grad():
            if self.start_copy == "host":
                for s, p in zip(start, params):
                    s.copy_(p.detach(), non_blocking=True)
            elif start:
                torch._foreach_copy_(start, [p.detach() for p in params])

    # --- overlap: hooks, buckets and the communication thread -------------------------------------------------

    def _install_hooks(self) -> None:
        """(Re)register one post-accumulate-grad hook per trained parameter; the bucket plan starts over."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        params = self._params()
        self._hooked = [id(p) for p in params]
        me = weakref.ref(self)
        for i, p in enumerate(params):
            self._hooks.append(p.register_post_accumulate_grad_hook(_hook(me, i)))
        self._plan = None
        self._bw = None

    def _on_grad(self, i: int) -> None:
        """Backward has accumulated parameter ``i``'s gradient (main thread, inside backward)."""
        if self._in_close or self._no_overlap or not self._window.closes_next:
            return
        bw = self._bw if self._bw is not None else self._begin_backward()
        fired = bw["fired"]
        fired[i] += 1
        if bw["observe"]:
            if fired[i] == 1:
                bw["order"].append(i)
            return
        plan = self._plan
        if fired[i] == plan.expected[i]:
            bw["waiting"][plan.bucket_of[i]] -= 1
            self._launch_ready(bw)
        elif fired[i] > plan.expected[i]:
            bw["late"].append(i)

    def _begin_backward(self) -> dict[str, Any]:
        params = self._params()
        plan = self._plan if [id(p) for p in params] == self._hooked else None
        bw = {"observe": plan is None, "params": params, "fired": [0] * len(params), "order": [],
              "count": self._window.seen + 1, "scale": self._scale(), "next": 0, "jobs": [], "late": [],
              "set_grads": [], "waiting": list(plan.waiting) if plan else None, "finished": False}
        self._bw = bw
        if plan is not None:
            if self.op == "adasum":
                self._ensure_start(params)
            self._launch_ready(bw)
        return bw

    def _launch_ready(self, bw: dict[str, Any]) -> None:
        """Hand every bucket that is complete, and has no incomplete bucket before it, to the thread."""
        waiting = bw["waiting"]
        while bw["next"] < len(waiting) and waiting[bw["next"]] <= 0:
            self._submit(bw, bw["next"])
            bw["next"] += 1

    def _submit(self, bw: dict[str, Any], b: int) -> None:
        idx = self._plan.buckets[b]
        params = [bw["params"][i] for i in idx]
        if self.op == "adasum":
            start = [self._start[i] for i in idx]
            job = self._thread.submit(lambda: self._adasum_bucket(params, start, bw["count"], bw["scale"]))
        else:
            job = self._thread.submit(lambda: self._grad_bucket(params, bw))
        bw["jobs"].append(job)

    def _adasum_bucket(self, params: list[torch.Tensor], start: list[torch.Tensor], count: int,
                       scale: float) -> None:
        """On the thread: average (and unscale) the bucket's gradients, take its local step, reduce its
        deltas. A failure here still takes part in the reduction (with NaN deltas), then raises."""
        failed = None
        with torch.no_grad():
            deltas = [p.detach() for p in params]
            try:
                grads = _grads(params)
                divisor = float(count) * scale
                if divisor != 1.0 and grads:
                    torch._foreach_div_(grads, divisor)
                local_ok = not self.skip_nonfinite or _all_finite(grads)
                self._copy_start(start, params)
                if local_ok and grads:
                    self._subset_step(params)
                self._apply_start(deltas, start, "sub")
            except BaseException as e:  # noqa: BLE001 - raised below, after the collective
                failed, local_ok = e, False
            if not local_ok:
                for d in deltas:
                    if d.numel():
                        d.view(-1)[0] = float("nan")
                        break
            self._reduce_deltas(deltas, self._ocomm)
        if failed is not None:
            raise failed

    def _grad_bucket(self, params: list[torch.Tensor], bw: dict[str, Any]) -> None:
        """On the thread: average (and unscale) the bucket's gradients and reduce them."""
        with torch.no_grad():
            grads = _grads(params)
            divisor = float(bw["count"]) * bw["scale"]
            if divisor != 1.0 and grads:
                torch._foreach_div_(grads, divisor)
            bw["set_grads"].extend(self._reduce_gradients(params, self._ocomm))

    def _subset_step(self, params: list[torch.Tensor]) -> None:
        """The wrapped optimizer's step restricted to ``params`` (its param groups narrowed meanwhile)."""
        opt = self.optimizer
        groups = opt.param_groups
        keep = {id(p) for p in params}
        saved = [(g, g["params"]) for g in groups]
        narrowed = []
        for g, ps in saved:
            sub = [p for p in ps if id(p) in keep]
            if sub:
                g["params"] = sub
                narrowed.append(g)
        opt.param_groups = narrowed
        try:
            opt.step()
        finally:
            opt.param_groups = groups
            for g, ps in saved:
                g["params"] = ps

    def _finish_overlap(self, params: list[torch.Tensor], raise_errors: bool = True) -> bool:
        """Hand over the remaining buckets, wait for all of them and apply what the main thread must;
        returns whether this boundary's buckets did the work. Errors on any rank raise on every rank."""
        bw = self._bw
        if bw is None or bw["observe"]:
            return False
        if bw["finished"]:
            return True
        plan = self._plan
        self.buckets_started_in_backward = bw["next"]
        while bw["next"] < len(plan.buckets):
            self._submit(bw, bw["next"])
            bw["next"] += 1
        for job in bw["jobs"]:
            job.wait()
        bw["finished"] = True
        self.overlapped_boundaries += 1
        error = next((j.error for j in bw["jobs"] if j.error), None)
        if error is None and bw["late"]:
            error = (f"parameter(s) {bw['late'][:8]} received more gradient accumulations in this backward "
                     "than in the first observed boundary; overlap needs the same graph at every boundary "
                     "(use overlap=False)")
        if self._ocomm.allreduce(error is not None, op=MPI.LOR):
            errors = self._ocomm.allgather(error)
            if self.op == "adasum":
                with torch.no_grad():
                    self._apply_start([p.detach() for p in params], self._start, "copy")
            if raise_errors:
                rank = self.comm.Get_rank()
                raise RuntimeError(f"(raised on rank {rank}) a bucket reduced during backward failed; "
                                   "parameters left at the window's start: "
                                   + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
            return True
        for p, g in bw["set_grads"]:
            p.grad = g
        if self.op != "adasum":
            self._prepared = True
        return True

    def _apply_combined(self, params: list[torch.Tensor]) -> bool:
        """After overlapped adasum buckets: start + combined delta, or start where any delta is non-finite."""
        with torch.no_grad():
            deltas = [p.detach() for p in params]
            ok = not self.skip_nonfinite or _all_finite(deltas)
            self._apply_start(deltas, self._start, "add" if ok else "copy")
        return ok

    def _make_plan(self, params: list[torch.Tensor]) -> None:
        """Collective: once every rank observed a closing backward, bucket the parameters in rank 0's
        completion order (parameters rank 0 saw no gradient for follow in reverse parameter order)."""
        if [id(p) for p in params] != self._hooked:
            self._install_hooks()
        bw = self._bw
        mine = bw["order"] if bw is not None and bw["observe"] else None
        rank = self._ocomm.Get_rank()
        everyone = self._ocomm.allgather(mine if rank == 0 else mine is not None)
        if everyone[0] is None or not all(everyone[1:]) or mine is None:
            return
        order = list(everyone[0])
        seen = set(order)
        order += [i for i in reversed(range(len(params))) if i not in seen]
        nbytes = [p.numel() * p.element_size() for p in params]
        self._plan = BucketPlan(order, nbytes, bw["fired"], self.bucket_bytes)

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
        bw = self.__dict__.get("_bw")
        if bw is not None and not bw["observe"]:
            # Buckets may be on the thread, which narrows the param groups while it steps one of them.
            return list(bw["params"])
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
                "grad_scaler": self._scaler_enabled(), "overlap": self.overlap,
                "bucket_bytes": self.bucket_bytes, "compression": str(self._wire),
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


def _hook(owner: "weakref.ref[DistributedOptimizer]", i: int):
    def hook(_param: torch.Tensor) -> None:
        opt = owner()
        if opt is not None:
            opt._on_grad(i)
    return hook


def _release(thread: CommThread, ocomm: MPI.Intracomm, hooks: list) -> None:
    """Stop the overlap thread, remove the hooks and free the thread's communicators."""
    for h in hooks:
        h.remove()
    hooks.clear()
    thread.close()  # when the collector runs this on the thread itself, the thread ends after this job
    if not MPI.Is_finalized():
        ocomm.Free()  # the library's state on it (and its own duplicate) goes with it


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
        # Made per call (two one-element tensors): the communication thread checks buckets meanwhile.
        found, one = torch.zeros(1, device=device), torch.ones(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, one)
        if found.item():
            return False
    return True



def _host_like(p: torch.Tensor) -> torch.Tensor:
    """An empty host tensor for ``p``'s values, page-locked where ``p`` is on a GPU."""
    return torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.device.type == "cuda")
