"""Doctor: checks the machine for limits that break or slow a data loader, and says what to change.

Every system read goes through one small function held by a :class:`Probe`; tests replace them.

Thresholds (``fail`` makes ``gpufeed doctor`` exit 1, ``warn`` does not):

=================  =====================================  =======================================
check              fail                                   warn
=================  =====================================  =======================================
/dev/shm           missing, or < 1 GiB free (workers      < 4 GiB free
                   pass batches through it: "bus error")
ulimit -n (soft)   < 4096 (shared tensors hold one fd     < 65536
                   each: "too many open files")
RLIMIT_MEMLOCK     never (CUDA pinning mostly ignores it) < 64 MiB and not unlimited (RDMA, mlock)
CPUs               never                                  fewer usable than online (affinity or
                                                          cgroup quota), or fewer than 2 usable
free memory        < 1 GiB available                      < 4 GiB available
GPU PCIe link      never                                  width or generation below the maximum
GPU NUMA node      never                                  this process may run on CPUs outside it
=================  =====================================  =======================================
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._stats import format_table

__all__ = ["DoctorReport", "Finding", "GpuInfo", "Probe", "diagnose"]

Status = Literal["ok", "warn", "fail"]
GiB = 1 << 30
MiB = 1 << 20
SHM_FAIL_FREE = 1 * GiB
SHM_WARN_FREE = 4 * GiB
NOFILE_FAIL = 4096
NOFILE_WARN = 65536
MEMLOCK_WARN = 64 * MiB
MEM_FAIL_AVAILABLE = 1 * GiB
MEM_WARN_AVAILABLE = 4 * GiB


@dataclass(frozen=True)
class Finding:
    """One check: ``status`` "ok", "warn" or "fail"; ``advice`` what to change ("" when ok)."""

    name: str
    status: Status
    value: str
    advice: str = ""


@dataclass(frozen=True)
class DoctorReport:
    """All findings; ``exit_code`` is 1 when any of them would break a typical loader."""

    findings: tuple[Finding, ...]

    @property
    def exit_code(self) -> int:
        return 1 if any(f.status == "fail" for f in self.findings) else 0

    def to_dict(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "findings": [asdict(f) for f in self.findings]}

    def __str__(self) -> str:
        rows = [[f.name, f.status.upper(), f.value] for f in self.findings]
        lines = ["gpufeed doctor", format_table(["check", "status", "value"], rows, left=3)]
        advice = [f"- {f.name}: {f.advice}" for f in self.findings if f.advice]
        if advice:
            lines += ["", "what to change:", *advice]
        fails = sum(f.status == "fail" for f in self.findings)
        lines.append(f"{fails} problem(s) that will break a data loader" if fails
                     else "nothing here will break a data loader")
        return "\n".join(lines)


def _shm_usage() -> tuple[int, int] | None:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return None
    return usage.total, usage.free


def _cpu_quota() -> float | None:
    """CPUs allowed by the cgroup v2 quota (``cpu.max``), None when unlimited or unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _affinity() -> set[int] | None:
    getter = getattr(os, "sched_getaffinity", None)
    return set(getter(0)) if getter is not None else None


