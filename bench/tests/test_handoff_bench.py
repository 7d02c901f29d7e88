"""The hand-off bound (bench.handoff): it hands out every batch once, and runs."""

from __future__ import annotations

import json
import multiprocessing
import sys

import numpy as np
import pytest
import torch

from bench.handoff import DUTIES, ideal_pass, main

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="forks its workers (Linux)")


@pytest.mark.parametrize("wait", ["yield", "sleep"])
@pytest.mark.parametrize("workers, slots", [(1, 1), (2, 3), (2, 8)])
def test_every_batch_is_handed_out_once(wait, workers, slots):
    """A bound that lost or repeated a batch would be no bound: the labels handed out sum to
    the epoch's, with a last batch shorter than the rest and slots reused many times."""
    x = torch.randn(1000, 5)[:, ::2]  # strided, as a structured array's field
    y = torch.arange(1000, dtype=torch.int64) ** 2
    order = np.random.default_rng(0).permutation(1000)[:997]
    got = ideal_pass([x, y], order, 32, workers=workers, slots=slots, wait=wait)
    assert got["checksum"] == float(y[torch.from_numpy(order)].sum())
    assert got["samples_per_s"] > 0


@pytest.mark.parametrize("duties", [("views",), ("views", "lease"), ("stats",), DUTIES])
@pytest.mark.parametrize("wait", ["yield", "sleep"])
def test_with_a_drop_in_loaders_duties_every_batch_is_handed_out_once(wait, duties):
    """With new tensors per batch, slots held by their leases until the batch is dropped and
    the statistics recorded: the same labels, whichever duties."""
    x = torch.randn(1000, 5)[:, ::2]
    y = torch.arange(1000, dtype=torch.int64) ** 2
    order = np.random.default_rng(1).permutation(1000)[:997]
    got = ideal_pass([x, y], order, 32, workers=2, slots=3, wait=wait, duties=duties)
    assert got["checksum"] == float(y[torch.from_numpy(order)].sum())


def test_bad_settings_name_the_value():
    x = torch.zeros(4, 1)
    with pytest.raises(ValueError, match="wait='spin'"):
        ideal_pass([x], np.arange(4), 2, wait="spin")
    with pytest.raises(ValueError, match="slots=1"):
        ideal_pass([x], np.arange(4), 2, workers=2, slots=1)
    with pytest.raises(ValueError, match=r"\['pickle'\] unknown; choose from"):
        ideal_pass([x], np.arange(4), 2, duties=("views", "pickle"))


def test_the_tool_writes_its_rounds(tmp_path):
    out = tmp_path / "handoff.json"
    result = main(["--quick", "--rounds", "1", "--duties", "all", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rounds"] == json.loads(json.dumps(result["rounds"]))
    row = saved["rounds"][0]
    assert row["ideal_samples_per_s"] > 0 and row["gpufeed_samples_per_s"] > 0
    assert len(row["ceiling_samples_per_s"]) == 2 and saved["environment"]["torch"]


def _failing_pass(conn) -> None:
    order = np.arange(200)
    order[150] = 10_000
    try:
        ideal_pass([torch.zeros(200, 2), torch.arange(200)], order, 8, slots=2)
    except RuntimeError as e:
        conn.send(f"raised: {e}")
    else:
        conn.send("returned")


def test_a_failing_worker_is_an_error_not_a_hang():
    """An index past the data's end fails one worker's gather: the pass raises within
    seconds, and the other worker (waiting for slots never released) is stopped too."""
    # in a forked child (torch already imported), so that a hang is a failure of this test
    ctx = multiprocessing.get_context("fork")
    answer, conn = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_failing_pass, args=(conn,))
    child.start()
    conn.close()
    try:
        assert answer.poll(60), "the pass neither raised nor returned within 60 s"
        said = answer.recv()
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
        answer.close()
    assert said.startswith("raised: hand-off workers"), said
