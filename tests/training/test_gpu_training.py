"""Training on a CUDA device: the optimizer, with and without overlap, follows the CPU run; float16 with a
GradScaler on CUDA. Skipped where no CUDA device is present."""

from __future__ import annotations

import pytest
import torch

from helpers import CUDA, as_f64, assert_identical_across_ranks, rel_l2
from test_optimizer import _amp_run

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("op,start_copy", [("adasum", "device"), ("adasum", "host"), ("sum", "device"),
                                           ("mean", "device")])
def test_optimizer_on_a_cuda_model_follows_the_cpu_run(comm, op, start_copy):
    gpu, _, _ = _amp_run(comm, op, None, device="cuda", start_copy=start_copy, amp=False)
    cpu, _, _ = _amp_run(comm, op, None, device="cpu", start_copy=start_copy, amp=False)
    assert all(p.is_cuda for p in gpu.parameters())
    for g, c in zip(gpu.parameters(), cpu.parameters()):
        assert rel_l2(as_f64(g), as_f64(c)) <= 1e-4, "the CUDA run left the CPU run's trajectory"
    assert_identical_across_ranks(comm, list(gpu.parameters()))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("op", ["adasum", "mean"])
def test_overlapped_optimizer_on_a_cuda_model_follows_the_cpu_run(comm, op):
    """overlap=True: buckets reduced during backward from CUDA gradients, against the same run on the CPU."""
    gpu, _, _ = _amp_run(comm, op, None, device="cuda", amp=False, overlap=True)
    cpu, _, _ = _amp_run(comm, op, None, device="cpu", amp=False, overlap=True)
    assert all(p.is_cuda for p in gpu.parameters())
    assert_identical_across_ranks(comm, list(gpu.parameters()))
    for g, c in zip(gpu.parameters(), cpu.parameters()):
        assert rel_l2(as_f64(g), as_f64(c)) <= 1e-4, "the overlapped CUDA run left the CPU run's trajectory"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("op", ["adasum", "mean"])
def test_float16_grad_scaler_on_cuda(comm, op):
    """float16 autocast with a GradScaler on a CUDA model: the scale grows every 2 good windows and backs
    off on every rank alike after an Inf on one rank, whose update is skipped everywhere."""
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10, growth_interval=2)
    _, opt, scales = _amp_run(comm, op, scaler, device="cuda")
    assert scales == [2.0 ** 10, 2.0 ** 11, 2.0 ** 11, 2.0 ** 12] and opt.skipped_updates == 0
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10, growth_interval=2)
    model, opt, scales = _amp_run(comm, op, scaler, inject_at=1, device="cuda")
    assert opt.skipped_updates == 1
    assert scales == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_identical_across_ranks(comm, list(model.parameters()))
