"""A numpy-backed stand-in for the parts of cupy that adasum uses, for machines without a GPU.

Its arrays are a numpy subclass with cupy's device attributes (``.device.id``, ``.get``, ``.set``), so
:class:`adasum.adapters.CupyAdapter` runs all of its device code paths (device kernels through the module,
staging through host buffers, side streams, events and stream synchronisation) on the CPU. Counters record
the device calls (streams and events made, copies, waits).
"""

from __future__ import annotations

import sys
import types

import numpy as np

calls = {"synchronize": 0, "get": 0, "set": 0, "pinned": 0, "streams": 0, "events": 0, "record": 0,
         "wait_event": 0, "event_synchronize": 0}


class _Device:
    """As cupy's: equal by id, unhashable (cupy defines equality and no hash), a fresh object per access."""

    def __init__(self, id: int = 0):
        self.id = id

    def __eq__(self, other):
        return isinstance(other, _Device) and other.id == self.id

    __hash__ = None

    def __repr__(self):
        return f"<CUDA Device {self.id}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class ndarray(np.ndarray):
    @property
    def device(self):
        return _Device(0)

    def get(self, stream=None, order="C", out=None, blocking=True):
        calls["get"] += 1
        host = self.view(np.ndarray)
        if out is None:
            return host.copy()
        out[...] = host
        return out

    def set(self, arr, stream=None):
        calls["set"] += 1
        self.view(np.ndarray)[...] = arr


def _wrap(a):
    return np.asarray(a).view(ndarray)


class _Stream:
    """A stream: the stand-in's device work is done when it is queued, so waiting returns at once."""

    def __init__(self, null=False, non_blocking=False, ptds=False):
        if not null:
            calls["streams"] += 1

    def synchronize(self):
        calls["synchronize"] += 1

    def wait_event(self, event):
        calls["wait_event"] += 1


class _Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        calls["events"] += 1

    def record(self, stream=None):
        calls["record"] += 1

    def synchronize(self):
        calls["event_synchronize"] += 1


def make_module() -> types.ModuleType:
    m = types.ModuleType("cupy")
    m.ndarray = ndarray
    m.empty = lambda shape, dtype=np.float64: _wrap(np.empty(shape, dtype))
    m.zeros = lambda shape, dtype=np.float64: _wrap(np.zeros(shape, dtype))
    m.asarray = lambda a, dtype=None: _wrap(np.array(a, dtype=dtype))
    m.asnumpy = lambda a: np.array(np.asarray(a).view(np.ndarray))
    m.dot = lambda x, y: np.dot(x.view(np.ndarray), y.view(np.ndarray))
    for name in ("multiply", "add", "divide", "isfinite", "float16", "float32", "float64", "uint8"):
        setattr(m, name, getattr(np, name))
    m.cuda = types.SimpleNamespace(Device=_Device, Stream=_Stream, Event=_Event,
                                   get_current_stream=lambda: _Stream(null=True))

    m.__adasum_standin__ = True
    return m


def make_cupyx():
    """The stand-in of ``cupyx``: its page-locked host arrays are plain numpy arrays, counted."""
    m = types.ModuleType("cupyx")

    def empty_pinned(shape, dtype=np.float64):
        calls["pinned"] += 1
        return np.empty(shape, dtype=dtype)

    m.empty_pinned = empty_pinned
    return m


def cupy_or_standin():
    """Real cupy where it imports, else the stand-in, installed as ``sys.modules['cupy']``."""
    try:
        import cupy  # noqa: F401

        return sys.modules["cupy"]
    except ImportError:
        module = make_module()
        sys.modules["cupy"] = module
        sys.modules["cupyx"] = make_cupyx()
        return module
