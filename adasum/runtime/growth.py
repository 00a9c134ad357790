"""Growing the world back: the survivors start processes in place of the dead and merge with them.

Survivors, all together (:func:`grow`, collective over the current world):

1. ``MPI_Comm_spawn`` of the job's command line (:func:`command`: this Python, its options such as
   ``-m mpi4py``, the script and its arguments), in the working directory this process started in and with
   the environment the launcher gives every rank, the newcomers marked with ``ADASUM_ELASTIC_NEWCOMER``. Open MPI's spawn waits until the newcomers reach ``MPI_Init``, for as long as
   ten minutes where one died before: it runs in a thread of its own, on a duplicate of the world, and the
   survivors stop waiting at the deadline (the duplicate revoked).
2. Each newcomer tells every survivor that it is alive (its process id and host, at import:
   :func:`adasum.runtime.newcomer.announce`) and, from ``elastic.run``, that it is ready (:func:`join`). Every survivor waits for the ready
   of each, until the deadline, a death it can see (a newcomer on its own host that is gone, an MPI error),
   or word from another survivor that gave up.
3. Each survivor tells each newcomer whether to join (the verdict), and both sides ``MPI_Intercomm_merge``
   (the survivors first, in their order; the merge too under the deadline, in a thread).

After each step the survivors agree (an allgather over their world, which a death turns into
:class:`~adasum.runtime.faults.WorldChanged`): where any of them failed, all raise :class:`GrowFailed`
with the first reason, having told the newcomers to leave (a newcomer that is told so, or never hears,
ends itself: :mod:`adasum.runtime.newcomer`). Every newcomer and every survivor exchange messages before
the merge: Open MPI 5 crashes in ``MPI_Finalize`` on a process of another job it never talked to.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from .. import settings
from . import exchange, newcomer
from .faults import revoke, world
from .newcomer import HOST_BYTES, TAG_ALIVE

__all__ = ["GrowFailed", "command", "grow", "join"]

TAG_READY, TAG_VERDICT, TAG_ABORT = 7302, 7303, 7304
_POLL = 0.005
_RELAYED = "another survivor gave up"
_kept: list = []  # requests (and their buffers) left behind, never waited for: a dead peer never answers


class GrowFailed(RuntimeError):
    """An attempt to grow the world back failed on some survivor; the text is the first reason."""


def command() -> tuple[str, list[str]]:
    """This process's command line: the Python (``sys.executable``) and its arguments as given, options
    such as ``-m mpi4py`` or ``-u`` included (``sys.orig_argv``)."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    return sys.executable, argv[1:]


def _info(timeout: float) -> MPI.Info:
    """Where and with what the newcomers start: in the working directory of this process at import, with
    the environment the launcher gives every rank (Open MPI's spawn hands a newcomer mpiexec's, as to the
    ranks it started, and this process's ``OMPI_MCA_*``) and the newcomer's mark, its time to join (an info
    value holds 255 characters: no whole environment fits). No bound on Open MPI's connect inside the
    newcomer's MPI_Init (``mpi_pmix_connect_timeout``): with one, prterun's own finalize never ended after a
    spawn of two processes."""
    info = MPI.Info.Create()
    info.Set("PMIX_ENVAR", f"{newcomer.ENV}={timeout:g}")
    where = settings.start_directory()
    if where:
        info.Set("wdir", where)
    return info


def grow(missing: int, timeout: float) -> MPI.Intracomm:
    """Collective over the current world: start ``missing`` processes and merge with them (the module
    docstring), within ``timeout`` seconds. Returns the merged world (this process's rank unchanged, the
    newcomers after the survivors); raises :class:`GrowFailed` on every survivor where the attempt failed
    (the world unchanged), or ``WorldChanged`` where a survivor died meanwhile."""
    old = world()
    deadline = time.monotonic() + timeout
    inter = None
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:  # the same on every rank
        raise GrowFailed("MPI runs without MPI_THREAD_MULTIPLE, which growing back needs (the survivors wait "
                         "for MPI_Comm_spawn in a thread, with a deadline)")
    try:
        inter, why = _spawn(old, missing, deadline, timeout)
        _agree(old, why, "starting the newcomers")
        _agree(old, _await(old, inter, deadline, timeout), "waiting for the newcomers")
        _verdict(inter, True)
        patience = time.monotonic() + max(10.0, min(60.0, timeout))  # all are there: it takes moments
        merged, why = _bounded(lambda: inter.Merge(high=False), patience, "adasum-merge")
        _agree(old, why and f"merging with the newcomers: {why}", "merging with the newcomers")
        return merged
    except BaseException:
        if inter is not None:
            _verdict(inter, False)
        raise


def _spawn(old: MPI.Intracomm, missing: int, deadline: float, timeout: float):
    """``MPI_Comm_spawn`` in a thread, on a duplicate of ``old``: (the intercommunicator, None), or (None,
    why) where it failed or did not end by ``deadline``."""
    comm = old.Dup()
    exe, args = command()
    info = _info(timeout)
    inter, why = _bounded(lambda: comm.Spawn(exe, args, maxprocs=missing, info=info, root=0), deadline,
                          "adasum-spawn")
    if why == "timeout":
        revoke(comm)  # the others' spawn returns; the root's stays in Open MPI until it gives up
        return None, (f"the {missing} process{'es' * (missing != 1)} started did not reach MPI_Init within "
                      f"{timeout:g} s (elastic_replace_timeout)")
    comm.Free()
    if why is not None:
        return None, (f"MPI_Comm_spawn failed ({why}); where Open MPI says that all nodes are already filled, "
                      "it found no free slot: launch with --oversubscribe, or on hosts with more slots than ranks")
    return inter, None


