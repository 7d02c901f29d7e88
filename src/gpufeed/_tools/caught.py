"""What the loaders of a tool's trials warn about, said once, in the tool's words.

``gpufeed tune`` builds a loader per run of every trial, and a loader warns once in its life, so
a dataset that draws from a global random generator in thread workers would print a long
``RandomStateWarning`` per thread-worker run, attributed to ``_tools/measure.py``, above the
table the tool exists to show. :class:`TrialWarnings` catches those around each trial, lets
every other warning through, and says each kind once, attributed to the dataset's own source,
with the trials that saw it; the tool puts the same words in its JSON. Measurements:
docs/how-it-works/measurements/tools.md#one-warning-per-tool.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .._order.sample_rng import RandomStateWarning

__all__ = ["TrialWarnings"]

_DREW = re.compile(r"drew from (.+?) global random generator")


@dataclass
class TrialWarnings:
    """The ``RandomStateWarning``\\ s of a tool's trials, kept to be said once.

    Fields:
        tool: the tool's name, as its output starts ("gpufeed tune").
        generators: the global generators the dataset was seen drawing from ("torch's", ...).
        trials: the trials (their keyword arguments, as text) in which it was seen.
    """

    tool: str
    generators: list[str] = field(default_factory=list)
    trials: list[str] = field(default_factory=list)

    @contextmanager
    def trial(self, what: str) -> Iterator[None]:
        """Catch the random-state warnings of one trial (``what``: its keyword arguments);
        show any other warning after it as it would have been (an ``error`` filter raises)."""
        with warnings.catch_warnings(record=True) as caught:
            try:
                yield
            finally:
                others = []
                for w in caught:
                    if issubclass(w.category, RandomStateWarning) and "thread workers" in str(
                            w.message):
                        self._saw(str(w.message), what)
                    else:
                        others.append(w)
        for w in others:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)

    def _saw(self, text: str, what: str) -> None:
        found = _DREW.search(text)
        names = found.group(1) if found else "a"
        for name in re.split(r", (?:and )?", names):
            if name not in self.generators:
                self.generators.append(name)
        if what not in self.trials:
            self.trials.append(what)

    @property
    def message(self) -> str | None:
        """The one warning, in the tool's words; None when no trial saw a draw."""
        if not self.trials:
            return None
        names = ", ".join(self.generators)
        n = len(self.trials)
        listed = "; ".join(self.trials[:3]) + ("; ..." if n > 3 else "")
        return (f"{self.tool}: your dataset draws from {names} global random generator, seen "
                f"in {n} thread-worker trial{'s' if n != 1 else ''} ({listed}). "
                "Thread workers share that generator, so under them its draws are not "
                "reproducible and differ from the stock loader's; the speed figures stand. Draw "
                "from gpufeed.random.sample_generator() (seeded per sample), or use "
                "worker_type='process'.")

    def to_list(self) -> list[dict[str, Any]]:
        """JSON-ready: one entry per warning said."""
        text = self.message
        if text is None:
            return []
        return [{"category": "RandomStateWarning", "message": text,
                 "generators": list(self.generators), "trials": list(self.trials)}]

    def report(self, dataset: Any, stacklevel: int = 2) -> None:
        """Warn once (``RandomStateWarning``), attributed to ``dataset``'s ``__getitem__`` (or
        its class) where its source is known, else to the caller ``stacklevel`` frames up."""
        text = self.message
        if text is None:
            return
        where = _source_of(dataset)
        if where is None:
            warnings.warn(text, RandomStateWarning, stacklevel=stacklevel + 1)
            return
        filename, lineno, module = where
        warnings.warn_explicit(text, RandomStateWarning, filename, lineno, module=module,
                               registry={})


def _source_of(dataset: Any) -> tuple[str, int, str] | None:
    """(file, line, module) of the dataset's ``__getitem__`` (its ``__iter__`` for an iterable
    one, else its class), or None where Python cannot tell (a built-in, a class made in C)."""
    cls = type(dataset)
    for target in (getattr(cls, "__getitem__", None), getattr(cls, "__iter__", None), cls):
        try:
            fn = inspect.unwrap(target) if target is not None else None
            if fn is None:
                continue
            filename = inspect.getsourcefile(fn)
            _, lineno = inspect.getsourcelines(fn)
        except (OSError, TypeError):
            continue
        if filename and "/torch/" not in filename:
            return filename, max(lineno, 1), cls.__module__
    return None
