"""``python -m bench.repeatability B1.json B2.json ...``: would two ``gpufeed bench``
invocations in a row agree, and with how many runs per row?

Give it the JSON of back-to-back long invocations, every row run the same number of times::

    for i in 1 2 3 4; do gpufeed bench --runs 21 --target-spread 0.0001 --json b$i.json; done

It replays shorter invocations from them: ``n`` consecutive rounds of one invocation (every
window of them) against ``n`` consecutive rounds of the next one, for every pair of windows.
For each way of turning two rows' runs into a ratio, and each ``n``, it prints the share of
comparison rows whose ratio moved by at most ``--tolerance`` (10%) between the two, and the
share of invocation pairs in which every comparison row did. ``gpufeed bench``'s own ratio
(NOTE [ Repeated measurement ] in ``_tools/repeat.py``) is the row "faster halves".
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gpufeed._tools.repeat import Spread

__all__ = ["ESTIMATORS", "Agreement", "agreement", "comparisons", "load", "main"]

Runs = Sequence[float]
Key = tuple[str, str, int]  # (loader, fetch path, num_workers)
Invocation = Mapping[Key, Runs]


def _per_round(a: Runs, b: Runs) -> float:
    return float(statistics.median(x / y for x, y in zip(a, b, strict=True)))


#: ways to turn the runs of two rows into one ratio
ESTIMATORS: dict[str, Callable[[Runs, Runs], float]] = {
    "faster halves (gpufeed bench)": lambda a, b: Spread(tuple(a)).ratio(Spread(tuple(b))).mid,
    "ratio of medians": lambda a, b: statistics.median(a) / statistics.median(b),
    "median of per-round ratios": _per_round,
    "ratio of the fastest runs": lambda a, b: max(a) / max(b),
}


def load(paths: Sequence[Path]) -> list[dict[Key, list[float]]]:
    """The runs of every row of each ``gpufeed bench --json`` file."""
    out = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        out.append({(r["loader"], r["path"], int(r["num_workers"])): list(r["spread"]["runs"])
                    for r in doc["rows"]})
    return out


def comparisons(keys: Sequence[Key]) -> list[tuple[str, Key, Key]]:
    """The comparison rows ``gpufeed bench`` prints, as (name, numerator, denominator)."""
    have = set(keys)
    out = []
    for loader, path, n in keys:
        if loader != "gpufeed":
            continue
        if ("torch", path, n) in have:
            out.append((f"gpufeed vs stock, {path}, {n} workers", (loader, path, n),
                        ("torch", path, n)))
        if path in ("array", "getitems") and ("gpufeed", "per-sample", n) in have:
            out.append((f"batched-path gain, {path}, {n} workers", (loader, path, n),
                        ("gpufeed", "per-sample", n)))
    return out


class Agreement:
    """Counts of one (estimator, runs per row): rows and whole invocation pairs that agreed."""

    def __init__(self) -> None:
        self.rows = self.rows_agreed = self.pairs = self.pairs_agreed = 0
        self.worst = 0.0  # the largest change of any row

    @property
    def row_share(self) -> float:
        return self.rows_agreed / self.rows if self.rows else 0.0

    @property
    def pair_share(self) -> float:
        return self.pairs_agreed / self.pairs if self.pairs else 0.0


def agreement(invocations: Sequence[Invocation], estimator: Callable[[Runs, Runs], float],
              n: int, tolerance: float = 0.10) -> Agreement:
    """Replay invocations of ``n`` runs per row from consecutive long ones (module docstring)."""
    if len(invocations) < 2:
        raise ValueError(f"{len(invocations)} invocation(s) given: give at least two in a row")
    rows = comparisons(list(invocations[0]))
    if not rows:
        raise ValueError("no comparison in the first invocation: it needs gpufeed's and the "
                         "stock loader's rows on the same fetch path (gpufeed bench's JSON)")
    for k, inv in enumerate(invocations):
        missing = sorted({key for _, a, b in rows for key in (a, b)} - set(inv))
        if missing:
            raise ValueError(f"invocation {k + 1} has no row {missing[0]}: give invocations "
                             "of the same gpufeed bench command")
    length = min(len(r) for inv in invocations for r in inv.values())
    if not 1 <= n <= length:
        raise ValueError(f"n={n} runs per row: the invocations hold {length} runs per row; "
                         f"give n from 1 to {length}")
    # each invocation's ratios, window by window (window o: rounds o .. o + n - 1)
    ratios = [[[estimator(inv[a][o:o + n], inv[b][o:o + n]) for _, a, b in rows]
               for o in range(length - n + 1)] for inv in invocations]
    out = Agreement()
    for ratios_a, ratios_b in itertools.pairwise(ratios):
        for ra in ratios_a:
            for rb in ratios_b:
                changes = [abs(x - y) / x for x, y in zip(ra, rb, strict=True)]
                agreed = sum(c <= tolerance for c in changes)
                out.rows += len(changes)
                out.rows_agreed += agreed
                out.pairs += 1
                out.pairs_agreed += agreed == len(changes)
                out.worst = max(out.worst, *changes)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.repeatability",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("files", nargs="+", type=Path, help="gpufeed bench --json files, in order")
    p.add_argument("--runs", default="5,7,9,11", help="runs per row to replay (5,7,9,11)")
    p.add_argument("--tolerance", type=float, default=0.10, help="allowed change (0.10)")
    args = p.parse_args(argv)
    invocations = load(args.files)
    try:
        ns = [int(x) for x in args.runs.split(",")]
    except ValueError:
        p.error(f"--runs {args.runs!r}: give whole numbers separated by commas, e.g. 5,7,9")
    print(f"| runs per row | estimator | rows within {args.tolerance:.0%} | invocation pairs "
          "with every row within | largest change |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for n in ns:
        for name, estimator in ESTIMATORS.items():
            try:
                a = agreement(invocations, estimator, n, args.tolerance)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"| {n} | {name} | {a.row_share:.1%} | {a.pair_share:.1%} of {a.pairs} | "
                  f"{a.worst:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
