"""What a pinned slot's release fence costs per batch: ``python -m bench.release``.

NOTE [ Slot lifetime ] (a) in ``_memory/ring.py``: at hand-out the consumer's current stream of
every device with a CUDA context is read, and at release one event is recorded per distinct
stream. This counts those CUDA calls per batch (1 GPU; 8 GPUs with a context on 1, as a torchrun
rank; 8 with a context on each) and times
gpufeed's own Python work around them, with every CUDA call replaced by a no-op (so it runs
without a GPU): the part of the cost that is ours. The CUDA calls themselves (a current-stream
read, an event record: microseconds each on a real GPU) are not timed here.
Median of 5 runs; results go to ``bench/results/release.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpufeed._base import cuda as _cuda
from gpufeed._tools.environment import environment

__all__ = ["main", "measure"]


class _Counter:
    """Stands in for streams and events; counts what was asked of CUDA. Devices below
    ``contexts`` have a CUDA context."""

    def __init__(self, contexts: int) -> None:
        self.contexts = contexts
        self.streams = self.events = self.probes = self.captures = 0

    def stream(self, index: int) -> tuple[str, int]:
        self.streams += 1
        return ("stream", index)

    def record(self, stream: Any) -> object:
        self.events += 1
        return object()

    def capturing(self, stream: Any) -> bool:
        self.captures += 1
        return False

    def has_context(self, index: int) -> bool:
        self.probes += 1
        return index < self.contexts


@contextmanager
def _null_cuda(devices: int, contexts: int) -> Iterator[_Counter]:
    counter = _Counter(contexts)
    seams = {"_has_context": counter.has_context, "_current_stream_of": counter.stream,
             "_record_on": counter.record, "_capturing_on": counter.capturing,
             "device_count": lambda: devices}
    saved = {name: getattr(_cuda, name) for name in seams}
    known = set(_cuda._with_context)
    try:
        for name, fn in seams.items():
            setattr(_cuda, name, fn)
        _cuda._with_context.clear()
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(_cuda, name, fn)
        _cuda._with_context.clear()
        _cuda._with_context.update(known)


def measure(devices: int, contexts: int, batches: int = 20_000,
            repeats: int = 5) -> dict[str, Any]:
    """Per batch: CUDA calls (stream reads, events, context probes) and microseconds of
    gpufeed's own work for a hand-out plus a release, with ``devices`` visible devices of
    which ``contexts`` have a CUDA context (device 0, the ring's, among them)."""
    runs: list[float] = []
    with _null_cuda(devices, contexts) as counter:
        _cuda.release_event(0)  # the devices with a context are known from now on
        for _ in range(repeats):
            counter.streams = counter.events = counter.probes = counter.captures = 0
            start = time.perf_counter()
            for _ in range(batches):
                known = _cuda.context_devices(0, probe=False)  # SlotRing.hand_out
                handout = _cuda.current_streams(known)
                _cuda.release_event(0, handout)  # the release, on the consumer's thread
            runs.append(time.perf_counter() - start)
    return {
        "devices": devices, "contexts": contexts, "batches": batches,
        "stream_reads_per_batch": counter.streams / batches,
        "events_per_batch": counter.events / batches,
        "context_probes_per_batch": counter.probes / batches,
        "capture_checks_per_batch": counter.captures / batches,
        "python_us_per_batch": statistics.median(runs) / batches * 1e6,
        "python_us_runs": [r / batches * 1e6 for r in runs],
    }


def render(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = ["# Release fence cost per batch", "",
             f"{env['date']} on `{env['hostname']}` ({env['cpu_model']}), Python "
             f"{env['python']}, torch {env['torch']}. CUDA calls replaced by no-ops: the "
             "calls are counted, gpufeed's own work around them is timed (median of "
             f"{doc['repeats']} runs of {doc['rows'][0]['batches']} batches); the CUDA calls "
             "themselves are not timed (no GPU).", "",
             "| visible devices | with a context | stream reads | events | context probes | "
             "capture checks | gpufeed's own us per batch (runs) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in doc["rows"]:
        spread = ", ".join(f"{x:.2f}" for x in r["python_us_runs"])
        lines.append(f"| {r['devices']} | {r['contexts']} | {r['stream_reads_per_batch']:g} | "
                     f"{r['events_per_batch']:g} | {r['context_probes_per_batch']:g} | "
                     f"{r['capture_checks_per_batch']:g} | "
                     f"{r['python_us_per_batch']:.2f} ({spread}) |")
    lines += ["", "Per batch: the stream reads at hand-out and at release, one event per "
              "distinct stream (the consumer's stream, same at both, on each device), and one "
              "driver query at release per visible device not known to have a context "
              "(torchrun on an 8-GPU node: 7; no context is created), and a capture check "
              "(a switch to the stream) per stream beyond the first when several are fenced. "
              "Before this change a "
              "release was one event (the ring's device only) plus a device guard, and the "
              "hand-out checked each leaf's first and last byte with a CUDA pointer query "
              "(4 per batch of two leaves; tests/memory/test_release_devices.py counts both)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.release",
                                description="What a pinned slot's release fence costs.")
    p.add_argument("--cases", nargs="+", default=["1/1", "8/1", "8/8"], metavar="VISIBLE/CTX",
                   help="visible devices / devices with a CUDA context, to model (default "
                        "1/1 8/1 8/8: one GPU; one rank of torchrun on 8; one process on 8)")
    p.add_argument("--batches", type=int, default=20_000, help="batches per run (20000)")
    p.add_argument("--repeats", type=int, default=5, help="runs; the median (5)")
    p.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="folder for release.json and release.md")
    args = p.parse_args(argv)
    cases = []
    for case in args.cases:
        try:
            visible, contexts = (int(x) for x in case.split("/"))
        except ValueError:
            p.error(f"--cases takes VISIBLE/CTX pairs such as 8/1, got {case!r}")
        if not 1 <= contexts <= visible:
            p.error(f"--cases {case}: need 1 <= devices with a context <= visible devices")
        cases.append((visible, contexts))
    if args.batches < 1 or args.repeats < 1:
        p.error(f"need --batches >= 1 and --repeats >= 1, got --batches {args.batches} "
                f"--repeats {args.repeats}")
    doc = {"environment": environment(), "repeats": args.repeats,
           "rows": [measure(v, c, args.batches, args.repeats) for v, c in cases]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "release.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = render(doc)
    (args.out / "release.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
