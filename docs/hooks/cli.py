"""mkdocs hook: the command-line reference is the ``--help`` of gpufeed's own argparse parsers.

``docs/reference/cli.md`` holds the marker ``<!-- gpufeed-cli-help -->``; at build time it is
replaced by the help of ``gpufeed`` and of each subcommand, formatted at 96 columns, so the page
shows exactly what the installed command accepts and cannot drift from it. The checkout's
``src/`` comes first on ``sys.path``, so the docs describe the code next to them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

MARKER = "<!-- gpufeed-cli-help -->"


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    from gpufeed._cli.main import _parser

    root = _parser()
    out = [("gpufeed", root)]
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += [(f"gpufeed {name}", sub) for name, sub in action.choices.items()]
    return out


def cli_reference() -> str:
    """Markdown: one section per command, its ``--help`` in a text block."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "96"
    try:
        parts = []
        for name, parser in _parsers():
            parts.append(f"## `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
        return "\n".join(parts)
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def on_config(config: Any, **kwargs: Any) -> Any:
    src = str(Path(config.config_file_path).resolve().parent / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return config


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_reference())
    return markdown
