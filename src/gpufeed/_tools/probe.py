"""System reads: those of ``gpufeed doctor``, one small function each, held by a :class:`Probe`
(tests replace them), and the GPUs it finds (nvidia-smi, else sysfs, else torch); /dev/shm use;
the PSS of a process tree, whole and by kind (``_tools/measure.py`` says what the kinds hold),
and the shared memory it holds open but maps nowhere."""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from .._base.system import cpu_affinity, cpu_quota, rollup
from .._memory.heap import left_alone

_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, FileNotFoundError)


def helper_pids() -> set[int]:
    """Pids of this process's multiprocessing helpers: its resource tracker (started on first
    use by a spawn or forkserver context or a ``shared_memory`` segment, and kept to the end)
    and a forkserver. Neither is a worker; neither exits on its own."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)}
    return {p for p in pids if p}


def descendants(root: psutil.Process | None = None) -> list[psutil.Process]:
    """Live descendants of ``root`` (default: this process), less :func:`helper_pids` and
    torch's shared-memory manager: the processes a loader or a benchmark started. Empty when
    ``root`` is gone."""
    root = root or psutil.Process()
    try:
        kids = root.children(recursive=True)
    except _GONE:
        return []
    helpers = helper_pids()
    return [p for p in kids if p.pid not in helpers and not _is_torch_shm_manager(p)]


def _is_torch_shm_manager(proc: psutil.Process) -> bool:
    """torch's shared-memory manager: started once by the ``file_system`` sharing strategy and
    kept to the end, like multiprocessing's helpers; no worker either."""
    try:
        return proc.name() == "torch_shm_manager"
    except _GONE:
        return False


def shm_usage() -> tuple[int, int] | None:
    """(total, free) bytes of /dev/shm, None where it cannot be read."""
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return None
    return usage.total, usage.free


def _memory() -> tuple[int, int]:
    vm = psutil.virtual_memory()
    return vm.total, vm.available


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _list_dir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _nvidia_smi(args: list[str]) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _cuda_names() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


@dataclass(frozen=True)
class Probe:
    """The system reads the doctor makes, one function each (replace any of them in tests)."""

    shm: Callable[[], tuple[int, int] | None] = shm_usage  # (total, free) bytes, None if absent
    nofile: Callable[[], tuple[int, int]] = field(
        default=lambda: resource.getrlimit(resource.RLIMIT_NOFILE))  # (soft, hard)
    memlock: Callable[[], tuple[int, int]] = field(
        default=lambda: resource.getrlimit(resource.RLIMIT_MEMLOCK))  # (soft, hard), -1 = inf
    cpu_count: Callable[[], int | None] = os.cpu_count
    affinity: Callable[[], set[int] | None] = cpu_affinity
    cpu_quota: Callable[[], float | None] = cpu_quota
    memory: Callable[[], tuple[int, int]] = _memory  # (total, available) bytes
    read_text: Callable[[str], str | None] = _read_text  # for /sys files
    list_dir: Callable[[str], list[str]] = _list_dir
    nvidia_smi: Callable[[list[str]], str | None] = _nvidia_smi  # stdout, None if unavailable
    cuda_names: Callable[[], list[str]] = _cuda_names  # torch's view, when the above find none
    worker_heap: Callable[[], str | None] = left_alone  # why workers leave malloc alone, or None


@dataclass(frozen=True)
class GpuInfo:
    """A GPU as the doctor sees it; PCIe figures are None when unknown."""

    index: int
    name: str
    bus_id: str  # sysfs form, e.g. "0000:17:00.0"
    gen: int | None = None
    max_gen: int | None = None
    width: int | None = None
    max_width: int | None = None
    numa_node: int | None = None


_SMI_FIELDS = ("index,name,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,"
               "pcie.link.width.current,pcie.link.width.max")
_GTS_TO_GEN = {"2.5": 1, "5": 2, "8": 3, "16": 4, "32": 5, "64": 6}


def _int(text: str | None) -> int | None:
    try:
        return int(str(text).strip())
    except ValueError:
        return None


