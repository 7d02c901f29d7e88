"""Deadlines that turn a hang into an exception, and Python subprocesses that can import
the test support package."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parents[1]
SRC_DIR = TESTS_DIR.parent / "src"



class HangError(Exception):
    """The code under test did not answer within its deadline."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`HangError` in the main thread if the block runs past ``seconds``."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise HangError(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def timer() -> Iterator[Callable[[], float]]:
    t0 = time.monotonic()
    yield lambda: time.monotonic() - t0


# -- subprocesses ------------------------------------------------------------------------------


def script_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS_DIR), str(SRC_DIR), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    return env


def run_script(code: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=script_env(), capture_output=True, text=True,
        timeout=timeout, check=False,
    )


def run_in_session(args: list[str], cwd: Path, timeout: float, **env: str
                   ) -> subprocess.CompletedProcess[str]:
    """``args`` in ``cwd`` on the CPU with ``src`` and ``tests`` importable (and ``env`` added),
    in a session of its own, so that a timeout kills every process it started too, then
    raises :class:`HangError` with the end of its stderr."""
    full_env = {**script_env(), **env}
    full_env.pop("CUDA_VISIBLE_DEVICES", None)
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=full_env, cwd=cwd, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise HangError(f"did not finish in {timeout} s:\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def spawn_script(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-u", "-c", code], env=script_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )




def ctrl_c(proc: subprocess.Popen[str], timeout: float = 15.0) -> tuple[str, float]:
    """Send SIGINT to a script started by :func:`spawn_script` and wait for it to end:
    ``(stderr, seconds it took)``. A script still running after ``timeout`` is killed (and
    ``subprocess.TimeoutExpired`` raised)."""
    try:
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=timeout)
        return err, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
