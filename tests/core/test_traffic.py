"""Bytes each rank hands to MPI: about 2·(P-1)/P·N, as a bandwidth-optimal allreduce."""

from __future__ import annotations

import numpy as np
import pytest

import adasum

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture
def threshold():
    """Restores the small-message threshold after a test that sets it."""
    before = adasum.get_small_message_bytes()
    yield adasum.set_small_message_bytes
    adasum.set_small_message_bytes(before)


def test_bytes_sent_per_rank(comm, threshold):
    threshold(0)  # recursive halving at every size
    size, rank = comm.Get_size(), comm.Get_rank()
    k = size.bit_length() - 1
    p2, extra = 1 << k, size - (1 << k)
    layers = [np.random.default_rng([rank, i]).standard_normal(n).astype(np.float32)
              for i, n in enumerate((4096 * 3, 4096, 1, 4096 * 4 - 1))]  # N = 32768 elements, 128 KiB
    nbytes = sum(t.nbytes for t in layers)
    with adasum.count_traffic() as t:
        adasum.adasum_allreduce(layers)
    optimal = 2 * (p2 - 1) * nbytes // p2  # what one survivor of the power-of-two tree sends
    if rank < 2 * extra and rank % 2 == 1:
        want = nbytes  # hands its vector to its partner, receives the result
    elif rank < 2 * extra:
        want = optimal + nbytes  # the tree, plus the result for its partner
    else:
        want = optimal
    assert t.sent_bytes == want, f"rank {rank}: sent {t.sent_bytes} bytes, expected {want}"
    # The per-level dot-product sums and the agreement check are small next to the data.
    levels = k * (k + 1) // 2
    assert t.scalar_bytes <= levels * len(layers) * 3 * 8 + 64
    # Over the whole job the bytes are those of an allreduce of N at P ranks.
    total = comm.allreduce(t.sent_bytes)
    assert total == p2 * optimal + 2 * extra * nbytes


def test_sum_and_mean_go_to_mpi_allreduce_once(comm):
    layers = [np.ones(100, np.float32), np.ones(3, np.float64), np.ones(5, np.float32)]
    with adasum.count_traffic() as t:
        adasum.adasum_allreduce(layers, op="mean")
    # one fused buffer per dtype
    expected = 0 if comm.Get_size() == 1 else sum(x.nbytes for x in layers)
    assert t.allreduce_bytes == expected and t.sent_bytes == 0


def test_small_messages_take_log_p_rounds_of_whole_vectors(comm, threshold):
    size, rank = comm.Get_size(), comm.Get_rank()
    k = size.bit_length() - 1
    extra = size - (1 << k)
    layers = [np.full(300, rank + 1.0, np.float32), np.arange(5.0) * (rank + 1)]
    nbytes = sum(t.nbytes for t in layers)
    threshold(nbytes)
    with adasum.count_traffic() as t:
        out = adasum.adasum_allreduce(layers)
    if rank < 2 * extra and rank % 2 == 1:
        want, rounds = nbytes, 1
    elif rank < 2 * extra:
        want, rounds = (k + 1) * nbytes, k + 1
    else:
        want, rounds = k * nbytes, k
    assert t.sent_bytes == want, f"rank {rank}: sent {t.sent_bytes} bytes, expected {want}"
    assert t.messages == rounds * len(layers)  # one message per round per dtype; no dot-product sums
    # parallel inputs: the mean over all ranks, layer by layer
    np.testing.assert_allclose(out[0], np.full(300, (size + 1) / 2), rtol=1e-6)
    np.testing.assert_allclose(out[1], np.arange(5.0) * (size + 1) / 2, rtol=1e-12)
    # one byte over the threshold takes the halving schedule: per-level dot-product sums appear
    threshold(nbytes - 1)
    with adasum.count_traffic() as t:
        adasum.adasum_allreduce(layers)
    survivor = not (rank < 2 * extra and rank % 2 == 1)
    assert (t.scalar_bytes > 8 * 4) == (survivor and size > 1)  # more than the agreement check
