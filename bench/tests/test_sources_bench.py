"""``python -m bench sources`` at tiny size: it runs and writes its results."""

import json

import pytest

from bench.__main__ import main


def test_sources_benchmark_quick(tmp_path):
    pytest.importorskip("h5py")
    pytest.importorskip("simplejpeg")
    out = tmp_path / "out"
    assert main(["sources", "--quick", "--workloads", "jpeg-crop", "hdf5", "--num-workers", "1",
                 "--out", str(out), "--cache-dir", str(tmp_path / "cache")]) == 0
    doc = json.loads((out / "sources.json").read_text())
    assert doc["environment"]["torch"] and doc["settings"]["quick"]
    names = [w["name"] for w in doc["workloads"]]
    assert names == ["jpeg-crop", "hdf5"]
    for w in doc["workloads"]:
        sides = {r["side"]: r for r in w["rows"]}
        assert "stock" in sides and len(sides) >= 2
        for r in sides.values():
            assert r["median_samples_per_s"] > 0 and len(r["runs"]) == 1
            assert r["min_samples_per_s"] <= r["median_samples_per_s"] <= r["max_samples_per_s"]
    jpeg = {r["side"]: r for r in doc["workloads"][0]["rows"]}
    ceilings = [r for side, r in jpeg.items() if side.startswith("no-loader ceiling")]
    assert len(ceilings) == 3 and all(r["ceiling"] and r["pass"] is None for r in ceilings)
    assert not jpeg["stock"]["ceiling"]
    assert not jpeg["gpufeed ImageFolder (process, channels_last)"]["ceiling"]
    for kind in ("process", "thread"):  # the cost of a per-sample transform=
        assert jpeg[f"gpufeed ImageFolder ({kind}, transform=)"]["median_samples_per_s"] > 0
    md = (out / "sources.md").read_text()
    assert "Quick mode" in md and "| hdf5 | gpufeed |" in md
    assert "| jpeg-crop | no-loader ceiling: ImageFolder's work |" in md


def test_no_ceilings_without_workers(tmp_path):
    """A no-loader ceiling needs worker processes; with ``--num-workers 0`` the JPEG workloads
    run their loaders only (the ceiling sides would refuse ``processes=0``)."""
    pytest.importorskip("simplejpeg")
    from bench.sources import Ceiling, _build

    for nw, ceilings in ((0, 0), (1, 3)):
        sides, _ = _build("jpeg-crop", True, tmp_path, nw)
        assert sum(isinstance(f, Ceiling) for f in sides.values()) == ceilings


def test_shards_benchmark_quick(tmp_path):
    """``python -m bench shards``: webdataset under the stock loader, gpufeed's
    ImageShards and its ceiling, side by side; the dataset's build time in the report."""
    pytest.importorskip("simplejpeg")
    pytest.importorskip("webdataset")
    out = tmp_path / "out"
    assert main(["shards", "--quick", "--num-workers", "1", "--out", str(out),
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    doc = json.loads((out / "shards.json").read_text())
    rows = {r["side"]: r for r in doc["workloads"][0]["rows"]}
    assert set(rows) == {"stock", "gpufeed loader, webdataset", "gpufeed ImageShards (process)",
                         "gpufeed ImageShards (thread)", "no-loader ceiling: ImageShards' work"}
    assert all(r["median_samples_per_s"] > 0 for r in rows.values())
    assert doc["build"]["samples"] == 64 and doc["build"]["ImageShards_s"] > 0
    md = (out / "shards.md").read_text()
    assert md.startswith("# gpufeed tar-shard benchmark") and "`ImageShards` over 8 shards" in md
