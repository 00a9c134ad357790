"""Checkpoints carry a checksum: a corrupt, truncated, empty or missing file, or one that does not fit the
model on some rank, raises one clear ValueError on every rank, changes nothing in the model or the
optimizer, and leaves the communicator usable."""

from __future__ import annotations

import hashlib
import logging
import os
import re

import numpy as np
import pytest
import torch

import adasum
from adasum.rule.reference import reference_allreduce
from adasum.torch import DistributedOptimizer, load_checkpoint, read_checkpoint, save_checkpoint
from adasum.torch.state.checkpoint import HEADER_BYTES

from helpers import ONE_SIZE, raw_bytes

HEX = "[0-9a-f]{64}"


def model_of(seed: int, hidden: int = 4) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def trained(rank: int, seed: int, micro: int, hidden: int = 4):
    """A model and a DistributedOptimizer (Adam, windows of 3) after ``micro`` micro-batches: mid-window
    unless ``micro`` is a multiple of 3, so accumulated gradients are part of the state."""
    model = model_of(seed, hidden)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (seed + 1)), accumulation_steps=3)
    g = torch.Generator().manual_seed(100 * seed + rank)
    for _ in range(micro):
        x, y = torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def snapshot_of_state(obj):
    """A nested state (dicts, lists, tensors) as plain values and bytes, for comparing."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), raw_bytes(obj))
    if isinstance(obj, dict):
        return sorted((str(k), snapshot_of_state(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return [snapshot_of_state(v) for v in obj]
    return obj


def snapshot(model, opt) -> list:
    """Every value a load could change, as bytes and plain values."""
    flat = snapshot_of_state
    grads = [None if p.grad is None else raw_bytes(p.grad) for p in model.parameters()]
    if opt is None:
        return [flat(model.state_dict()), grads]
    return [flat(model.state_dict()), flat(opt.state_dict()), grads, opt.micro_steps, opt.boundaries]


def allreduce_still_works(comm) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [np.random.default_rng(r).standard_normal(37) for r in range(size)]
    got = adasum.adasum_allreduce(inputs[rank], comm=comm)
    np.testing.assert_allclose(got, reference_allreduce([[x] for x in inputs], "adasum")[0], rtol=1e-12)


def damage(path: str, how: str) -> str:
    """Damage the file; returns what the error must say (a regular expression)."""
    size = os.path.getsize(path)
    payload = size - HEADER_BYTES
    if how == "flip 64 bytes":
        with open(path, "r+b") as f:
            f.seek(size // 2)
            chunk = f.read(64)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
        return (f"its payload is corrupt: the header says sha256 {HEX}, the {payload} payload bytes have "
                f"sha256 {HEX}")
    if how == "truncated":
        os.truncate(path, size // 2)
        return (f"the file is truncated: its header promises {payload} payload bytes, {size} bytes in all, "
                f"and the file has {size // 2}")
    if how == "truncated in the header":
        os.truncate(path, 40)
        return f"the file is truncated: it has 40 bytes, less than its {HEADER_BYTES}-byte header"
    if how == "bytes appended":
        with open(path, "ab") as f:
            f.write(b"\0" * 10)
        return (f"the file is longer than it should be: its header promises {payload} payload bytes, {size} "
                f"bytes in all, and the file has {size + 10}")
    if how == "empty":
        os.truncate(path, 0)
        return rf"the file is empty \(0 bytes; a checkpoint is a {HEADER_BYTES}-byte header and its payload\)"
    if how == "header damaged":
        with open(path, "r+b") as f:
            f.seek(len("adasum.torch checkpoint 2\npayload "))
            f.write(b"x")
        return (rf"its header is damaged: after the format line it reads b'payload x[0-9]* bytes sha256 {HEX}', "
                r"not b'payload N bytes sha256 HEX'")
    if how == "missing":
        os.unlink(path)
        return "the file does not exist"
    raise AssertionError(how)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("how", ["flip 64 bytes", "truncated", "truncated in the header", "bytes appended",
                                 "empty", "header damaged", "missing"])
@ONE_SIZE
def test_a_damaged_file_raises_on_every_rank_and_changes_nothing(comm, shared_dir, how):
    rank = comm.Get_rank()
    path = os.path.join(shared_dir, "ckpt.pt")
    saved = trained(rank, seed=0, micro=5, hidden=64)  # tensors fill most of the file: a flip lands in one
    save_checkpoint(path, model=saved[0], optimizer=saved[1], extra={"epoch": 3})
    want = damage(path, how) if rank == 0 else None
    want = comm.bcast(want, root=0)

    model, opt = trained(rank, seed=1, micro=4, hidden=64)  # another state, mid-window: all of it must survive
    before = snapshot(model, opt)
    with pytest.raises(ValueError) as err:
        load_checkpoint(path, model=model, optimizer=opt)
    assert re.fullmatch(rf"\(raised on rank {rank}\) rank 0: cannot load checkpoint {re.escape(repr(path))}: "
                        + want, str(err.value)), str(err.value)
    assert snapshot(model, opt) == before

    allreduce_still_works(comm)
    save_checkpoint(path, model=saved[0], optimizer=saved[1], extra={"epoch": 3})  # and the next save loads
    assert load_checkpoint(path, model=model, optimizer=opt) == {"epoch": 3}
    assert snapshot(model, opt) == snapshot(*saved)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_a_model_that_does_not_fit_on_one_rank_raises_everywhere_and_changes_nothing(comm, shared_dir):
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    path = os.path.join(shared_dir, "ckpt.pt")
    saved = trained(rank, seed=0, micro=2)
    save_checkpoint(path, model=saved[0], optimizer=saved[1])

    model = model_of(seed=1, hidden=6 if rank == last else 4)  # the model alone: its optimizer would refuse it
    before = snapshot(model, None)
    with pytest.raises(ValueError, match=rf"^\(raised on rank {rank}\) rank {last}: cannot load checkpoint "
                                         rf".* into the model: '0.weight' has shape \(6, 5\) in the model and "
                                         rf"shape \(4, 5\) in the file$"):
        load_checkpoint(path, model=model)
    assert snapshot(model, None) == before
    allreduce_still_works(comm)


@pytest.mark.mpi(min_size=2)
@ONE_SIZE
def test_an_optimizer_that_does_not_fit_on_one_rank_raises_everywhere_and_changes_nothing(comm, shared_dir):
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    path = os.path.join(shared_dir, "ckpt.pt")
    saved = trained(rank, seed=0, micro=3)
    save_checkpoint(path, model=saved[0], optimizer=saved[1])

    model, opt = trained(rank, seed=1, micro=1)
    if rank == last:  # one parameter group more than the file has
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=rf"^\(raised on rank {rank}\) rank {last}: cannot load checkpoint "
                                         rf".* into the optimizer: .*parameter groups"):
        load_checkpoint(path, model=model, optimizer=opt)
    assert snapshot(model, opt) == before
    allreduce_still_works(comm)


@pytest.mark.mpi(min_size=1)
@ONE_SIZE
def test_the_header_holds_the_payloads_size_and_sha256_and_old_files_still_load(comm, shared_dir, caplog):
    rank = comm.Get_rank()
    path = os.path.join(shared_dir, "ckpt.pt")
    saved = trained(rank, seed=0, micro=4)
    save_checkpoint(path, model=saved[0], optimizer=saved[1], extra={"step": 4})
    if rank == 0:
        data = open(path, "rb").read()
        head, payload = data[:HEADER_BYTES], data[HEADER_BYTES:]
        assert head == (b"adasum.torch checkpoint 2\npayload %d bytes sha256 %s" % (
            len(payload), hashlib.sha256(payload).hexdigest().encode())).ljust(HEADER_BYTES - 1) + b"\n"
        contents = read_checkpoint(path)  # one process alone reads it too
        assert contents["extra"] == {"step": 4} and contents["world_size"] == comm.Get_size()
        assert snapshot_of_state(contents["model"]) == snapshot_of_state(saved[0].state_dict())
        with open(path, "r+b") as f:
            f.seek(len(data) - 10)
            f.write(b"0123456789")
        with pytest.raises(ValueError, match=rf"^cannot read checkpoint .*: its payload is corrupt: the header "
                                             rf"says sha256 {HEX}, the {len(payload)} payload bytes have sha256"):
            read_checkpoint(path)
        with open(path, "wb") as f:  # a file of the first format: the bare payload, no checksum
            f.write(payload)
    comm.Barrier()
    model, opt = trained(rank, seed=1, micro=2)
    with caplog.at_level(logging.WARNING, logger="adasum"):
        assert load_checkpoint(path, model=model, optimizer=opt) == {"step": 4}
    assert snapshot(model, opt) == snapshot(*saved)
    if rank == 0:
        assert any("has no checksum" in r.getMessage() for r in caplog.records)


@pytest.mark.mpi(min_size=2)
@pytest.mark.world_size(2, 3)
def test_a_model_saved_inside_a_window_of_local_steps_does_not_load_alone(comm, shared_dir):
    """Inside a window of local steps each rank holds its own parameters: the file says its model is the
    root's own, its model alone is refused on every rank (changing nothing), and after ``flush()`` a file
    holds the combined model, which loads alone."""
    rank = comm.Get_rank()
    model = model_of(0)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), local_steps=3)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x, y = torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert opt.holds_own_parameters
    path = os.path.join(shared_dir, "mid-window.ckpt")
    save_checkpoint(path, model=model, optimizer=opt)
    assert read_checkpoint(path)["combined"] is False
    other = model_of(1)
    before = snapshot(other, None)
    with pytest.raises(ValueError, match=r"parameters differed when it was saved .* its model is rank 0's own"):
        load_checkpoint(path, model=other)
    assert snapshot(other, None) == before
    save_checkpoint(path, model=model)  # without the optimizer: the ranks' parameters are compared
    assert read_checkpoint(path)["combined"] is False
    opt.flush()
    assert not opt.holds_own_parameters
    save_checkpoint(path, model=model, optimizer=opt)
    assert read_checkpoint(path)["combined"] is True
    load_checkpoint(path, model=other)
    for a, b in zip(other.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()
