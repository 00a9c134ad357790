"""The library's large kept host buffers ask the kernel for transparent huge pages (adasum.runtime.hugepages):
MPI moves large messages out of huge pages faster, and torch does not ask for them itself."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import torch  # imported at first use: the numpy tests run without torch
from mpi4py import MPI

from adasum.adapters.base import host_numpy
from adasum.runtime import hugepages
from adasum.runtime.context import context_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                                reason="a Linux kernel with transparent huge pages")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_kept_buffers_ask_for_huge_pages(kind, dtype):
    if kind == "numpy" and dtype == "bfloat16":
        pytest.skip("numpy has no bfloat16")
    buffers = context_for(MPI.COMM_SELF).buffers
    n = (6 << 20) // (2 if dtype == "bfloat16" else 4)
    big = host_numpy(buffers.get(kind, "cpu", dtype, n, "test-huge"))
    inner = -(-big.ctypes.data // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE  # a whole huge page inside it
    assert "hg" in vm_flags(inner + 4096)
    buffers.clear()


def test_advise_takes_only_whole_huge_pages():
    assert not hugepages.advise(4096, hugepages.HUGE_PAGE)  # no whole huge page inside
    raw = np.empty(3 * hugepages.HUGE_PAGE, np.uint8)
    assert hugepages.advise(raw.ctypes.data, raw.nbytes)
    t = torch.empty(3 * hugepages.HUGE_PAGE, dtype=torch.uint8)
    assert hugepages.advise(t.data_ptr(), t.numel())
    assert "hg" in vm_flags(-(-t.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_mid_sized_kept_buffers_start_on_a_huge_page_and_are_as_long_as_asked(kind, dtype):
    """From hugepages.MIN_BYTES on, a kept host buffer starts on a huge page, covers whole ones and asks for
    them; a request is answered with exactly the elements asked for, also after a larger one."""
    if kind == "numpy" and dtype == "bfloat16":
        pytest.skip("numpy has no bfloat16")
    if not hugepages._kernel_gives_them():
        pytest.skip("transparent huge pages set to never")
    buffers = context_for(MPI.COMM_SELF).buffers
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    for nbytes in (hugepages.MIN_BYTES, 300 << 10, (2 << 20) + 4096):
        n = nbytes // itemsize
        buf = buffers.get(kind, "cpu", dtype, n, "test-mid")
        view = host_numpy(buffers.host_whole(kind, dtype, n, "test-mid"))
        assert len(buf) == n and len(view) % (hugepages.HUGE_PAGE // itemsize) == 0
        assert view.ctypes.data % hugepages.HUGE_PAGE == 0 and "hg" in vm_flags(view.ctypes.data)
    assert len(buffers.get(kind, "cpu", dtype, 10, "test-mid")) == 10  # a smaller request: the same buffer, cut
    buffers.clear()


def test_a_kept_buffer_on_huge_pages_goes_with_the_buffers():
    """The larger allocation a huge-page buffer is a view of is freed once the context lets the buffer go."""
    import weakref

    buffers = context_for(MPI.COMM_SELF).buffers
    buf = buffers.get("numpy", "cpu", "float32", 200_000, "test-free")
    whole = weakref.ref(buf.base if buf.base is not None else buf)
    del buf
    buffers.clear()
    assert whole() is None


def test_small_kept_buffers_are_allocated_as_asked():
    buffers = context_for(MPI.COMM_SELF).buffers
    buf = buffers.get("numpy", "cpu", "float32", 1000, "test-small")
    assert len(buf) == 1000 and buf.base is None  # its own allocation, not a view of a huge page
    buffers.clear()