def cpulist(text: str | None) -> set[int]:
    """Parse a sysfs CPU list such as "0-3,8,10-11"."""
    cpus: set[int] = set()
    for part in (text or "").strip().split(","):
        lo, _, hi = part.partition("-")
        if lo.strip().isdigit():
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def query_gpus(probe: Probe) -> list[GpuInfo]:
    """GPUs from nvidia-smi, else from /sys/bus/pci (NVIDIA display controllers)."""
    gpus = []
    out = probe.nvidia_smi([f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"])
    for line in (out or "").strip().splitlines():
        f = [c.strip() for c in line.split(",")]
        if len(f) != 7:
            continue
        dom, _, rest = f[2].lower().partition(":")
        bus_id = f"{dom[-4:]}:{rest}"
        gpus.append(GpuInfo(_int(f[0]) or 0, f[1], bus_id, _int(f[3]), _int(f[4]), _int(f[5]),
                            _int(f[6])))
    if out is None:
        root = "/sys/bus/pci/devices"
        for dev in probe.list_dir(root):
            base = f"{root}/{dev}"
            cls = (probe.read_text(f"{base}/class") or "").strip()
            if (probe.read_text(f"{base}/vendor") or "").strip() != "0x10de" or not (
                    cls.startswith(("0x0300", "0x0302"))):
                continue

            def gen(name: str, base: str = base) -> int | None:
                return _GTS_TO_GEN.get((probe.read_text(f"{base}/{name}") or "").split(" ")[0]
                                       .removesuffix(".0"))

            width = _int(probe.read_text(f"{base}/current_link_width"))
            max_width = _int(probe.read_text(f"{base}/max_link_width"))
            device = (probe.read_text(f"{base}/device") or "?").strip()
            gpus.append(GpuInfo(len(gpus), f"NVIDIA device {device}", dev,
                                gen("current_link_speed"), gen("max_link_speed"), width, max_width))
    if not gpus:  # e.g. no nvidia-smi in a container without /sys: names only
        gpus = [GpuInfo(i, name, "") for i, name in enumerate(probe.cuda_names())]
    return [replace(g, numa_node=None if not g.bus_id else
                    _int(probe.read_text(f"/sys/bus/pci/devices/{g.bus_id}/numa_node")))
            for g in gpus]


@dataclass(frozen=True)
class TreeMemory:
    """PSS of a process tree in bytes, whole and by kind (see ``_tools/measure.py``).

    Attributes:
        pss: the sum over the tree of each process's PSS.
        anon, file, shmem: its ``Pss_Anon``, ``Pss_File`` and ``Pss_Shmem`` parts (0 where the
            kernel has no ``smaps_rollup`` split: before Linux 5.9, or not Linux).
        unmapped: :func:`unmapped_shared_bytes` of the tree, when asked for (else 0; 0 where
            ``/proc`` is missing).
    """

    pss: int
    anon: int = 0
    file: int = 0
    shmem: int = 0
    unmapped: int = 0

    @property
    def held(self) -> int:
        """``pss + unmapped``: what the tree holds, shared memory that no process of it maps
        (in no PSS) included."""
        return self.pss + self.unmapped


def _psutil_pss(proc: psutil.Process) -> int:
    pss = getattr(proc.memory_full_info(), "pss", None)
    if pss is None:
        raise RuntimeError(
            "psutil reports no PSS on this platform; measure with sample_memory=False "
            "(PSS is available on Linux)"
        )
    return int(pss)


def process_tree_memory(pid: int | None = None, *, unmapped: bool = False) -> TreeMemory:
    """PSS of process ``pid`` (default: this one) plus its :func:`descendants`, whole and by
    kind, from ``/proc/<pid>/smaps_rollup`` (psutil's ``memory_full_info().pss`` where that is
    missing: no split then). Processes that exit while being read are skipped. Raises
    ``RuntimeError`` where the platform has no PSS (psutil exposes it on Linux only)."""
    root = psutil.Process(pid)
    tree = [root, *descendants(root)]
    total = {"pss": 0, "anon": 0, "file": 0, "shmem": 0}
    for proc in tree:
        fields = rollup(proc.pid)
        if fields is None:
            try:
                fields = {"pss": _psutil_pss(proc)}
            except _GONE:
                continue
        for name, value in fields.items():
            total[name] += value
    return TreeMemory(**total, unmapped=unmapped_shared_bytes([p.pid for p in tree])
                      if unmapped else 0)


def _shared_file(target: str) -> bool:
    """Whether a descriptor's link names shared memory: a memfd or a file on /dev/shm
    (``shm_open``, torch's ``file_descriptor`` sharing), unlinked or not."""
    return target.startswith(("/memfd:", "/dev/shm/"))


def unmapped_shared_bytes(pids: list[int]) -> int:
    """Bytes of shared memory (memfds, /dev/shm files) that processes ``pids`` hold open by a
    file descriptor while none of them maps the file: real memory that is in no PSS (the stock
    loader's queued batches, see ``_tools/measure.py``).

    Counted by pages allocated (``st_blocks``), each file once; a file any of ``pids`` maps is
    left out whole (its mapped pages are in the PSS of whoever maps them). Processes that exit
    while being read are skipped; 0 without ``/proc``."""
    held: dict[tuple[int, int], int] = {}
    for pid in pids:
        fds = f"/proc/{pid}/fd"
        for name in _list_dir(fds):
            path = f"{fds}/{name}"
            try:
                if not _shared_file(os.readlink(path)):
                    continue
                st = os.stat(path)
            except OSError:  # closed meanwhile
                continue
            held[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    # A maps line is "start-end perms offset MAJOR:MINOR INODE   path", the device in hex. One
    # scan per device and process finds the inodes mapped; a search per file is slower and holds
    # the GIL (docs/how-it-works/measurements/tools.md#mapped-shared-memory).
    devices = {dev: re.compile(rf" {os.major(dev):02x}:{os.minor(dev):02x} (\d+) ")
               for dev, _ in held}
    mapped: set[tuple[int, int]] = set()
    for pid in pids if held else ():
        maps = _read_text(f"/proc/{pid}/maps") or ""
        for dev, pattern in devices.items():
            mapped.update((dev, int(ino)) for ino in pattern.findall(maps))
    return sum(size for key, size in held.items() if key not in mapped)


def process_tree_pss(pid: int | None = None) -> int:
    """``process_tree_memory(pid).pss``: the PSS in bytes of a process tree."""
    return process_tree_memory(pid).pss
