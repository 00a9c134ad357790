"""Every training path in elastic training under Open MPI with ULFM, a rank SIGKILLed from outside the
library in each of three phases (tests/elastic/paths_worker.py, run at the end of the job whose run with
nobody dying test_elastic.py checks: tests/elastic/conftest.py): a sharded model (HSDP 2×2,
``adasum_replicas``) ends on every survivor with ``ShardsLost`` within seconds; DDP with adasum's
communication hooks (:class:`adasum.torch.elastic.ElasticDDP`, the gradient and then the delta form) goes
on, bitwise on a reference run in which the dead rank left at the last commit. Without Open MPI (the main
suite's MPICH) they are skipped."""

from __future__ import annotations

import pytest

from jobs import LAUNCH_TIMEOUT, MPIEXEC, OPEN_MPI

pytestmark = [
    pytest.mark.skipif(not OPEN_MPI or not MPIEXEC.exists(),
                       reason="needs Open MPI with ULFM (scripts/run-elastic-tests.sh makes the environment)"),
    pytest.mark.timeout(LAUNCH_TIMEOUT + 30),
]
RAISES_WITHIN = 20.0  # seconds from the death to the error on every survivor


def test_hsdp_ends_on_every_survivor(plain_then_paths):
    """HSDP 2×2 with adasum_replicas: rank 3 killed inside backward; each of the three survivors (its
    replica partner among them) raises ShardsLost from elastic.run, naming the death and the sharded
    modules, within seconds (then they start a process group of their own and go on to the DDP phases)."""
    _, result, killed = plain_then_paths
    outcomes = result["hsdp"]
    assert sorted(o["rank"] for o in outcomes) == [0, 1, 2]
    for o in outcomes:
        assert o["raised"] == "ShardsLost", o
        assert "a rank died and the world shrank from 4 to 3 ranks" in o["message"], o["message"]
        assert "sharded model" in o["message"] and o["size"] == 3
        assert o["at"] - killed[3] < RAISES_WITHIN, o["at"] - killed[3]
    print(f"np=4 HSDP: ShardsLost on every survivor {max(o['at'] for o in outcomes) - killed[3]:.2f} s after "
          "the death")


def test_ddp_hooks_survive_deaths(plain_then_paths):
    """The gradient hook on the 3 survivors of the HSDP phase, rank 1 killed inside backward's reduction;
    then the delta hook on the 2 survivors of that, rank 0 (the process group's rendezvous host) killed the
    same way. After each death the survivors' process group is started again on their world and the DDP
    model made again (ElasticDDP); each phase ends bitwise on its reference, with its losses, falling."""
    _, result, _ = plain_then_paths
    grad, delta = result["ddp"]
    for phase, size, survivors in ((grad, 2, [0, 2]), (delta, 1, [2])):
        assert phase["size"] == size and phase["torch_size"] == size, phase
        assert phase["survivors"] == survivors
        assert phase["resets"] == [1] * size
        assert phase["equal"], "the survivors' parameters differ"
        assert all(phase["reference_equal"]), phase["reference_equal"]
        losses = phase["losses"][0]
        assert all(mine == losses for mine in phase["losses"])
        assert losses == phase["reference_losses"] and losses[-1] < losses[0], (losses, phase["reference_losses"])
        assert all(s is not None and s < 30 for s in phase["recovery_s"])
    print(f"DDP hooks: recovery {max(grad['recovery_s']):.2f} s (gradients, 3 -> 2 ranks), "
          f"{max(delta['recovery_s']):.2f} s (deltas, 2 -> 1)")
