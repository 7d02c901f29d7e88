import time

import pytest
import torch

from gpufeed._tools.profiler import Profiler, ProfileReport, _CudaGaps, profile


def slow_source(n, data_s, spent=None):
    for i in range(n):
        t0 = time.perf_counter()
        time.sleep(data_s)
        if spent is not None:
            spent.append(time.perf_counter() - t0)
        yield i


def timed_sleep(seconds, spent):
    def step(_):
        t0 = time.perf_counter()
        time.sleep(seconds)
        spent.append(time.perf_counter() - t0)
    return step


@pytest.mark.parametrize(("data_s", "compute_s"), [(0.01, 0.02), (0.004, 0.03)])
def test_input_bound_within_5_points_of_truth(data_s, compute_s):
    # The truth is constructed by the loop itself: the time its source and its step really
    # slept (a loaded machine oversleeps), first step (warm-up) left out as the profiler does.
    data, compute = [], []
    report = profile(slow_source(25, data_s, data), timed_sleep(compute_s, compute))
    truth = sum(data[1:]) / (sum(data[1:]) + sum(compute[1:]))
    assert report.steps == 24  # the first step is warm-up
    assert abs(report.input_bound - truth) < 0.05
    assert abs(report.input_bound - data_s / (data_s + compute_s)) < 0.1  # nominal, loosely
    assert report.wait_p50_s >= data_s and report.compute_p50_s >= compute_s
    assert report.gpu_idle_s is None or torch.cuda.is_available()


def test_wraps_the_stock_dataloader_and_reports_startup():
    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            time.sleep(0.02)
            return torch.tensor([i])

    # 40 ms of data and 40 ms of step per batch: a one-off stall (a GC pass, CPU steal) must
    # pass 100 ms to move the share out of its +-0.1 over these 5 steps
    loader = torch.utils.data.DataLoader(Slow(), batch_size=2)
    with Profiler(cuda=False) as prof:
        seen = [batch for batch in prof.wrap(loader) if time.sleep(0.04) is None]
    rep = prof.report()
    assert len(seen) == 6 and rep.steps == 5
    assert rep.startup_s > 0.039
    assert abs(rep.input_bound - 0.5) < 0.1
    text = str(rep)
    assert "input-bound:" in text and "verdict" in text


def test_max_steps_and_break_out_of_loop():
    rep = profile(range(100), lambda _: None, max_steps=10, cuda=False)
    assert rep.steps == 9
    with Profiler(cuda=False) as prof:
        for i in prof.wrap(range(100)):
            if i == 5:
                break
    assert prof.report().steps == 5  # the step that broke out is closed by __exit__


def test_no_steps_measured_is_reported_not_raised(caplog):
    rep = profile([1], lambda _: None, cuda=False)
    assert rep.steps == 0 and rep.input_bound == 0.0
    assert "no steps measured" in rep.verdict
    assert "measured no steps" in caplog.text


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"warmup_steps.*0"):
        Profiler(warmup_steps=0)
    with pytest.raises(ValueError, match=r"max_steps.*-1"):
        Profiler(max_steps=-1)
    with pytest.raises(TypeError, match="step must be callable"):
        profile([1], 3)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda=True"):
            Profiler(cuda=True)


class FakeEvent:
    """A CUDA event whose GPU clock is the host clock: the GPU is idle whenever we wait."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_gpu_idle_time_from_event_pairs():
    synced = []
    gaps = _CudaGaps(event_factory=FakeEvent, synchronize=lambda: synced.append(1))
    with Profiler(_cuda_gaps=gaps) as prof:
        for _ in prof.wrap(slow_source(8, 0.01)):
            time.sleep(0.01)
    rep = prof.report()
    assert synced
    assert rep.gpu_idle_s == pytest.approx(rep.wait_s, abs=0.005)
    assert rep.gpu_idle_fraction == pytest.approx(0.5, abs=0.1)
    assert "GPU idle" in str(rep)
    assert isinstance(rep, ProfileReport) and rep.to_dict()["steps"] == 7


@pytest.mark.cuda
def test_gpu_idle_on_a_real_device():
    x = torch.randn(1024, 1024, device="cuda")
    rep = profile(slow_source(6, 0.01), lambda _: x @ x, cuda=True)
    assert rep.gpu_idle_s is not None and rep.gpu_idle_s >= 0