def _bounded(fn, deadline: float, name: str):
    """``fn()`` in a thread of its own: (its value, None), (None, its error's text) or (None, ``"timeout"``)
    where it had not returned by ``deadline`` (``time.monotonic()``; the thread is left behind)."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except MPI.Exception as exc:
            box["error"] = exc.Get_error_string()
        except BaseException as exc:  # noqa: BLE001 - told to every survivor, as any other reason
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        return None, "timeout"
    return box.get("value"), box.get("error")


def _agree(old: MPI.Intracomm, why: str | None, what: str) -> None:
    """Every survivor's ``why`` (None: it went well); :class:`GrowFailed` on every one where any failed."""
    reasons = exchange.allgather(old, why, what=f"growing back: {what}")
    failed = [r for r in reasons if r is not None]
    if failed:  # the first survivor's own reason, rather than word that another gave up
        raise GrowFailed(next((r for r in failed if r != _RELAYED), failed[0]))


def _await(old: MPI.Intracomm, inter: MPI.Intercomm, deadline: float, timeout: float) -> str | None:
    """Wait for every newcomer's ready (None) or a reason to give up, telling the other survivors then."""
    n = inter.Get_remote_size()
    alive = [np.zeros(8 + HOST_BYTES, dtype=np.uint8) for _ in range(n)]
    ready = [np.zeros(1, dtype=np.int64) for _ in range(n)]
    alive_reqs = [inter.Irecv(alive[i], source=i, tag=TAG_ALIVE) for i in range(n)]
    ready_reqs = [inter.Irecv(ready[i], source=i, tag=TAG_READY) for i in range(n)]
    others = old.Dup()
    word = np.zeros(1, dtype=np.int64)
    abort = others.Irecv(word, source=MPI.ANY_SOURCE, tag=TAG_ABORT)
    why, told = None, False
    try:
        while why is None:
            if MPI.Request.Testall(ready_reqs):
                break
            if abort.Test():
                why, told = _RELAYED, True
            elif time.monotonic() > deadline:
                why = f"the newcomers did not reach elastic.run within {timeout:g} s (elastic_replace_timeout)"
            else:
                why = _dead_here(alive, alive_reqs)
            time.sleep(_POLL)
    except MPI.Exception as exc:
        why = f"a newcomer was lost before it joined ({exc.Get_error_string()})"
    if why is None:
        abort.Cancel()
        abort.Wait()
        others.Free()
    elif not told:
        for r in range(others.Get_size()):
            if r != others.Get_rank():
                _kept.append((others.Isend(np.ones(1, dtype=np.int64), dest=r, tag=TAG_ABORT), None))
    _kept.extend((req, buf) for req, buf in zip(alive_reqs + ready_reqs + [abort], alive + ready + [word]))
    return why


def _dead_here(alive: list, reqs: list) -> str | None:
    """The reason to give up where a newcomer that said it is alive runs on this host and is gone."""
    host = MPI.Get_processor_name()
    for buf, req in zip(alive, reqs):
        if not req.Test():
            continue
        pid = int(buf[:8].view(np.int64)[0])
        where = bytes(buf[8:]).rstrip(b"\0").decode(errors="replace")
        if where == host and not _running(pid):
            return f"a newcomer died before it joined (pid {pid} on {host})"
    return None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _verdict(inter: MPI.Intercomm, ok: bool) -> None:
    """Tell every newcomer whether to join (never waited for: a newcomer may be dead)."""
    for i in range(inter.Get_remote_size()):
        buf = np.array([1 if ok else 0], dtype=np.int64)
        _kept.append((inter.Isend(buf, dest=i, tag=TAG_VERDICT), buf))


def join() -> MPI.Intracomm:
    """A newcomer, from ``elastic.run``: say it is ready, hear every survivor's verdict and merge. Returns
    the joined world; where the survivors gave up (or an MPI error says they are gone) the newcomer ends
    (:func:`adasum.runtime.newcomer.leave`): the job went on without it."""
    parent = newcomer.parent()
    n = parent.Get_remote_size()
    one = np.ones(1, dtype=np.int64)
    verdicts = [np.zeros(1, dtype=np.int64) for _ in range(n)]
    try:
        sends = [parent.Isend(one, dest=r, tag=TAG_READY) for r in range(n)]
        recvs = [parent.Irecv(verdicts[r], source=r, tag=TAG_VERDICT) for r in range(n)]
        while not MPI.Request.Testall(recvs):
            time.sleep(_POLL)
        _kept.extend((req, one) for req in sends)
        if not all(int(v[0]) == 1 for v in verdicts):
            newcomer.leave("the survivors gave up this attempt to grow back and went on without it")
        return parent.Merge(high=True)
    except MPI.Exception as exc:
        newcomer.leave(f"joining failed ({exc.Get_error_string()})")
        raise
