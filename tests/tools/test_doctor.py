import dataclasses
import math
import re

import pytest

from gpufeed._tools.doctor import (
    DoctorReport,
    Finding,
    GpuInfo,
    Probe,
    Workload,
    cpulist,
    diagnose,
    fds_needed,
    query_gpus,
)

GiB = 1 << 30

SYS = {
    "/sys/bus/pci/devices/0000:17:00.0/numa_node": "1\n",
    "/sys/devices/system/node/node1/cpulist": "8-15\n",
}


def healthy(**overrides):
    """A probe of a machine with nothing wrong; override one read at a time."""
    base = Probe(shm=lambda: (16 * GiB, 15 * GiB), nofile=lambda: (65536, 65536),
                 memlock=lambda: (-1, -1), cpu_count=lambda: 16,
                 affinity=lambda: set(range(16)), cpu_quota=lambda: None,
                 memory=lambda: (64 * GiB, 48 * GiB), read_text=SYS.get,
                 list_dir=lambda path: [], nvidia_smi=lambda args: None,
                 cuda_names=lambda: [], worker_heap=lambda: None)
    return dataclasses.replace(base, **overrides)


def by_name(report):
    return {f.name: f for f in report.findings}


def test_healthy_machine_is_all_ok():
    report = diagnose(probe=healthy())
    assert "15.0 GiB free of 16.0 GiB" in by_name(report)["/dev/shm"].value
    assert report.exit_code == 0
    assert all(f.status == "ok" for f in report.findings), report
    assert by_name(report)["GPU"].value == "none found (CPU only)"
    assert "nothing here will break a data loader" in str(report)


@pytest.mark.parametrize(("free", "status"), [(0.5 * GiB, "warn"), (2 * GiB, "warn"),
                                              (8 * GiB, "ok")])
def test_shm_thresholds_and_advice(free, status):
    report = diagnose(probe=healthy(shm=lambda: (int(free), int(free))))
    f = by_name(report)["/dev/shm"]
    assert f.status == status
    assert report.exit_code == (1 if status == "fail" else 0)
    if status != "ok":
        assert "--shm-size=8g" in f.advice
        assert "not /dev/shm" in f.advice  # gpufeed's own batches do not need it


def test_shm_advice_names_a_size_that_covers_the_need():
    probe = healthy(shm=lambda: (16 * GiB, 15 * GiB))  # 1 GiB in use
    work = Workload(num_workers=16, batch_bytes=954 << 20)
    in_flight = 16 * 2 * (954 << 20)
    f = by_name(diagnose(probe=probe, workload=work))["/dev/shm"]
    assert f.status == "warn" and "batches in flight: 29.8 GiB" in f.value
    docker = re.search(r"--shm-size=(\d+)g", f.advice)
    mount = re.search(r"remount,size=(\d+)G /dev/shm", f.advice)
    assert docker and mount, f.advice
    # what is in use, plus the free space the check asks for: the batches in flight and the
    # two the loop holds
    need = in_flight + 2 * (954 << 20)
    assert int(docker.group(1)) == int(mount.group(1)) == math.ceil((GiB + need) / GiB)
    missing = by_name(diagnose(probe=healthy(shm=lambda: None), workload=work))["/dev/shm"]
    assert f"--shm-size={math.ceil(need / GiB)}g" in missing.advice


def test_shm_advice_says_what_its_size_is_made_of():
    """The issue's case: 64 workers, 512 MiB batches, prefetch 2. It showed 64.0 GiB in flight
    and asked for 128.0 GiB and --shm-size=129g without a word of why; the stock loader holds
    at most the 128 batches in flight plus the 2 the loop holds, and the advice says so."""
    probe = healthy(shm=lambda: (16 * GiB, 16 * GiB - (8 << 20)))  # 8 MiB in use
    work = Workload(num_workers=64, batch_bytes=512 << 20)
    f = by_name(diagnose(probe=probe, workload=work))["/dev/shm"]
    assert "batches in flight: 64.0 GiB" in f.value
    assert ("give it 65.0 GiB free (64.0 GiB of batches in flight plus 1.0 GiB for the 2 your "
            "loop holds): docker run --shm-size=66g (8.0 MiB in use now plus those, in whole "
            "GiB)") in f.advice, f.advice
    assert "remount,size=66G" in f.advice
    assert "size=8G" in by_name(diagnose(probe=healthy(shm=lambda: None)))["/dev/shm"].advice


def test_missing_shm_fails():
    f = by_name(diagnose(probe=healthy(shm=lambda: None)))["/dev/shm"]
    assert f.status == "fail" and f.value == "missing"


