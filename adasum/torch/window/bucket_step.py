"""The wrapped optimizer's step on part of its parameters, or on shadows of them, through public torch API.

Overlap and the DDP delta hook step the user's optimizer one bucket at a time, and the boundary steps it
without the step hooks (those run once per update, around all buckets: :func:`step_hooks`). A bucket's step
goes through a *bucket optimizer*: a copy of the user's optimizer made by the copy protocol
(``copy.copy``, which torch's ``Optimizer.__getstate__``/``__setstate__`` serve: the copy shares
``defaults`` and ``state`` and has step hooks of its own, none), whose ``param_groups`` hold the bucket's
tensors with the user's hyperparameters. Its ``state`` is the user's optimizer state (shared, not copied:
a bucket's step updates the user's moments in place). Before each step the copy takes the user's
hyperparameters (an LR scheduler's changes reach it) and the user's other instance attributes (a flag the
user set between steps); group entries its step writes are written back to the user's optimizer. An
optimizer whose step changes its own instance attributes (a step counter, momentum kept in a dict of its
own) would count one step per bucket or key state by the shadows: its first bucket step raises
``TypeError`` (on every rank, at that boundary), saying to keep such state in ``self.state`` or to use
``overlap=False``. The global step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``) run at
each bucket's step.
"""

from __future__ import annotations

import copy
from collections.abc import MutableMapping

import torch

from ..internals import record_scheduled_step, step_hooks_of, unhooked_step

__all__ = ["BucketSteps", "ShadowState", "step_hooks", "whole_step"]

# An LR scheduler's wrapper of the user's ``step`` (an instance attribute): the copy steps with its class's.
_WRAPPER = "step"

_KEPT = 64  # bucket optimizers kept per optimizer (buckets of a plan, the whole model)


