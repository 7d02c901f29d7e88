"""Date, machine and versions, recorded with every benchmark result file."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def environment() -> dict[str, Any]:
    """Date, machine and versions, recorded with every result file."""
    cpu_model = platform.processor() or None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu_model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), cpu_model)
    commit = _git("rev-parse", "HEAD")
    # The installed distribution's version, else the package's own (run from a checkout):
    # gpufeed's __init__ has run by now, since this module is inside it.
    gpufeed = _version("gpufeed") or getattr(sys.modules.get("gpufeed"), "__version__", None)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(), "platform": platform.platform(),
        "cpu_model": cpu_model, "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": psutil.virtual_memory().total, "loadavg_start": list(os.getloadavg()),
        "python": platform.python_version(), "torch": torch.__version__,
        "numpy": np.__version__, "gpufeed": gpufeed, "torchdata": _version("torchdata"),
        "pillow": _version("Pillow"), "git_commit": commit,
        "git_dirty": bool(_git("status", "--porcelain")) if commit else None,
        "torch_threads_main": torch.get_num_threads(),
    }