@pytest.mark.parametrize(("limits", "workers", "status", "advice"), [
    ((1024, 1048576), 200, "fail", "ulimit -n 65536"),   # 200 workers need more than 1024
    ((1024, 2048), 200, "fail", "raise the hard limit (2,048) first"),
    ((1024, 1048576), 2, "warn", "batches your loop keeps"),  # under the 4096 floor
    ((8192, 1048576), 2, "ok", ""),
    ((20000, 20000), 2, "ok", ""),        # the case: no warning with 2 workers
    ((20000, 1048576), 1000, "warn", "ulimit -n 65536"),  # 1000 workers: 4x need > 20000
])
def test_nofile_is_judged_against_the_workers(limits, workers, status, advice):
    report = diagnose(probe=healthy(nofile=lambda: limits),
                      workload=Workload(num_workers=workers))
    f = by_name(report)["ulimit -n"]
    assert f.status == status and advice in f.advice, f
    assert f"need about {fds_needed(workers, 2):,}" in f.value
    assert report.exit_code == (1 if status == "fail" else 0)


def test_fds_needed_grows_with_workers_and_prefetch():
    assert fds_needed(0, 2) < fds_needed(2, 2) < fds_needed(2, 8) < fds_needed(8, 8)


def test_worker_heap_says_whether_workers_follow_their_batches_and_why_not():
    follows = by_name(diagnose(probe=healthy()))["worker heap"]
    assert follows.status == "ok" and "raised to each worker's batches" in follows.value
    kept = diagnose(probe=healthy(worker_heap=lambda: "MALLOC_TRIM_THRESHOLD_ is set"))
    f = by_name(kept)["worker heap"]
    assert f.status == "ok" and f.value == "left as it is: MALLOC_TRIM_THRESHOLD_ is set"
    for work in (Workload(num_workers=0), Workload(worker_type="thread")):  # the user's heap
        assert "worker heap" not in by_name(diagnose(probe=healthy(), workload=work))


def test_memlock_only_where_pinning_is_used():
    low = healthy(memlock=lambda: (65536, 65536))
    assert "RLIMIT_MEMLOCK" not in by_name(diagnose(probe=low))  # no CUDA: no pinning
    assert "RLIMIT_MEMLOCK" not in by_name(diagnose(
        probe=dataclasses.replace(low, cuda_names=lambda: ["GPU"]),
        workload=Workload(pin_memory=False)))
    report = diagnose(probe=dataclasses.replace(low, cuda_names=lambda: ["GPU"]))
    f = by_name(report)["RLIMIT_MEMLOCK"]
    assert f.status == "warn" and "ulimit -l unlimited" in f.advice
    assert f.value == "soft 64.0 KiB, hard 64.0 KiB"  # human units, not raw bytes
    assert report.exit_code == 0
    pinned = diagnose(probe=healthy(), workload=Workload(pin_memory=True))
    assert by_name(pinned)["RLIMIT_MEMLOCK"].value == "soft unlimited, hard unlimited"


def test_shm_only_for_process_workers_and_against_the_batches_in_flight():
    probe = healthy(shm=lambda: (8 * GiB, 3 * GiB))
    assert by_name(diagnose(probe=probe))["/dev/shm"].status == "warn"  # < 4 GiB, unknown size
    for work in (Workload(num_workers=0), Workload(worker_type="thread")):
        assert "/dev/shm" not in by_name(diagnose(probe=probe, workload=work))
    small = Workload(num_workers=4, batch_bytes=64 << 20)  # 4 x 2 x 64 MiB = 512 MiB
    f = by_name(diagnose(probe=probe, workload=small))["/dev/shm"]
    assert f.status == "ok" and "batches in flight: 512.0 MiB" in f.value
    big = Workload(num_workers=16, batch_bytes=128 << 20)  # 4 GiB in flight > 3 GiB free
    assert by_name(diagnose(probe=probe, workload=big))["/dev/shm"].status == "warn"


def test_cpu_affinity_and_quota():
    f = by_name(diagnose(probe=healthy(affinity=lambda: {0, 1, 2, 3})))["CPUs"]
    assert f.status == "warn" and "num_workers <= 4" in f.advice
    f = by_name(diagnose(probe=healthy(cpu_quota=lambda: 2.5)))["CPUs"]
    assert f.status == "warn" and "quota 2.5" in f.value and "num_workers <= 2" in f.advice
    f = by_name(diagnose(probe=healthy(cpu_count=lambda: 1, affinity=lambda: {0})))["CPUs"]
    assert f.status == "warn" and "one CPU" in f.advice
    f = by_name(diagnose(probe=healthy(), workload=Workload(num_workers=32)))["CPUs"]
    assert f.status == "warn" and "num_workers=32 > 16 usable CPUs" in f.advice


