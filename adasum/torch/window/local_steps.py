"""Local steps between combines, the outer optimizer and ``delay=1``: ``DistributedOptimizer(local_steps=H,
outer_lr=, outer_momentum=, delay=)``.

Each rank's wrapped optimizer takes H local steps (one per accumulation window, each a plain
``optimizer.step()`` on the rank's own averaged gradients, with its hooks), with no MPI call in between.
After the H-th, the ranks combine each parameter's delta since the window's start (``op="adasum"``: Adasum,
one layer per parameter; ``"mean"``/``"sum"``: the mean/sum of the deltas, model averaging), and every
rank continues from the same point: the window's start moved by the outer optimizer, DiLoCo's outer SGD
with Nesterov momentum on the pseudo-gradient ``g = -combined delta``::

    v <- mu * v + g
    params <- start - outer_lr * (g + mu * v)

With the defaults (``outer_lr=1``, ``outer_momentum=0``) that is start + combined delta.

Parameters are tracked by identity. A window's parameters are those it trained at any of its local steps:
one frozen inside the window keeps its place (its delta since the window's start is combined, so it ends
alike on every rank), one unfrozen or added inside it joins at its first local step, with its value then as
its start. The ranks check at every combine that their windows hold the same parameters
(:func:`adasum.torch.window.agreement.agree`).

``delay=1``: window k's combine runs on a lane (:class:`adasum.runtime.lane.Lane`) while window k+1's local
steps run, and is merged at the end of window k+1. Each rank keeps the last common point G (the ranks'
shared parameters after the last merged combine). At the end of window k the rank's own delta d_k goes to
the lane, and the rank continues from G + d_k: its own delta stands in for the combined one until that
arrives. At the end of window k+1 the outer optimizer moves G by window k's combined delta, and the rank
continues from the new G + d_{k+1}: the stand-in is replaced by the combined delta exactly once. The rule
needs no extra hyperparameter, the outer optimizer sees the same sequence of combined deltas as without
delay, one window late, and a rank's parameters never hold another rank's unmerged progress. A forced
boundary (``force_boundary()``, ``flush()``) drains: its combine is merged at once, every rank then holds G.
A parameter that leaves the windows (frozen) lands on G once its last combine is merged.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from mpi4py import MPI

from ...runtime import exchange
from ...runtime.lane import Lane
from .close import WindowClose
from .compress import Wire
from .outer import OuterSGD
from .strategies import _describe
from .tensors import all_params, trained_params
from .tensors import Snapshot, all_finite, average_, grads_of
from ..internals import foreach_copy_

__all__ = ["LocalSteps"]


class LocalSteps:
    """The window of local steps and its combine, for one optimizer (the module docstring). No reference to
    the optimizer proxy."""

    def __init__(self, optimizer, comm: MPI.Intracomm, op: str, steps: int, outer: OuterSGD, where: str,
                 wire: Wire, hierarchical: bool, skip_nonfinite: bool, closing: WindowClose, delay: int = 0):
        self.optimizer, self.comm, self.op, self.steps, self.outer = optimizer, comm, op, steps, outer
        self.wire, self.hierarchical, self.skip_nonfinite = wire, hierarchical, skip_nonfinite
        self.delay, self.closing, self.loss = delay, closing, closing.loss
        self.settings = {"local_steps": steps, "delay": delay, "outer_lr": outer.lr, "outer_momentum": outer.momentum,
                         "outer_optimizer": type(getattr(outer, "optimizer", None)).__name__
                         if hasattr(outer, "optimizer") else None}
        self.start = Snapshot(where)   # each member's value at the window's start (or when it joined)
        self.members: list[torch.Tensor] = []  # the window's parameters, in the order they joined
        self.taken = 0             # local steps in the open window (skipped ones included)
        self.overflowed = False    # a local step of this window had non-finite gradients on this rank
        self.error: str | None = None  # a local step of this window raised on this rank
        self.averaged = False      # the closing accumulation window's gradients are averaged already
        self._own: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # a loaded state's own values
        # delay=1: G, the deltas on the lane (then combined), whether they arrived, the lane and its job
        self.glob = Snapshot(where)
        self.sent: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.arrived = False
        self.job = None
        self.lane = Lane(comm, "adasum-delayed") if delay else None
        if self.lane is not None:
            weakref.finalize(self, self.lane.drop, "the optimizer that owned this communicator was dropped")

    @property
    def pending(self) -> bool:
        """Whether a combine is on the lane, not merged yet (delay=1)."""
        return self.sent is not None

    def finalize(self, count: int) -> None:
        """Average (and unscale) the gradients of the accumulation window that the next local step uses."""
        if not self.averaged:
            average_(grads_of(trained_params(self.optimizer)), count, self.loss.current())
            self.averaged = True

    def local_step(self, count: int, forced: bool) -> bool:
        """One local step from the gradients of ``count`` micro-batches; no MPI call. Returns whether the
        window of local steps closes now (the H-th, or a forced boundary): the caller then combines."""
        params = trained_params(self.optimizer)
        self._own = None
        known = {id(p) for p in self.members}
        joining = [p for p in params if id(p) not in known]
        if joining:  # the window's first step, or a parameter unfrozen or added since: its start is now
            self.start.keep(joining)
            self.members.extend(joining)
        self.taken += 1
        try:
            self.finalize(count)
            finite = not self.skip_nonfinite or all_finite(grads_of(params))
            self.overflowed |= not finite
            # A rank whose gradients are not finite skips this local step (its optimizer state stays finite);
            # after a failed step the window only counts: its combine raises on every rank.
            if finite and self.error is None:
                _step_trained(self.optimizer)
        except BaseException as e:  # noqa: BLE001 - raised on every rank at the combine
            self.error = self.error or _describe(e)
        finally:
            self.averaged = False
        return forced or self.taken >= self.steps

    def close(self) -> None:
        """Wait for a combine on the lane and end the lane (the parameters keep their values)."""
        if self.lane is not None:
            self.lane.wait(self.job)
            self.job = None
            self.lane.close()

    def combine(self, ledger: dict[str, int], drain: bool = False) -> bool:
        """Collective at the end of a window, through the window's procedure (:class:`WindowClose`): the
        ranks agree, then every member becomes the outer optimizer's step from its start along the combined
        delta (delay=1: the previous window's combine is merged and this window's sent; ``drain``: merged at
        once too). Where a combined delta is not finite the parameters keep the last common point (False,
        on every rank alike). A local step that raised on any rank, or windows that differ, raise here on
        every rank, the parameters back at that point."""
        members, taken, error, overflowed = self.members, self.taken, self.error, self.overflowed
        self.members, self.taken, self.error, self.overflowed = [], 0, None, False
        error = error or self._wait()
        close, scale = self.closing, self.loss.current()
        undo = lambda: self._fall_back(members)  # noqa: E731
        if self.delay:
            decision = close.decide(ledger, members, error, overflowed, undo=undo)
            ok = self._merge()
            if taken:
                self._send(members)
            if drain:
                ok = self._drain() and ok
            # The loss scale follows this window's own local steps; the merged combine is the last one's.
            return close.count(ok, scale, scale_ok=not decision.overflowed)
        if not taken:
            decision = close.decide(ledger, members, error, overflowed, undo=undo)
            return close.count(True, scale, scale_ok=not decision.overflowed)
        return close.close(_WindowDeltas(self, members), ledger, error=error, overflowed=overflowed)

    def _reduce(self, deltas: list[torch.Tensor], comm: MPI.Intracomm, members: list[torch.Tensor],
                companion=None):
        """The combine of ``deltas`` over ``comm``, in place (``companion``: the window's agreement, riding
        on the call's); the 16-bit wire's largest magnitudes."""
        if comm.Get_size() == 1 or not deltas:
            return None
        names = _names(members) if self.wire.dtype else None
        if self.op == "adasum":
            return self.wire.adasum_(deltas, comm, self.hierarchical, names, companion=companion)
        return self.wire.sum_(deltas, comm, self.op == "mean", names, companion=companion)

    def _fall_back(self, members: list[torch.Tensor]) -> None:
        """Every parameter of the window (and, delay=1, every one with a common point) back at the last point
        the ranks share; nothing stays in flight."""
        with torch.no_grad():
            at_start = [p for p in members if p not in self.glob]
            self.start.apply([p.detach() for p in at_start], at_start, "copy")
            common = self.glob.params()
            self.glob.apply([p.detach() for p in common], common, "copy")
        self.sent, self.arrived = None, False

    # --- delay=1 ------------------------------------------------------------------------------------------

    def _send(self, members: list[torch.Tensor]) -> None:
        """This window's own deltas go to the lane; each member continues from G + its own delta (a member
        new to G has G = its start); a parameter with a G that left the windows lands on G. A delta that is
        not finite is no stand-in: this rank continues from G itself (the combine it joins is skipped on
        every rank when it arrives)."""
        targets = [p.detach() for p in members]
        with torch.no_grad():
            deltas = [t.clone(memory_format=torch.contiguous_format) for t in targets]
            self.start.apply(deltas, members, "sub")  # this window's own delta d
            usable = not self.skip_nonfinite or all_finite(deltas)
            known = [i for i, p in enumerate(members) if p in self.glob]
            fresh = [members[i] for i in range(len(members)) if members[i] not in self.glob]
            self.glob.keep(fresh, self.start.values(fresh))  # G is their start; they hold start + d already
            if not usable:
                self.start.apply([p.detach() for p in fresh], fresh, "copy")
            if known:
                moved = [targets[i] for i in known]
                if usable:
                    foreach_copy_(moved, [deltas[i] for i in known])
                    self.glob.apply(moved, [members[i] for i in known], "add")  # G + d
                else:
                    self.glob.apply(moved, [members[i] for i in known], "copy")  # G
            inside = {id(p) for p in members}
            left = [p for p in self.glob.params() if id(p) not in inside]
            self.glob.apply([p.detach() for p in left], left, "copy")
            self.glob.forget(left)
        self.sent, self.arrived = (members, deltas), False
        self.job = self.lane.submit(lambda: self._reduce(deltas, self.lane.comm, members), "a delayed combine")

    def _wait(self) -> str | None:
        """Wait for the combine on the lane; its error, if it failed."""
        job, self.job = self.job, None
        if job is None:
            return None
        error = self.lane.wait(job)
        self.arrived = error is None
        return error

    def _merge(self) -> bool:
        """G moves by the arrived combined deltas (the outer optimizer's step), or stays where they are not
        finite (False)."""
        if self.sent is None or not self.arrived:
            return True
        (params, combined), self.sent, self.arrived = self.sent, None, False
        ok = not self.skip_nonfinite or self.closing.finite(combined)
        if ok:
            self.outer.apply_(combined, params, self.glob)  # combined now holds the new G
            self.glob.keep(params, combined)
        return ok

    def _drain(self) -> bool:
        """Wait for the combine just sent (its error raises on every rank), merge it, and every parameter
        with a common point takes it: every rank then holds G exactly."""
        error = exchange.failures(self.comm, self._wait(), what="the drained combine's error vote")
        if error:
            self._fall_back([])
            raise RuntimeError(f"(raised on rank {self.comm.Get_rank()}) a combine failed: {error}")
        ok = self._merge()
        common = self.glob.params()
        self.glob.apply([p.detach() for p in common], common, "copy")
        return ok

    # --- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The open window (its members, local steps, this rank's values and the window's start), the
        common point and the combine in flight (delay=1), the outer optimizer's momentum, and the settings a
        state with an open window loads into."""
        self.error = self.error or self._wait()
        everything = all_params(self.optimizer)
        pos = {id(p): i for i, p in enumerate(everything)}
        own: dict[str, Any] = {"local_steps_taken": self.taken, "local_overflowed": self.overflowed,
                               "outer_momentum_buffer": self.outer.state_dict(everything),
                               "local_settings": dict(self.settings)}
        if self.error is not None:
            own["local_error"] = self.error
        if self.taken:
            own["window_members"] = [pos[id(p)] for p in self.members]
            own["window_start"] = [v.detach().to("cpu", copy=True) for v in self.start.values(self.members)]
        common = self.glob.params()
        if common:
            own["global_members"] = [pos[id(p)] for p in common]
            own["global_parameters"] = [v.detach().to("cpu", copy=True) for v in self.glob.values(common)]
        if self.sent is not None:
            own["sent_members"] = [pos[id(p)] for p in self.sent[0]]
            own["combined_deltas"] = [d.detach().clone() for d in self.sent[1]]
        mine = list({id(p): p for p in [*self.members, *common]}.values())
        if mine:
            own["own_members"] = [pos[id(p)] for p in mine]
            own["own_parameters"] = [p.detach().clone() for p in mine]
        return own

    def load_state_dict(self, own: dict[str, Any]) -> None:
        self._wait()
        everything, trained = all_params(self.optimizer), trained_params(self.optimizer)
        taken = int(own.get("local_steps_taken", 0))

        def members(key: str, default: list[torch.Tensor]) -> list[torch.Tensor]:
            return [_member(everything, i, key) for i in own[key]] if key in own else default

        window = (members("window_members", trained), own.get("window_start")) if taken else ([], None)
        common = (members("global_members", trained), own.get("global_parameters"))
        sent = (members("sent_members", trained), own.get("combined_deltas"))
        mine = (members("own_members", trained), own.get("own_parameters", own.get("window_parameters")))
        if taken < 0 or (taken and window[1] is None):
            raise ValueError(f"the state's open window of local steps ({taken} taken) lacks its start")
        for name, (params, values) in (("window_start", window), ("global_parameters", common),
                                       ("combined_deltas", sent), ("own_parameters", mine)):
            if values is not None and (len(values) != len(params) or any(
                    tuple(v.shape) != tuple(p.shape) for v, p in zip(values, params))):
                raise ValueError(f"the state's {name} ({len(values)} tensors) does not fit the optimizer's "
                                 f"parameters ({len(params)} of them, or other shapes)")
        self.outer.load_state_dict(own.get("outer_momentum_buffer"), everything, trained)
        self.taken, self.overflowed, self.error = taken, bool(own.get("local_overflowed", False)), own.get("local_error")
        self.averaged = False
        self.members = list(window[0])
        self.start = Snapshot(self.start.where)
        self.start.keep(window[0], [v.to(p.device, p.dtype) for v, p in zip(window[1] or [], window[0])])
        self.glob = Snapshot(self.glob.where)
        if common[1] is not None:
            self.glob.keep(common[0], [v.to(p.device, p.dtype) for v, p in zip(common[1], common[0])])
        self.sent = None if sent[1] is None else (
            sent[0], [d.to(p.device, p.dtype).contiguous() for d, p in zip(sent[1], sent[0])])
        self.arrived = self.sent is not None
        self._own = None if mine[1] is None else list(zip(mine[0], mine[1]))
        self.restore_parameters()

    def restore_parameters(self) -> None:
        """Set the parameters to this rank's own values in the loaded open window (a checkpoint's model holds
        the root rank's)."""
        if self._own is None:
            return
        with torch.no_grad():
            for p, v in self._own:
                p.copy_(v)


class _WindowDeltas:
    """A window's deltas as the window's procedure takes them (:class:`~adasum.torch.window.close.Update`):
    formed in the parameters (new - start), combined, then the outer optimizer's step from the start."""

    voted = False
    skips_overflowed = False  # an overflowed local step was skipped; the window's other steps still count

    def __init__(self, local: LocalSteps, members: list[torch.Tensor]):
        self.local, self.params = local, members
        self.targets = [p.detach() for p in members]
        self.amax = None

    def carries_companion(self, comm: MPI.Intracomm) -> bool:
        """Whether the window's agreement can ride on the combine's own: not where a loss scale needs the
        ranks' overflow votes, nor in hierarchical mode or through the fp16 wire (their first collectives
        are others)."""
        local = self.local
        return bool(self.params) and comm.Get_size() > 1 and not local.loss.enabled \
            and local.wire.carries_companion and not (local.hierarchical and local.op == "adasum")

    def combine(self, comm: MPI.Intracomm, companion) -> None:
        with torch.no_grad():
            self.local.start.apply(self.targets, self.params, "sub")  # the parameters hold this rank's deltas
            self.amax = self.local._reduce(self.targets, comm, self.params, companion)

    def settle(self) -> None:
        """Nothing: the combined deltas are in the parameters."""

    def combined(self) -> list[torch.Tensor]:
        return self.targets

    def apply(self, ok: bool) -> None:
        with torch.no_grad():
            if ok:
                self.local.outer.apply_(self.targets, self.params, self.local.start)
            else:
                self.local.start.apply(self.targets, self.params, "copy")

    def explain(self) -> None:
        self.local.wire.explain(self.targets, self.amax, _names(self.params))

    def abandon(self) -> None:
        self.local._fall_back(self.params)


def _step_trained(optimizer) -> None:
    """``optimizer.step()`` (with its hooks and any instance-level wrapper) on the trained parameters only:
    a frozen parameter that still holds a gradient (zeros, after ``zero_grad(set_to_none=False)``) is not
    stepped, as without local steps; its gradient is back afterwards."""
    frozen = [p for p in all_params(optimizer) if not p.requires_grad and p.grad is not None]
    held = [p.grad for p in frozen]
    for p in frozen:
        p.grad = None
    try:
        optimizer.step()
    finally:
        for p, g in zip(frozen, held):
            p.grad = g


def _names(params: list[torch.Tensor]) -> list[str]:
    return [f"parameter {i} (shape {tuple(p.shape)})" for i, p in enumerate(params)]


def _member(everything: list[torch.Tensor], i: int, key: str) -> torch.Tensor:
    if not 0 <= int(i) < len(everything):
        raise ValueError(f"the state's {key} names parameter {i}; the optimizer has {len(everything)}")
    return everything[int(i)]
