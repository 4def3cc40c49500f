"""examples/decode_tp.py under torchrun (gloo, CPU): TP x CP layouts on 1, 2, 4 and 8 ranks equal one
process, compiled and eager; bad configurations and ranks started with different flags fail on every
rank; a failing, dead or stuck rank ends the job."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "decode_tp.py"
WORKER = ROOT / "tests" / "tp_worker.py"
RAGGED = "1,17,64,65"  # one-token prompt, and lengths around a 64-token block
# One worker runs every multi-process test (this module's and DeepSpeed's): 8 gloo ranks beside
# DeepSpeed's spinning shared-memory all-reduce on a 2-core machine slowed each several-fold.
pytestmark = pytest.mark.xdist_group("ranks")


def _run(cmd: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or os.environ.copy())


def _torchrun(world: int, script: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(script),
        *args,
    ]
    return _run(cmd, timeout)


def _expect_ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_single_process_defaults_check():
    """One process, no process group; a run long enough to profile the attention share."""
    out = _expect_ok(_run([sys.executable, str(EXAMPLE), "--check", "--gen", "17"]))
    assert "world 1" in out and "check: OK" in out and "tokens/s" in out
    assert "of decode time (profiled over 8 steps)" in out, out


@pytest.mark.parametrize(
    "world,cp,compiled,model",
    [(2, "2", True, "tiny"), (4, "1,2", False, "tiny-mla"), (8, "1,4,8", False, "tiny")],
    ids=["world2-compiled", "world4-mla", "world8"],
)
def test_tp_and_cp_match_single_process(world, cp, compiled, model):
    """Ragged batch, each layout (TP x CP) of one launch against one process: TP 1 x CP 2 compiled
    (fullgraph: the CP all-gather, the merge op and the MLP's all-reduce in the graph); MLA
    (tiny-mla) at TP 4 (4 of its 16 query heads a rank, the latent cache whole on each) and TP 2 x
    CP 2 (the latent cache's positions split); then TP 8 (each of tiny's 2 KV heads replicated on
    4 ranks), TP 2 x CP 4 and TP 1 x CP 8. CP deals each head's sequence in runs of 16 tokens, so
    the 1- and 17-token prompts leave most ranks without a key of their sequence (they merge as lse
    -inf). tests/test_tp.py checks the head plan for every world size and traces the TP step's
    all-reduces; 1 rank is test_single_process_defaults_check (SDPA's decode path is
    tests/test_model.py's, sharded the same)."""
    gen = 8 if compiled else 12
    args = ["--model", model, "--cp", cp, "--check", "--prompt-len", RAGGED, "--gen", str(gen)]
    args += ["--compile"] if compiled else []
    out = _expect_ok(_torchrun(world, EXAMPLE, *args))
    for c in map(int, cp.split(",")):
        assert f"world {world}" + (f" (tp {world // c} x cp {c})" if c > 1 else ",") in out, out
    assert f"rank {world - 1}:" in out and ("compile on" in out) == compiled
    assert out.count(f"check: OK ({4 * gen} of {4 * gen} tokens identical") == len(cp.split(",")), out
    assert out.count("every rank's tokens and logits bitwise identical)") == len(cp.split(",")), out


def test_context_parallel_attention_features_under_gloo():
    """Several query tokens, windows, sinks, softcap and fp8 through the real all-gather: each rank's
    result against float64, and the same bits on both ranks (tests/cp_worker.py)."""
    out = _expect_ok(_torchrun(2, ROOT / "tests" / "cp_worker.py", timeout=120))
    for rank in (0, 1):
        assert f"rank {rank}: 3 cases match float64, identical on all 2 ranks" in out, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_ranks(world: int, cmd, started: int | None = None) -> list[subprocess.Popen]:
    """The ranks of a job started by hand (no torchrun supervising them), as torchrun would set them
    up; only the first ``started`` of them when given. ``cmd``: a command, or rank -> command."""
    port, procs = _free_port(), []
    for rank in range(world if started is None else started):
        env = os.environ | {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }
        argv = cmd(rank) if callable(cmd) else cmd
        procs.append(
            subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def test_unshardable_heads_fail_on_every_rank():
    """tiny has 8 query heads: 3 ranks cannot split them. Every rank stops with status 2 before any
    collective; rank 0 says why in one argparse-style line, and no rank prints a traceback. Ranks 0
    and 1 of the 3 are started (rank 2 would do as rank 1 does)."""
    procs = _spawn_ranks(3, [sys.executable, str(EXAMPLE)], started=2)
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and "Traceback" not in err
        message = (
            "decode_tp.py: error: argument --model: cannot shard attention: expected n_heads divisible by "
            "world_size, got n_heads=8, n_kv_heads=2, world_size=3"
        )
        assert (message in err) == (rank == 0), err


def test_ranks_started_with_different_settings_all_stop():
    """Each rank's flags are valid alone (--cp 1 and --cp 2 both divide 2 ranks); the ranks compare
    them after joining, before any work, and all exit 2 with one line from rank 0."""
    procs = _spawn_ranks(2, lambda rank: [sys.executable, str(EXAMPLE), "--cp", str(rank + 1)])
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and "Traceback" not in err, err[-2000:]
        message = (
            "decode_tp.py: error: ranks were started with different settings: expected one --cp, "
            "got [1] on rank 0, [2] on rank 1"
        )
        assert (message in err) == (rank == 0), err


@pytest.mark.parametrize("mode", ["raise", "exit", "hang"])
def test_failing_rank_ends_the_job_within_the_timeout(mode):
    """Without torchrun to kill the job, the healthy rank must still stop: at once when the peer's
    connection drops, and after the process-group timeout when the peer is alive but stuck (under
    context parallelism, stuck in the CP subgroup's all-gather, whose timeout is the job's)."""
    timeout_s = 8
    start = time.monotonic()
    procs = _spawn_ranks(2, [sys.executable, str(WORKER), mode, str(timeout_s), "2" if mode == "hang" else "1"])
    try:
        _, err = procs[0].communicate(timeout=120)
        elapsed = time.monotonic() - start
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert procs[0].returncode != 0, err[-2000:]
    assert "finished" not in err
    assert elapsed < 60 + timeout_s
    if mode == "hang":
        assert "Timed out" in err


def test_torchrun_stops_all_ranks_when_one_raises():
    start = time.monotonic()
    proc = _torchrun(2, WORKER, "raise", "60", timeout=120)
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr
    assert time.monotonic() - start < 60  # well before the 60 s collective timeout would fire
