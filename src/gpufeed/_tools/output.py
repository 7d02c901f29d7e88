"""Where the tools' results go: JSON to a file or to stdout (``-``), plots to real paths.

``-`` means stdout, as for most command-line tools: ``gpufeed doctor --json - | jq .`` gets
nothing but the JSON on stdout (:func:`json_output`). A plot is an image, so ``-`` is refused
there with the fix (:func:`file_path`), instead of writing a file literally named ``-``. Plots
are drawn with matplotlib's object API (no pyplot, no change of the global backend).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: the file name that means stdout
STDOUT = "-"


def is_stdout(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is ``-`` (stdout)."""
    return path is not None and os.fspath(path) == STDOUT


def write_json(path: str | os.PathLike[str], doc: Any, *, stdout: Any = None) -> None:
    """Write ``doc`` as indented JSON to ``path``, or to ``stdout`` (default ``sys.stdout``)
    when ``path`` is ``-``. Values JSON cannot hold are written as their ``str``."""
    text = json.dumps(doc, indent=2, default=str) + "\n"
    if is_stdout(path):
        out = stdout if stdout is not None else sys.stdout
        out.write(text)
        out.flush()
    else:
        Path(path).write_text(text)


@contextlib.contextmanager
def json_output(path: str | os.PathLike[str] | None) -> Iterator[Callable[[Any], None]]:
    """Yield ``emit(doc)``, which writes ``doc`` where ``--json path`` says.

    ``path`` None: ``emit`` does nothing. A file: ``emit`` writes it and prints
    ``wrote PATH``. ``-``: ``emit`` writes to stdout, and everything else printed to stdout
    inside the block goes to stderr, so stdout carries the JSON alone.
    """
    stdout = sys.stdout

    def emit(doc: Any) -> None:
        if path is None:
            return
        write_json(path, doc, stdout=stdout)
        if not is_stdout(path):
            print(f"wrote {os.fspath(path)}")

    if is_stdout(path):
        with contextlib.redirect_stdout(sys.stderr):
            yield emit
    else:
        yield emit


def file_path(text: str) -> str:
    """An ``argparse`` type for options that write one file that is not text (``--plot``):
    ``-`` is refused, naming the fix."""
    if text == STDOUT:
        raise argparse.ArgumentTypeError(
            "'-' (stdout) cannot take this file (an image or a trace); give a file name")
    return output_path(text)


def output_path(text: str) -> str:
    """An ``argparse`` type for a file a command writes (``--json FILE``; ``-``: stdout):
    its folder must exist, checked before the run rather than after it."""
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(text)))
    if text != STDOUT and not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(
            f"folder {folder!r} of {text!r} does not exist; create it first (mkdir -p)")
    return text


def require_matplotlib(what: str = "plots", option: str = "--plot") -> Any:
    """``matplotlib.figure.Figure``, or an ImportError that says how to install it."""
    try:
        import matplotlib.figure
    except ImportError as exc:
        raise ImportError(f"{what} need matplotlib: pip install 'gpufeed[plot]' "
                          f"(or leave out {option})") from exc
    return matplotlib.figure.Figure