def test_every_finding_that_is_not_ok_says_what_to_run():
    sick = healthy(shm=lambda: (GiB, GiB // 2), nofile=lambda: (256, 256),
                   memlock=lambda: (0, 0), affinity=lambda: {0}, cuda_names=lambda: ["GPU"],
                   memory=lambda: (2 * GiB, GiB // 2))
    report = diagnose(probe=sick, workload=Workload(num_workers=4))
    bad = [f for f in report.findings if f.status != "ok"]
    assert {f.name for f in bad} >= {"/dev/shm", "ulimit -n", "RLIMIT_MEMLOCK", "CPUs",
                                     "free memory"}
    commands = ("docker run", "ulimit", "taskset", "mount", "gpufeed tune", "numactl")
    for f in bad:
        assert any(c in f.advice for c in commands), f
    assert "B free" in report.findings[0].value and "bytes" not in str(report)


@pytest.mark.parametrize(("available", "status"), [(0.5 * GiB, "fail"), (3 * GiB, "warn")])
def test_free_memory(available, status):
    f = by_name(diagnose(probe=healthy(memory=lambda: (8 * GiB, int(available)))))["free memory"]
    assert f.status == status


SMI = ("0, NVIDIA H100 80GB HBM3, 00000000:17:00.0, 5, 5, 16, 16\n"
       "1, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 4, 5, 8, 16\n")


def test_gpus_from_nvidia_smi_with_pcie_and_numa():
    report = diagnose(probe=healthy(nvidia_smi=lambda args: SMI,
                                    affinity=lambda: set(range(16))))
    f = by_name(report)
    assert f["GPU 0 PCIe"].status == "ok"
    assert f["GPU 0 PCIe"].value.startswith("NVIDIA H100 80GB HBM3, PCIe gen 5/5, x16/x16")
    assert f["GPU 1 PCIe"].status == "warn" and "x8 of x16" in f["GPU 1 PCIe"].advice
    # GPU 0 sits on node 1 (CPUs 8-15) but the process may run on 0-15
    assert f["GPU 0 NUMA"].status == "warn"
    assert "numactl --cpunodebind=1 --membind=1" in f["GPU 0 NUMA"].advice
    assert f["GPU 1 NUMA"].value == "no NUMA node reported"
    assert report.exit_code == 0  # slow links are warnings, not breakage
    bound = diagnose(probe=healthy(nvidia_smi=lambda args: SMI, affinity=lambda: {8, 9}))
    assert by_name(bound)["GPU 0 NUMA"].status == "ok"


def test_gen_below_max_alone_is_a_warning_about_idle_downshift():
    smi = "0, A100, 00000000:17:00.0, 1, 4, 16, 16\n"
    f = by_name(diagnose(probe=healthy(nvidia_smi=lambda args: smi)))["GPU 0 PCIe"]
    assert f.status == "warn" and "re-check under load" in f.advice


def test_gpus_from_sysfs_without_nvidia_smi():
    dev = "/sys/bus/pci/devices/0000:3b:00.0"
    files = {f"{dev}/vendor": "0x10de\n", f"{dev}/class": "0x030200\n", f"{dev}/device": "0x2330",
             f"{dev}/current_link_speed": "16.0 GT/s PCIe\n",
             f"{dev}/max_link_speed": "32.0 GT/s PCIe\n",
             f"{dev}/current_link_width": "16\n", f"{dev}/max_link_width": "16\n",
             f"{dev}/numa_node": "0\n", "/sys/bus/pci/devices/0000:00:01.0/vendor": "0x8086\n"}
    probe = healthy(read_text=files.get,
                    list_dir=lambda path: ["0000:00:01.0", "0000:3b:00.0"])
    (gpu,) = query_gpus(probe)
    assert gpu == GpuInfo(0, "NVIDIA device 0x2330", "0000:3b:00.0", 4, 5, 16, 16, 0)


def test_gpu_names_from_torch_when_nothing_else_answers():
    f = by_name(diagnose(probe=healthy(cuda_names=lambda: ["Some GPU"])))
    assert f["GPU 0 PCIe"].value == "Some GPU, PCIe gen ?/?, x?/x?"
    assert f["GPU 0 PCIe"].status == "ok" and f["GPU 0 NUMA"].status == "ok"


def test_cpulist_parsing():
    assert cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpulist("") == set() and cpulist(None) == set()


def test_report_renders_and_serialises():
    report = DoctorReport((Finding("a", "ok", "1"), Finding("b", "fail", "2", "do x")))
    text = str(report)
    assert "FAIL" in text and "- b: do x" in text and "1 problem(s)" in text
    assert report.to_dict()["exit_code"] == 1
    assert report.to_dict()["findings"][1] == {"name": "b", "status": "fail", "value": "2",
                                               "advice": "do x"}


def test_real_machine_runs():
    report = diagnose()
    assert {"/dev/shm", "ulimit -n", "CPUs", "free memory"} <= set(by_name(report))
    assert report.exit_code in (0, 1)