def _memory() -> tuple[int, int]:
    import psutil

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

    shm: Callable[[], tuple[int, int] | None] = _shm_usage  # (total, free) bytes, None if absent
    nofile: Callable[[], tuple[int, int]] = field(
        default=lambda: resource.getrlimit(resource.RLIMIT_NOFILE))  # (soft, hard)
    memlock: Callable[[], tuple[int, int]] = field(
        default=lambda: resource.getrlimit(resource.RLIMIT_MEMLOCK))  # (soft, hard), -1 = inf
    cpu_count: Callable[[], int | None] = os.cpu_count
    affinity: Callable[[], set[int] | None] = _affinity
    cpu_quota: Callable[[], float | None] = _cpu_quota
    memory: Callable[[], tuple[int, int]] = _memory  # (total, available) bytes
    read_text: Callable[[str], str | None] = _read_text  # for /sys files
    list_dir: Callable[[str], list[str]] = _list_dir
    nvidia_smi: Callable[[list[str]], str | None] = _nvidia_smi  # stdout, None if unavailable
    cuda_names: Callable[[], list[str]] = _cuda_names  # torch's view, when the above find none


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
    return [GpuInfo(g.index, g.name, g.bus_id, g.gen, g.max_gen, g.width, g.max_width,
                    _int(probe.read_text(f"/sys/bus/pci/devices/{g.bus_id}/numa_node"))
                    if g.bus_id else None)
            for g in gpus]


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _limit(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY or n < 0 else str(n)


def check_shm(probe: Probe) -> Finding:
    usage = probe.shm()
    if usage is None:
        return Finding("/dev/shm", "fail", "missing",
                       "mount a tmpfs at /dev/shm; in Docker: docker run --shm-size=8g "
                       "(or --ipc=host)")
    total, free = usage
    value = f"{_gib(free)} free of {_gib(total)}"
    advice = ("worker processes pass batches through /dev/shm; give it more room: "
              "docker run --shm-size=8g (or --ipc=host); on a host: "
              "mount -o remount,size=8G /dev/shm; or use worker_type='thread'")
    if free < SHM_FAIL_FREE:
        return Finding("/dev/shm", "fail", value, advice)
    if free < SHM_WARN_FREE:
        return Finding("/dev/shm", "warn", value, advice)
    return Finding("/dev/shm", "ok", value)


def check_nofile(probe: Probe) -> Finding:
    soft, hard = probe.nofile()
    value = f"soft {_limit(soft)}, hard {_limit(hard)}"
    if 0 <= soft < NOFILE_WARN:
        how = (f"ulimit -n {NOFILE_WARN}" if hard < 0 or hard >= NOFILE_WARN else
               f"raise the hard limit ({hard}) first: docker run --ulimit nofile=65536:65536 "
               f"or /etc/security/limits.conf, then ulimit -n {NOFILE_WARN}")
        advice = f"shared tensors hold a file descriptor each: {how}"
        return Finding("ulimit -n", "fail" if soft < NOFILE_FAIL else "warn", value, advice)
    return Finding("ulimit -n", "ok", value)


def check_memlock(probe: Probe) -> Finding:
    soft, hard = probe.memlock()
    value = f"soft {_limit(soft)}, hard {_limit(hard)}"
    if 0 <= soft < MEMLOCK_WARN:
        return Finding("RLIMIT_MEMLOCK", "warn", value,
                       "mlock, RDMA (GPUDirect, InfiniBand) and, with some drivers, CUDA "
                       "pinning count against it: ulimit -l unlimited, or docker run "
                       "--ulimit memlock=-1")
    return Finding("RLIMIT_MEMLOCK", "ok", value)


def check_cpus(probe: Probe) -> Finding:
    online = probe.cpu_count() or 1
    affinity = probe.affinity()
    usable = float(len(affinity)) if affinity else float(online)
    quota = probe.cpu_quota()
    if quota is not None:
        usable = min(usable, quota)
    why = ([f"affinity {len(affinity)}"] if affinity else []) + (
        [f"cgroup quota {quota:g}"] if quota is not None else [])
    value = f"{online} online, {usable:g} usable" + (f" ({', '.join(why)})" if why else "")
    if usable < online:
        return Finding("CPUs", "warn", value,
                       f"this process may use {usable:g} CPUs: keep num_workers <= "
                       f"{max(1, int(usable))} or widen the affinity (taskset, docker run --cpus)")
    if usable < 2:
        return Finding("CPUs", "warn", value, "one CPU: worker processes cannot run in "
                       "parallel with the training loop; use num_workers=0 or threads")
    return Finding("CPUs", "ok", value)


def check_memory(probe: Probe) -> Finding:
    total, available = probe.memory()
    value = f"{_gib(available)} available of {_gib(total)}"
    advice = ("the loader needs room for prefetched batches per worker: free memory, lower "
              "num_workers or prefetch_factor, or use worker_type='thread'")
    if available < MEM_FAIL_AVAILABLE:
        return Finding("free memory", "fail", value, advice)
    if available < MEM_WARN_AVAILABLE:
        return Finding("free memory", "warn", value, advice)
    return Finding("free memory", "ok", value)


def check_gpu(gpu: GpuInfo, probe: Probe) -> list[Finding]:
    name = f"GPU {gpu.index}"
    link = (f"PCIe gen {gpu.gen or '?'}/{gpu.max_gen or '?'}, "
            f"x{gpu.width or '?'}/x{gpu.max_width or '?'}")
    out = []
    if gpu.width and gpu.max_width and gpu.width < gpu.max_width:
        out.append(Finding(f"{name} PCIe", "warn", link,
                           f"the link runs at x{gpu.width} of x{gpu.max_width}: host-to-device "
                           "copies are slower; reseat the card or use a full-width slot"))
    elif gpu.gen and gpu.max_gen and gpu.gen < gpu.max_gen:
        out.append(Finding(f"{name} PCIe", "warn", link,
                           "the link runs below its top generation; idle GPUs step down, so "
                           "re-check under load (nvidia-smi -q -d PCI) before changing anything"))
    else:
        out.append(Finding(f"{name} PCIe", "ok", link))
    out[0] = Finding(out[0].name, out[0].status, f"{gpu.name}, {out[0].value}", out[0].advice)
    if gpu.numa_node is None or gpu.numa_node < 0:
        out.append(Finding(f"{name} NUMA", "ok", "no NUMA node reported"))
        return out
    node_cpus = cpulist(probe.read_text(f"/sys/devices/system/node/node{gpu.numa_node}/cpulist"))
    affinity = probe.affinity()
    value = f"node {gpu.numa_node}"
    if node_cpus and affinity and not affinity <= node_cpus:
        out.append(Finding(f"{name} NUMA", "warn", value,
                           f"this process may run on CPUs outside the GPU's node; bind it: "
                           f"numactl --cpunodebind={gpu.numa_node} --membind={gpu.numa_node}"))
    else:
        out.append(Finding(f"{name} NUMA", "ok", value))
    return out


def diagnose(*, probe: Probe | None = None) -> DoctorReport:
    """Run every check on this machine (or on the fakes in ``probe``)."""
    probe = probe or Probe()
    findings = [check_shm(probe), check_nofile(probe), check_memlock(probe), check_cpus(probe),
                check_memory(probe)]
    gpus = query_gpus(probe)
    if not gpus:
        findings.append(Finding("GPU", "ok", "none found (CPU only)"))
    for gpu in gpus:
        findings.extend(check_gpu(gpu, probe))
    return DoctorReport(tuple(findings))
