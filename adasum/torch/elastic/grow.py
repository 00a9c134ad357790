"""Growing back inside :func:`~adasum.torch.elastic.run`: the survivors' side (:func:`regrow`, after a
:class:`~adasum.torch.elastic.HostsUpdatedInterrupt`) and the newcomer's (:func:`join`, at its first
call of ``run``). Both end with the new world current (:func:`adasum.runtime.membership.adopt`), the
optimizer rebuilt on it and the reset callbacks run; ``run`` then syncs the state from rank 0 (the
newcomers receive it there) and calls the training function."""

from __future__ import annotations

import logging
import time

from ...runtime import exchange, growth, newcomer
from ...runtime.membership import adopt, world
from ...settings import current
from .snapshot import State

__all__ = ["regrow", "join", "check_settings"]

_log = logging.getLogger("adasum")
_STALE = ("the world changed (it grew back with processes started in place of the dead); this communicator "
          "is the old world's")


def regrow(state: State) -> bool:
    """Collective over the survivors, at a commit: start as many processes as the world is short of its
    launch size and merge with them. True where the world grew; False where the attempt failed (warned
    once on the world's rank 0, with the reason; the world and the state unchanged, another attempt at a
    later commit while ``elastic_replace_attempts`` allows). A death meanwhile raises ``WorldChanged``."""
    s = current()
    before, started = world().Get_size(), time.monotonic()
    try:
        merged = growth.grow(state.launch_size - before, s.elastic_replace_timeout)
    except growth.GrowFailed as exc:
        state.failed_grows += 1
        left = s.elastic_replace_attempts - state.failed_grows
        if world().Get_rank() == 0:
            _log.warning("adasum: growing back from %d to %d ranks failed (attempt %d of %d): %s; going on at "
                         "%d ranks%s", before, state.launch_size, state.failed_grows, s.elastic_replace_attempts,
                         exc, before, ", trying again at the next commit" if left > 0 else
                         "; no more attempts until another rank dies (elastic_replace_attempts)")
        return False
    adopt(merged, _STALE)
    state.grows += 1
    state.grown_at = state.commits  # its attempts start afresh once a commit passed (State.commit)
    state._grown(before, started, newcomer=False)
    return True


def join(state: State) -> None:
    """A newcomer, at its first call of ``run``: join the survivors waiting there (or end, where they gave
    up: :func:`adasum.runtime.growth.join`), make the joined world current, rebuild the optimizer on it and
    run the reset callbacks, as the survivors do."""
    merged = growth.join()
    adopt(merged, _STALE)
    newcomer.joined()
    state._grown(merged.Get_size() - newcomer.parent().Get_size(), time.monotonic(), newcomer=True)


def check_settings() -> None:
    """Collective over the world: every rank must have the same replacement settings (``elastic_replace``
    and its attempts and timeout): a difference would have some ranks start processes while the others
    train on. ValueError on every rank where they differ."""
    s = current()
    mine = (s.elastic_replace, s.elastic_replace_attempts, float(s.elastic_replace_timeout))
    everyone = exchange.allgather(world(), mine, what="the elastic replacement settings")
    odd = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if odd:
        raise ValueError(f"(raised on rank {world().Get_rank()}) ranks disagree on elastic_replace, "
                         f"elastic_replace_attempts or elastic_replace_timeout: rank 0 has {everyone[0]}, "
                         + ", ".join(f"rank {r} has {everyone[r]}" for r in odd))
