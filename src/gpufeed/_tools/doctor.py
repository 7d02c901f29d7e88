"""Doctor: checks the machine for limits that break or slow a data loader, and says what to change.

Every system read goes through one small function held by a :class:`Probe`; tests replace them.
Limits are judged against the :class:`Workload` the loader will run (``gpufeed doctor
--workers N --prefetch-factor P --pin-memory --batch-bytes SIZE``; by default one worker per
usable CPU, prefetch 2, pinning where CUDA is available): a check that does not apply to it is
not printed, and every finding names the command that fixes it.

Thresholds (``fail`` makes ``gpufeed doctor`` exit 1, ``warn`` does not):

=================  =====================================  =======================================
check              fail                                   warn
=================  =====================================  =======================================
/dev/shm           missing (multiprocessing's locks and   free < the batches in flight plus the
(process workers)  torch's tensor sharing live there)     2 the loop holds (or < 4 GiB without
                                                          --batch-bytes; :func:`shm_need`): only
                                                          tensors gpufeed's ring cannot hold, and
                                                          the stock loader, pass through it
ulimit -n (soft)   < the fds the workload needs (see      < 4x that, or < 4096: batches the loop
                   :func:`fds_needed`)                    keeps hold fds too (stock loader)
RLIMIT_MEMLOCK     never (CUDA pinning mostly ignores it) < 64 MiB and not unlimited (RDMA,
(pinning only)                                            mlock); not checked without pinning
CPUs               never                                  fewer usable than online (affinity or
                                                          cgroup quota), fewer than 2 usable, or
                                                          more workers than usable CPUs
free memory        < 1 GiB available (or < the batches    < 4 GiB available (or < twice that)
                   in flight)
worker heap        never                                  never: whether process workers raise
(process workers)                                         malloc's thresholds (NOTE [ Worker heap ])
GPU PCIe link      never                                  width or generation below the maximum
GPU NUMA node      never                                  this process may run on CPUs outside it
=================  =====================================  =======================================
"""

from __future__ import annotations

import resource
from dataclasses import asdict, dataclass
from typing import Any, Literal

from .._base.stats import format_table, human_bytes
from .._host.config import WorkerType
from .probe import GpuInfo, Probe, cpulist, query_gpus

Status = Literal["ok", "warn", "fail"]
GiB = 1 << 30
MiB = 1 << 20
SHM_WARN_FREE = 4 * GiB
#: the smallest /dev/shm size the advice names (Docker's default is 64 MiB)
SHM_ASK_MIN_GIB = 8
NOFILE_FLOOR = 4096
NOFILE_ASK = 65536
#: fds of a Python process with torch loaded, its libraries and a few data files open
FDS_BASE = 256
#: fds per worker besides its batches: pipes or sockets, event fds, the ring's memfd
FDS_PER_WORKER = 8
#: tensors per batch assumed for fd counting (inputs, targets, a few extras)
LEAVES_PER_BATCH = 4
MEMLOCK_WARN = 64 * MiB
MEM_FAIL_AVAILABLE = 1 * GiB
MEM_WARN_AVAILABLE = 4 * GiB


@dataclass(frozen=True)
class Workload:
    """What the loader will do; the doctor judges limits against it.

    Fields:
        num_workers: worker processes or threads (None: one per usable CPU).
        prefetch_factor: batches in flight per worker (2, as the stock default).
        pin_memory: whether batches are pinned (None: where CUDA is available).
        batch_bytes: bytes of one batch (None: unknown; fixed thresholds are used then).
        worker_type: "process" (batches cross /dev/shm) or "thread" (they do not).
    """

    num_workers: int | None = None
    prefetch_factor: int = 2
    pin_memory: bool | None = None
    batch_bytes: int | None = None
    worker_type: WorkerType = "process"


def fds_needed(num_workers: int, prefetch_factor: int) -> int:
    """File descriptors a loader needs open at once: ``FDS_BASE`` for the process, then per
    worker its pipes and ``prefetch_factor`` batches in flight of ``LEAVES_PER_BATCH``
    tensors, each holding an fd while it crosses processes (the stock loader's
    ``file_descriptor`` sharing; gpufeed's ring needs fewer)."""
    return FDS_BASE + num_workers * (FDS_PER_WORKER + prefetch_factor * LEAVES_PER_BATCH)


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


def _limit(n: int, size: bool = False) -> str:
    if n == resource.RLIM_INFINITY or n < 0:
        return "unlimited"
    return human_bytes(n) if size else f"{n:,}"


