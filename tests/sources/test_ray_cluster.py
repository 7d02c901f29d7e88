"""gpufeed.DataLoader over Ray Data on a simulated two-node cluster: the trainer's node runs no
Ray task (no CPU given to Ray), so every block is made on the other node and must travel."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import gpufeed

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'gpufeed[ray]'")
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'gpufeed[ray]'")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [
    # two raylets start: about a minute on a loaded 2-core machine, seconds on a free one
    pytest.mark.slow,
    pytest.mark.filterwarnings(
        "ignore::DeprecationWarning", "ignore::ResourceWarning", "ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def far_node() -> Iterator[Any]:
    env = {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
    cluster = cluster_utils.Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    far = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, runtime_env=env)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield far
    ray.shutdown()
    cluster.shutdown()


def test_blocks_made_on_the_other_node_arrive(far_node: Any) -> None:
    def where(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        node = ray.get_runtime_context().get_node_id()
        return {**batch, "node": np.array([node] * len(batch["id"])),
                "x": np.repeat(batch["id"][:, None], 8, 1).astype(np.float32)}

    ds = ray.data.range(400, override_num_blocks=4).map_batches(where)
    loader = gpufeed.DataLoader(ds, batch_size=50)
    batches = list(loader)
    nodes = {str(n) for b in batches for n in b["node"]}
    assert nodes == {far_node.node_id}  # made there, not on the trainer's node
    assert far_node.node_id != ray.get_runtime_context().get_node_id()
    ids = torch.cat([b["id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(400))
    assert all(torch.equal(b["x"][:, 3], b["id"].float()) for b in batches)
    assert loader.stats().counters["samples"] == 400
