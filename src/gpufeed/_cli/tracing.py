"""``gpufeed profile ... --trace FILE --timeline FILE.png``: the profiled run, recorded.

The options are added to ``profile``'s parser here, and :func:`cmd_profile_traced` runs
``cmd_profile`` inside ``gpufeed.trace`` (``_tools/trace.py``) when either is given, then
writes the trace and draws the picture (``_tools/gantt.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .._tools.output import file_path
from .commands import cmd_profile
from .targets import UsageError


def add_trace_options(p: argparse.ArgumentParser,
                      positive: Callable[[Callable[[str], Any]], Callable[[str], Any]],
                      nonnegative: Callable[[Callable[[str], Any]], Callable[[str], Any]]) -> None:
    """``--trace``, ``--timeline`` and their bounds, on ``profile``'s parser (``positive`` and
    ``nonnegative``: the parser's types for numbers > 0 and >= 0)."""
    g = p.add_argument_group("timeline")
    g.add_argument("--trace", metavar="FILE", type=file_path,
                   help="write a timeline of every batch through every stage as Chrome Trace "
                   "Event JSON (FILE.json.gz: compressed); open it in ui.perfetto.dev or "
                   "chrome://tracing")
    g.add_argument("--timeline", metavar="PNG", type=file_path,
                   help="draw the first seconds of the timeline as a Gantt chart per track, "
                   "stalls marked (needs matplotlib)")
    g.add_argument("--timeline-seconds", type=positive(float), metavar="S",
                   help="seconds of the run the picture shows (1.0)")
    g.add_argument("--timeline-start", type=nonnegative(float), metavar="S",
                   help="where the picture starts, in seconds from the start (0: worker "
                   "start-up included)")
    g.add_argument("--stall-ms", type=nonnegative(float), metavar="MS",
                   help="a wait of the loop this long or longer is a stall in the picture (1)")
    g.add_argument("--trace-last", type=positive(int), metavar="N",
                   help="keep only the last N batches in the trace (a long run)")


#: The picture's options (None: not given) and their defaults; each needs ``--timeline``.
_PICTURE = {"timeline_seconds": 1.0, "timeline_start": 0.0, "stall_ms": 1.0}


def _check_trace_options(args: argparse.Namespace) -> None:
    """An option that shapes a recording nobody asked for is a usage error, not ignored."""
    given = [name for name in _PICTURE if getattr(args, name) is not None]
    if given and not args.timeline:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{flags} shape{'s' if len(given) == 1 else ''} the picture: add "
                         "--timeline FILE.png, or leave "
                         f"{'it' if len(given) == 1 else 'them'} out")
    if args.trace_last is not None and not (args.trace or args.timeline):
        raise UsageError("--trace-last bounds a recording: add --trace FILE (or --timeline "
                         "FILE.png), or leave it out")
    for name, default in _PICTURE.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def cmd_profile_traced(args: argparse.Namespace) -> int:
    """``cmd_profile``, recorded when ``--trace`` or ``--timeline`` is given."""
    _check_trace_options(args)
    if not (args.trace or args.timeline):
        return cmd_profile(args)
    from .._tools.gantt import require_matplotlib
    from .._tools.trace import trace

    if args.timeline:
        require_matplotlib()  # fail before the run, not after
    with trace(args.trace, last_batches=args.trace_last) as recording:
        code = cmd_profile(args)
    if args.trace:
        print(f"wrote {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.timeline:
        recording.plot(args.timeline, seconds=args.timeline_seconds,
                       start_s=args.timeline_start, stall_ms=args.stall_ms)
        print(f"wrote {args.timeline}")
    return code