def shm_size_gib(need: int) -> int:
    """The /dev/shm size to ask for, in whole GiB: ``need`` bytes rounded up, at least
    ``SHM_ASK_MIN_GIB`` (Docker's ``--shm-size=Ng`` and tmpfs's ``size=NG`` count GiB)."""
    return max(SHM_ASK_MIN_GIB, -(-need // GiB))


#: batches of the stock loader in /dev/shm besides those in flight: the one the loop uses and
#: the one ``next()`` hands over meanwhile (a ``for`` loop's variable holds the last)
SHM_HELD_BATCHES = 2


def shm_need(in_flight: int, batch_bytes: int) -> int:
    """Free /dev/shm the stock loader's batches need, in bytes: each batch a worker sends is
    a /dev/shm file until the loop drops it, so at most ``num_workers * prefetch_factor``
    batches in flight (``in_flight`` bytes; a batch being collated is one of them) plus
    ``SHM_HELD_BATCHES`` the loop holds."""
    return in_flight + SHM_HELD_BATCHES * batch_bytes


def check_shm(probe: Probe, in_flight: int | None = None,
              batch_bytes: int | None = None) -> Finding:
    """The size advised covers what is in use now plus the free space :func:`shm_need` asks
    for, and says both parts."""
    usage = probe.shm()
    warn_at = (SHM_WARN_FREE if in_flight is None
               else shm_need(in_flight, batch_bytes if batch_bytes is not None else 0))
    need = ("" if in_flight is None else
            f" ({human_bytes(in_flight)} of batches in flight plus "
            f"{human_bytes(warn_at - in_flight)} for the {SHM_HELD_BATCHES} your loop holds)")
    if usage is None:
        size = shm_size_gib(warn_at)
        return Finding("/dev/shm", "fail", "missing",
                       f"mount a tmpfs at /dev/shm (mount -t tmpfs -o size={size}G tmpfs "
                       f"/dev/shm){need}; in Docker: docker run --shm-size={size}g (or "
                       "--ipc=host)")
    total, free = usage
    value = f"{human_bytes(free)} free of {human_bytes(total)}"
    if in_flight is not None:
        value += f" (batches in flight: {human_bytes(in_flight)})"
    size = shm_size_gib(total - free + warn_at)
    in_use = (f" ({human_bytes(total - free)} in use now plus those, in whole GiB)"
              if total - free > 0 else "")
    advice = ("gpufeed's process workers pass batches through memory files of their own "
              "(memfd), not /dev/shm; tensors its ring cannot hold (nested, sparse, quantized, "
              "subclasses) and the stock torch DataLoader go through /dev/shm: for those, give "
              f"it {human_bytes(warn_at)} free{need}: docker run --shm-size={size}g{in_use} "
              f"(or --ipc=host); on a host: sudo mount -o remount,size={size}G /dev/shm; or use "
              "worker_type='thread'")
    # A warning at most: only those batches need the room (see NOTE [ Spill ] in _memory/spill.py).
    if free < warn_at:
        return Finding("/dev/shm", "warn", value, advice)
    return Finding("/dev/shm", "ok", value)


def check_nofile(probe: Probe, num_workers: int, prefetch_factor: int) -> Finding:
    soft, hard = probe.nofile()
    need = fds_needed(num_workers, prefetch_factor)
    value = (f"soft {_limit(soft)}, hard {_limit(hard)}; {num_workers} workers x prefetch "
             f"{prefetch_factor} need about {need:,}")
    want = max(4 * need, NOFILE_FLOOR)
    if 0 <= soft < want:
        ask = max(NOFILE_ASK, want)
        how = (f"ulimit -n {ask}" if hard < 0 or hard >= ask else
               f"raise the hard limit ({hard:,}) first: docker run --ulimit nofile={ask}:{ask} "
               f"or /etc/security/limits.conf, then ulimit -n {ask}")
        why = ("below what the workers need: \"too many open files\"" if soft < need else
               "little room for batches your loop keeps (each shared tensor holds an fd)")
        return Finding("ulimit -n", "fail" if soft < need else "warn", value, f"{why}: {how}")
    return Finding("ulimit -n", "ok", value)


def check_memlock(probe: Probe) -> Finding:
    soft, hard = probe.memlock()
    value = f"soft {_limit(soft, True)}, hard {_limit(hard, True)}"
    if 0 <= soft < MEMLOCK_WARN:
        return Finding("RLIMIT_MEMLOCK", "warn", value,
                       "mlock, RDMA (GPUDirect, InfiniBand) and, with some drivers, CUDA "
                       "pinning count against it: ulimit -l unlimited, or docker run "
                       "--ulimit memlock=-1")
    return Finding("RLIMIT_MEMLOCK", "ok", value)


def check_heap(probe: Probe) -> Finding:
    """Information only: process workers' malloc (NOTE [ Worker heap ] in _memory/heap.py)."""
    why = probe.worker_heap()
    return Finding("worker heap", "ok", "glibc: thresholds raised to each worker's batches"
                   if why is None else f"left as it is: {why}")


def check_cpus(probe: Probe, num_workers: int | None = None) -> Finding:
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
                       f"{max(1, int(usable))} or widen them: taskset -c 0-{online - 1} "
                       "python train.py (affinity), docker run --cpus (quota)")
    if num_workers is not None and num_workers > usable:
        return Finding("CPUs", "warn", value,
                       f"num_workers={num_workers} > {usable:g} usable CPUs: process workers "
                       "share the cores and slow each other; run gpufeed tune to size them")
    if usable < 2:
        return Finding("CPUs", "warn", value, "one CPU: worker processes cannot run in "
                       "parallel with the training loop; use num_workers=0 or threads")
    return Finding("CPUs", "ok", value)


def check_memory(probe: Probe, in_flight: int | None = None) -> Finding:
    total, available = probe.memory()
    value = f"{human_bytes(available)} available of {human_bytes(total)}"
    fail_at, warn_at = ((MEM_FAIL_AVAILABLE, MEM_WARN_AVAILABLE) if in_flight is None
                        else (max(in_flight, MEM_FAIL_AVAILABLE), 2 * in_flight))
    if in_flight is not None:
        value += f" (batches in flight: {human_bytes(in_flight)})"
    advice = ("the loader needs room for prefetched batches per worker: stop other programs "
              "(ps aux --sort=-rss | head), lower num_workers or prefetch_factor, or use "
              "worker_type='thread'; gpufeed tune --budget-memory SIZE finds what fits")
    status: Status = "fail" if available < fail_at else "warn" if available < warn_at else "ok"
    return Finding("free memory", status, value, advice if status != "ok" else "")


def check_gpu(gpu: GpuInfo, probe: Probe) -> list[Finding]:
    name = f"GPU {gpu.index}"
    link = (f"{gpu.name}, PCIe gen {gpu.gen or '?'}/{gpu.max_gen or '?'}, "
            f"x{gpu.width or '?'}/x{gpu.max_width or '?'}")
    advice = ""
    if gpu.width and gpu.max_width and gpu.width < gpu.max_width:
        advice = (f"the link runs at x{gpu.width} of x{gpu.max_width}: host-to-device copies "
                  "are slower; reseat the card or use a full-width slot")
    elif gpu.gen and gpu.max_gen and gpu.gen < gpu.max_gen:
        advice = ("the link runs below its top generation; idle GPUs step down, so re-check "
                  "under load (nvidia-smi -q -d PCI) before changing anything")
    pcie = Finding(f"{name} PCIe", "warn" if advice else "ok", link, advice)
    if gpu.numa_node is None or gpu.numa_node < 0:
        return [pcie, Finding(f"{name} NUMA", "ok", "no NUMA node reported")]
    node_cpus = cpulist(probe.read_text(f"/sys/devices/system/node/node{gpu.numa_node}/cpulist"))
    affinity = probe.affinity()
    value = f"node {gpu.numa_node}"
    if node_cpus and affinity and not affinity <= node_cpus:
        return [pcie, Finding(f"{name} NUMA", "warn", value,
                              f"this process may run on CPUs outside the GPU's node; bind it: "
                              f"numactl --cpunodebind={gpu.numa_node} "
                              f"--membind={gpu.numa_node}")]
    return [pcie, Finding(f"{name} NUMA", "ok", value)]


def diagnose(*, probe: Probe | None = None, workload: Workload | None = None) -> DoctorReport:
    """Run the checks that apply to ``workload`` (default: :class:`Workload`'s defaults) on
    this machine (or on the fakes in ``probe``)."""
    probe = probe or Probe()
    work = workload or Workload()
    affinity = probe.affinity()
    usable = len(affinity) if affinity else (probe.cpu_count() or 1)
    workers = usable if work.num_workers is None else work.num_workers
    in_flight = (None if work.batch_bytes is None
                 else max(workers, 1) * work.prefetch_factor * work.batch_bytes)
    findings = []
    if workers and work.worker_type == "process":
        findings += [check_shm(probe, in_flight, work.batch_bytes), check_heap(probe)]
    findings.append(check_nofile(probe, workers, work.prefetch_factor))
    gpus = query_gpus(probe)
    pinning = work.pin_memory if work.pin_memory is not None else bool(gpus)
    if pinning:
        findings.append(check_memlock(probe))
    findings += [check_cpus(probe, work.num_workers), check_memory(probe, in_flight)]
    if not gpus:
        findings.append(Finding("GPU", "ok", "none found (CPU only)"))
    for gpu in gpus:
        findings.extend(check_gpu(gpu, probe))
    return DoctorReport(tuple(findings))
