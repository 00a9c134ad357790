"""Every training path in elastic training under Open MPI with ULFM, a rank SIGKILLed from outside the
library in each of three phases of one job (tests/elastic/paths_worker.py; one job for the elastic
stage's time): a sharded model (HSDP 2×2, ``adasum_replicas``) ends on every survivor with ``ShardsLost``
within seconds; DDP with adasum's communication hooks (:class:`adasum.torch.elastic.ElasticDDP`, the
gradient and then the delta form) goes on, bitwise on a reference run in which the dead rank left at the
last commit. Without Open MPI (the main suite's MPICH) they are skipped."""

from __future__ import annotations

import json

import pytest

from jobs import LAUNCH_TIMEOUT, MPIEXEC, OPEN_MPI, run_job

pytestmark = [
    pytest.mark.skipif(not OPEN_MPI or not MPIEXEC.exists(),
                       reason="needs Open MPI with ULFM (scripts/run-elastic-tests.sh makes the environment)"),
    pytest.mark.timeout(LAUNCH_TIMEOUT + 30),
]
RAISES_WITHIN = 20.0  # seconds from the death to the error on every survivor
# HSDP: rank 3 (its replica partner is rank 2); the gradient hook: rank 1 (a middle rank of 0, 1, 2); the
# delta hook: rank 0 (the rendezvous host of the process group started again on the survivors).
KILLS = ("3@3", "1@5", "0@3")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job's result and the times the killed ranks died (one job for both tests)."""
    tmp = tmp_path_factory.mktemp("paths")
    out = tmp / "result.json"
    args = [a for k in KILLS for a in ("--kill", k)]
    proc = run_job(tmp, 4, *args, "--out", str(out), script="paths_worker.py")
    assert out.exists(), f"no result (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    killed = {int(p.name.rsplit(".", 1)[1]): float(p.read_text()) for p in tmp.glob("result.json.killed.*")}
    return json.loads(out.read_text()), killed


def test_hsdp_ends_on_every_survivor(job):
    """HSDP 2×2 with adasum_replicas: rank 3 killed inside backward; each of the three survivors (its
    replica partner among them) raises ShardsLost from elastic.run, naming the death and the sharded
    modules, within seconds (then they start a process group of their own and go on to the DDP phases)."""
    result, killed = job
    outcomes = result["hsdp"]
    assert sorted(o["rank"] for o in outcomes) == [0, 1, 2]
    for o in outcomes:
        assert o["raised"] == "ShardsLost", o
        assert "a rank died and the world shrank from 4 to 3 ranks" in o["message"], o["message"]
        assert "sharded model" in o["message"] and o["size"] == 3
        assert o["at"] - killed[3] < RAISES_WITHIN, o["at"] - killed[3]
    print(f"np=4 HSDP: ShardsLost on every survivor {max(o['at'] for o in outcomes) - killed[3]:.2f} s after "
          "the death")


def test_ddp_hooks_survive_deaths(job):
    """The gradient hook on the 3 survivors of the HSDP phase, rank 1 killed inside backward's reduction;
    then the delta hook on the 2 survivors of that, rank 0 (the process group's rendezvous host) killed the
    same way. After each death the survivors' process group is started again on their world and the DDP
    model made again (ElasticDDP); each phase ends bitwise on its reference, with its losses, falling."""
    result, _ = job
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