class BucketSteps:
    """The bucket optimizers of one wrapped optimizer (the module docstring), kept by the tensors they step."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._kept: dict[tuple, tuple[torch.optim.Optimizer, list, frozenset]] = {}

    def step(self, params: list[torch.Tensor], shadows: list[torch.Tensor] | None = None) -> None:
        """The optimizer's step on ``params`` only, without its step hooks. With ``shadows`` (one per
        parameter, same dtype, device and shape) the step runs on the shadows instead, each with its
        parameter's gradient and optimizer state (:class:`ShadowState`), and the parameters keep their
        values."""
        stepped = params if shadows is None else shadows
        where = {id(p): i for i, p in enumerate(params)}
        groups = self.optimizer.param_groups
        members = [[where[id(p)] for p in g["params"] if id(p) in where] for g in groups]
        key = (tuple(map(id, stepped)), tuple(map(tuple, members)), len(groups))
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = self._make(groups, members, stepped)
        bucket, pairs, own = kept
        user, mine = vars(self.optimizer), vars(bucket)
        shared = {k: v for k, v in user.items() if k not in own and k != _WRAPPER}
        sizes = {k: len(v) for k, v in shared.items() if isinstance(v, (dict, list, set))}
        mine.update(shared)  # the user's state, flags and settings as they are now
        for g, b in pairs:   # the user's hyperparameters, as they are now
            for k, v in g.items():
                if k != "params" and b.get(k) is not v:
                    b[k] = v
        if shadows is not None:
            bucket.state = ShadowState(self.optimizer.state, params, shadows)
            for s, p in zip(shadows, params):
                s.grad = p.grad
        try:
            bucket.step()
        finally:
            if shadows is not None:
                bucket.state = self.optimizer.state
                for s in shadows:
                    s.grad = None
        changed = _changed(shared, sizes, {k: v for k, v in mine.items() if k not in own and k != "state"})
        if changed:
            raise TypeError(f"{type(self.optimizer).__name__}'s step changes its instance attributes {changed}, "
                            "outside `self.state` and the param groups: adasum steps the optimizer one bucket at "
                            "a time (overlap=True, adasum_delta_hook), where that would count one step per "
                            "bucket or key state by the wrong tensors. Keep per-step state in `self.state` (per "
                            "parameter), or construct the optimizer with overlap=False")
        for g, b in pairs:
            for k, v in b.items():
                if k != "params" and g.get(k) is not v:
                    g[k] = v

    def _make(self, groups: list[dict], members: list[list[int]], stepped: list[torch.Tensor]) -> tuple:
        """A new bucket optimizer for ``stepped`` (``members``: per user group, the positions of its tensors)."""
        optimizer = self.optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer: adasum steps it one "
                            "bucket at a time (overlap, adasum_delta_hook) through a copy of it; use "
                            "overlap=False, or a torch.optim.Optimizer")
        bucket = copy.copy(optimizer)  # shares defaults and state; step hooks of its own: none
        # What the copy keeps its own (its groups, its hooks); the rest is the user's, taken at each step
        # (``state`` and ``defaults`` too: load_state_dict() rebinds them).
        own = frozenset(vars(bucket)) - {"state", "defaults"}
        sub = [(g, dict(g, params=[stepped[i] for i in idx])) for g, idx in zip(groups, members) if idx]
        bucket.param_groups = [b for _, b in sub]
        if len(self._kept) >= _KEPT:
            self._kept.clear()
        return bucket, sub, own


_MISSING = object()
# Attributes torch's own optimizers set in a step for their bookkeeping (warnings once, a scheduler's record).
_BOOKKEEPING = frozenset({"_warned_capturable_if_run_uncaptured", "_opt_called", "_step_count"})
_PLAIN = (bool, int, float, str, type(None))


def _changed(before: dict, sizes: dict, after: dict) -> list[str]:
    """The user's instance attributes that a bucket's step rebound, added or resized."""
    out = []
    for k, v in after.items():
        if k in _BOOKKEEPING:
            continue
        old = before.get(k, _MISSING)
        same = old is v or (type(v) in _PLAIN and type(old) is type(v) and old == v)
        if not same or (k in sizes and len(v) != sizes[k]):
            out.append(k)
    return sorted(out)


class ShadowState(MutableMapping):
    """The wrapped optimizer's ``state`` as a step on shadows sees it: a shadow's entry is its parameter's
    own (made in the optimizer's ``state`` where new), so the step updates the user's optimizer state as a
    step on the parameters would."""

    def __init__(self, state, params: list[torch.Tensor], shadows: list[torch.Tensor]):
        self._state = state
        self._param = {id(s): p for s, p in zip(shadows, params)}

    def _key(self, key):
        return self._param.get(id(key), key)

    def __getitem__(self, key):
        return self._state[self._key(key)]

    def __setitem__(self, key, value) -> None:
        self._state[self._key(key)] = value

    def __delitem__(self, key) -> None:
        del self._state[self._key(key)]

    def __contains__(self, key) -> bool:
        return self._key(key) in self._state

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def get(self, key, default=None):
        return self._state.get(self._key(key), default)

    def setdefault(self, key, default=None):
        return self._state.setdefault(self._key(key), default)


def step_hooks(optimizer, which: str) -> None:
    """The step hooks of ``optimizer``, once (``"pre"`` or ``"post"``, in ``optimizer.step()``'s order), each
    with ``(optimizer, (optimizer,), {})`` as ``optimizer.step()`` calls them (what a pre-hook returns is not
    used: no arguments reach the step). ``"pre"`` also records the step where an LR scheduler replaced
    ``optimizer.step`` to watch for it, so the scheduler knows the optimizer stepped."""
    if which == "pre":
        record_scheduled_step(optimizer)
    for hook in step_hooks_of(optimizer, which):
        hook(optimizer, (optimizer,), {})


def whole_step(optimizer) -> None:
    """The optimizer's own step on all its parameters, without its step hooks: its class's step function
    called on the user's optimizer itself (the function torch's hook runner wraps). An optimizer whose class
    has no step takes ``optimizer.step()``."""
    fn = unhooked_step(type(optimizer))
    if fn is None:
        optimizer.step()
    else:
        fn(optimizer)
