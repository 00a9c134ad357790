"""The settings are checked once, by ``Options.problems()``, at every entry point that takes them: a bad
value of any option on one rank raises on every rank, naming that rank and the value, before anything is
built (no rank is left waiting in a collective the others never reach). The subject does not depend on the
world size: one size."""

from __future__ import annotations

import pytest
import torch

from adasum.torch import DistributedOptimizer, Options
from adasum.torch.ddp import DeltaState

# (settings given to the last rank only, what its error says)
BAD = [
    ({"op": "max"}, "op must be one of 'adasum', 'sum', 'mean', got 'max'"),
    ({"accumulation_steps": 0}, "accumulation_steps must be a positive integer, got 0"),
    ({"accumulation_steps": 2.5}, "accumulation_steps must be a positive integer, got 2.5"),
    ({"bucket_bytes": 0}, "bucket_bytes must be a positive integer, got 0"),
    ({"start_copy": "disk"}, "start_copy must be 'device' or 'host', got 'disk'"),
    ({"buffers": "sometimes"}, "buffers must be 'average', 'broadcast' or None, got 'sometimes'"),
    ({"hierarchical": True, "op": "mean"}, "hierarchical=True needs op 'adasum', got op 'mean'"),
    ({"compression": "int8"}, "compression must be None, 'fp16' or 'bf16', got 'int8'"),
    ({"local_steps": 0}, "local_steps must be an integer >= 1, got 0"),
    ({"outer_lr": 0.0}, r"outer_lr must be a number > 0, got 0.0"),
    ({"outer_momentum": 1.0}, r"outer_momentum must be a number in \[0, 1\), got 1.0"),
    ({"delay": 2}, "delay must be 0 or 1, got 2"),
    ({"overlap": True, "local_steps": 2}, "overlap=True overlaps a combine with the backward that closes it"),
    ({"buffers": "broadcast"}, "buffers='broadcast' needs the model"),
]
DELTA_STATE = {"compression", "start_copy", "accumulation_steps", "skip_nonfinite", "overlap", "hierarchical"}

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.world_size(2)]


def params():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return list(torch.nn.Linear(4, 3).parameters())


@pytest.mark.parametrize("bad,said", BAD, ids=[",".join(f"{k}={v!r}" for k, v in b.items()) for b, _ in BAD])
def test_a_bad_option_on_one_rank_raises_on_every_rank(comm, bad, said):
    last = comm.Get_size() - 1
    settings = bad if comm.Get_rank() == last else {}
    with pytest.raises(ValueError, match=rf"rank {last}: {said}"):
        DistributedOptimizer(torch.optim.SGD(params(), lr=0.1), comm=comm, **settings)
    if set(bad) <= DELTA_STATE:
        with pytest.raises(ValueError, match=rf"rank {last}: {said}"):
            DeltaState(torch.optim.SGD(params(), lr=0.1), comm, **settings)
    # the same values as an Options object, made on every rank without raising, refused where it is used
    options = Options(**settings)
    valid_alone = bad == {"buffers": "broadcast"}  # a problem only without the model
    assert bool(options.problems()) == (comm.Get_rank() == last and not valid_alone)
    with pytest.raises(ValueError, match=rf"rank {last}: {said}"):
        DistributedOptimizer(torch.optim.SGD(params(), lr=0.1), comm=comm, options=options)


def test_problems_lists_every_bad_value_of_one_rank(comm):
    """Each rank's problems all at once, in one error, whatever the rank."""
    settings = {"op": "max", "delay": 3} if comm.Get_rank() == 0 else {"start_copy": "disk"}
    with pytest.raises(ValueError, match=r"rank 0: op must be one of .*got 'max'; delay must be 0 or 1, got 3; "
                                         r"rank 1: start_copy must be 'device' or 'host', got 'disk'"):
        DistributedOptimizer(torch.optim.SGD(params(), lr=0.1), comm=comm, **settings)
    # good settings afterwards: nothing was left behind
    DistributedOptimizer(torch.optim.SGD(params(), lr=0.1), comm=comm).close()


def test_an_unknown_keyword_on_one_rank_raises_on_every_rank(comm):
    last = comm.Get_size() - 1
    settings = {"local_step": 2} if comm.Get_rank() == last else {}
    with pytest.raises(TypeError, match=rf"rank {last}: DistributedOptimizer got unexpected keyword argument\(s\) "
                                        r"'local_step'; its settings are op, "):
        DistributedOptimizer(torch.optim.SGD(params(), lr=0.1), comm=comm, **settings)
    settings = {"op": "mean"} if comm.Get_rank() == last else {}
    with pytest.raises(TypeError, match=rf"rank {last}: DeltaState got unexpected keyword argument\(s\) 'op'"):
        DeltaState(torch.optim.SGD(params(), lr=0.1), comm, **settings)


def test_delta_state_refuses_options_it_does_not_take_and_ranks_that_differ(comm):
    with pytest.raises(ValueError, match=r"DeltaState takes the settings .*; the options given set op='mean', "
                                         r"local_steps=4"):
        DeltaState(torch.optim.SGD(params(), lr=0.1), comm, options=Options(op="mean", local_steps=4))
    k = 2 if comm.Get_rank() == comm.Get_size() - 1 else 1
    with pytest.raises(ValueError, match=r"ranks disagree on accumulation_steps of DeltaState"):
        DeltaState(torch.optim.SGD(params(), lr=0.1), comm, accumulation_steps=k)


@pytest.mark.parametrize("name", ["skip_nonfinite", "hierarchical", "overlap"])
def test_switches_take_booleans_only(comm, name):
    with pytest.raises(ValueError, match=rf"{name} must be True or False, got 'no'"):
        DistributedOptimizer(torch.optim.SGD(params(), lr=0.1), comm=comm, **{name: "no"})
