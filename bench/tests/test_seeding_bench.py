"""``python -m bench.seeding`` runs and writes its figures (tiny sizes)."""

from __future__ import annotations

import json

from bench import seeding


def test_measurements_have_their_fields():
    gens = seeding.measure_generators(samples=200, repeats=1)
    assert set(gens) == {"scope_us", "sample_generator_us", "sample_rng_us", "sample_random_us"}
    rows = seeding.measure_threads(samples=16, repeats=1)
    assert [(r["draw"], r["seed"]) for r in rows] == [
        ("sample_generator", None), ("sample_generator", 0), ("global", None), ("global", 0)]
    assert all(r["samples_per_s"] > 0 and r["ceiling"] == 800 for r in rows)


def test_main_writes_json(tmp_path, monkeypatch):
    full = seeding.measure_threads
    monkeypatch.setattr(seeding, "measure_threads",
                        lambda repeats: full(samples=16, repeats=1))
    out = tmp_path / "seeding.json"
    assert seeding.main(["--samples", "128", "--batch", "64", "--repeats", "1",
                         "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert {"environment", "global_seeding", "generators", "thread_workers"} <= set(figures)
