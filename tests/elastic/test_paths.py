"""Every training path in elastic training under Open MPI with ULFM, a rank SIGKILLed from outside the
library: DDP with adasum's communication hooks (:class:`adasum.torch.elastic.ElasticDDP`, the gradient and
the delta form) goes on, bitwise on a reference run in which the dead rank left at the last commit; a
sharded model (HSDP: ``adasum_replicas``) ends the job on every survivor with ``ShardsLost`` within
seconds. Without Open MPI (the main suite's MPICH) they are skipped."""

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


def test_ddp_hooks_survive_deaths(tmp_path):
    """One job, two phases: the gradient hook at 4 ranks, rank 0 (the torch store's host) killed inside
    backward's reduction; then the delta hook on the 3 survivors, rank 2 (a middle rank) killed the same
    way. After each death the survivors' process group is started again on their world and the DDP model
    made again (ElasticDDP); each phase ends bitwise on its reference, with its losses."""
    out = tmp_path / "result.json"
    proc = run_job(tmp_path, 4, "--kill", "0@5", "--kill", "2@3", "--out", str(out), script="ddp_worker.py")
    assert out.exists(), f"no result (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    grad, delta = json.loads(out.read_text())
    for phase, size, survivors in ((grad, 3, [1, 2, 3]), (delta, 2, [1, 3])):
        assert phase["size"] == size and phase["torch_size"] == size, phase
        assert phase["survivors"] == survivors
        assert phase["resets"] == [1] * size
        assert phase["equal"], "the survivors' parameters differ"
        assert all(phase["reference_equal"]), phase["reference_equal"]
        losses = phase["losses"][0]
        assert all(mine == losses for mine in phase["losses"])
        assert losses == phase["reference_losses"] and losses[-1] < losses[0], (losses, phase["reference_losses"])
        assert all(s is not None and s < 30 for s in phase["recovery_s"])
    print(f"np=4 DDP hooks: recovery {max(grad['recovery_s']):.2f} s (gradients), "
          f"{max(delta['recovery_s']):.2f} s (deltas)")


def test_hsdp_ends_on_every_survivor(tmp_path):
    """HSDP 2×2 with adasum_replicas: rank 3 killed inside backward; each of the three survivors (its
    replica partner among them) raises ShardsLost from elastic.run, naming the death and the sharded
    modules, within seconds, and the job ends."""
    out = tmp_path / "result.json"
    proc = run_job(tmp_path, 4, "--kill", "3@3", "--out", str(out), script="hsdp_worker.py")
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    killed = float((tmp_path / "result.json.killed.3").read_text())
    outcomes = [json.loads((tmp_path / f"result.json.rank{r}").read_text()) for r in range(3)
                if (tmp_path / f"result.json.rank{r}").exists()]
    assert len(outcomes) == 3, output
    for o in outcomes:
        assert o["raised"] == "ShardsLost", o
        assert "a rank died and the world shrank from 4 to 3 ranks" in o["message"], o["message"]
        assert "sharded model" in o["message"] and o["size"] == 3
        assert o["at"] - killed < RAISES_WITHIN, o["at"] - killed
    print(f"np=4 HSDP: ShardsLost on every survivor {max(o['at'] for o in outcomes) - killed:.1f} s after the death")
