"""Two nodes on one machine: ``torchrun --nnodes=2 --nproc-per-node=1`` launched twice, a c10d
rendezvous on 127.0.0.1, gloo (``tests/support/dist_nodes.py`` runs on each rank).

Checked: each rank's shard of an epoch (disjoint, covering), budgets divided by the ranks on
this node (``LOCAL_WORLD_SIZE``), not by the world; a mid-epoch resume on each rank, another
rank's state where gpufeed promises it (map-style, ``seed=``) and a clear refusal where it
does not (another world size); and a rank killed mid-epoch ending the other with an error
within seconds, leaving no process behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import psutil
import pytest
from test_distributed import TESTS, _free_port

import gpufeed
from support.dist_sampling import Indexed

N, BATCH = 21, 4  # as in dist_sampling.py
DEADLINE_S = 60


def _launch(out: Path) -> tuple[list[subprocess.CompletedProcess], float]:
    """Both nodes' torchrun, started together; their results and the wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(TESTS.parent / "src"), str(TESTS), str(TESTS / "support"),
         os.environ.get("PYTHONPATH", "")]))
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           f"--rdzv-id={uuid.uuid4().hex}", "--max-restarts=0", "--monitor-interval=0.2",
           str(TESTS / "support" / "dist_nodes.py"), str(out)]
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(2)]
    done = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, DEADLINE_S - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, 9)
            raise
        done.append(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    return done, time.monotonic() - t0


def _left_behind(tag: str) -> list[str]:
    """Processes still running whose command line names ``tag`` (ranks and their forked
    workers carry the rank's command line)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and tag in " ".join(
                    p.info["cmdline"] or ()):
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'])}")
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess], float]:
    out = tmp_path_factory.mktemp("nodes")
    done, wall = _launch(out)
    return out, done, wall


@pytest.fixture(scope="module")
def reports(launch) -> list[dict]:
    out, done, _ = launch
    if not all((out / f"rank{r}.json").exists() for r in range(2)):
        pytest.fail("a rank wrote no report:\n" + "\n".join(n.stderr for n in done))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_each_node_runs_one_rank_of_two(reports):
    for rank, rep in enumerate(reports):
        assert rep["rank"] == rank and rep["world_size"] == 2
        assert rep["env"]["WORLD_SIZE"] == "2" and rep["env"]["LOCAL_WORLD_SIZE"] == "1"
        assert rep["env"]["LOCAL_RANK"] == "0"
        assert rep["loader_world"] == [rank, 2]  # the loader shards by the process group
    assert {rep["env"]["GROUP_RANK"] for rep in reports} == {"0", "1"}  # two nodes


def test_shards_are_disjoint_and_cover_the_dataset(reports):
    parts = [[i for batch in rep["epoch"] for i in batch] for rep in reports]
    assert len(parts[0]) == len(parts[1]) == -(-N // 2)
    counts = Counter(i for p in parts for i in p)
    assert set(counts) == set(range(N))
    assert sum(counts.values()) == N + N % 2  # only the sampler's padding repeats
    for rank, part in enumerate(parts):
        want = gpufeed.samplers.ShardedSampler(range(N), rank=rank, world_size=2, seed=3)
        assert part == list(want)


def test_budgets_are_divided_among_this_nodes_ranks_only(reports):
    for rep in reports:
        assert rep["local_ranks"] == 1
        assert rep["budget_cpus"] == pytest.approx(rep["machine_cpus"])  # not / WORLD_SIZE
        assert rep["budget_memory"] == pytest.approx(rep["memory_share"], rel=0.2)


def test_resume_on_each_rank_and_across_ranks(reports):
    for rep in reports:
        assert rep["head"] + rep["rest"] == rep["epoch"]
        assert rep["resumed"] == rep["rest"]
    # rank 1 may load rank 0's state (map-style, seed=: frameworks save rank 0's only)
    moved = gpufeed.DataLoader(Indexed(), batch_size=BATCH, shuffle=True, seed=3,
                               rank=1, world_size=2)
    moved.load_state_dict(reports[0]["state"])
    assert [[int(i) for i in index] for index, _ in moved] == reports[1]["rest"]


def test_another_world_size_is_refused_naming_the_fix(reports):
    for world in (1, 3):
        other = gpufeed.DataLoader(Indexed(), batch_size=BATCH, shuffle=True, seed=3,
                                   rank=0, world_size=world)
        with pytest.raises(ValueError, match=r"world_size.*launch the same number of ranks"):
            other.load_state_dict(reports[0]["state"])


def test_a_killed_rank_ends_the_other_with_an_error_and_no_orphan(launch):
    out, done, wall = launch
    assert all(node.returncode != 0 for node in done), [n.returncode for n in done]
    said = "\n".join(node.stderr for node in done)
    assert "Signal 9 (SIGKILL)" in said or "exitcode  : -9" in said, said[-3000:]
    assert "ChildFailedError" in said and "dist_nodes.py FAILED" in said, said[-3000:]
    # Rank 0 stops on the failure, not by a timeout, one of two ways: its collective fails
    # (gloo: the peer's connection reset), or the killed rank's agent, which may host the
    # rendezvous store, exits first, and rank 0's agent, cut off from the store, stops rank 0
    # itself (seen once in a full suite run)
    by_collective = "[rank0]: RuntimeError" in said and "exitcode  : 1" in said
    by_agent = "RendezvousConnectionError" in said
    assert by_collective or by_agent, said[-3000:]
    assert wall < DEADLINE_S, f"the nodes took {wall:.1f} s to stop"
    deadline = time.monotonic() + 10
    while (left := _left_behind(str(out))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
