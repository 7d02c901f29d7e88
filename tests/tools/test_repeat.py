import pytest

from gpufeed._tools import repeat as _repeat
from gpufeed._tools.repeat import LoadMonitor, MachineLoad, Spread, min_runs_to_stop


def test_spread_median_range_and_overlap():
    a = Spread((100.0, 90.0, 110.0, 105.0, 95.0))
    assert (a.median, a.lo, a.hi) == (100.0, 90.0, 110.0)
    assert a.rel_spread == pytest.approx(0.2)
    b = Spread((108.0, 120.0, 130.0))
    c = Spread((111.0, 120.0))
    assert a.overlaps(b) and b.overlaps(a) and not a.overlaps(c)
    r = c.ratio(a)  # faster halves: (120,) over (100, 105, 110)
    assert r.mid == pytest.approx(120 / 105) and r.lo <= r.mid <= r.hi
    assert a.to_dict()["runs"] == list(a.runs)
    # c has two runs: too few to tell, whatever its interval
    assert c.ratio(a).verdict == "cannot tell"
    assert "2 runs of a row: a verdict needs 7" in c.ratio(a).why


def test_the_verdict_follows_the_95_percent_interval_of_the_ratio():
    """The issue's case: a threefold gain whose rows' ranges overlap because one run of each
    was slowed by the machine. The old min-max range read "3.10x (0.86-10.04)" and called it
    "same within noise"; the interval of the ratio says faster, and why."""
    stock = Spread((100.0, 104.0, 97.0, 33.0, 101.0, 99.0, 103.0))
    ours = Spread((310.0, 295.0, 305.0, 320.0, 89.0, 300.0, 315.0))
    assert ours.overlaps(stock)  # what made the old verdict "same within noise"
    r = ours.ratio(stock)
    assert 2.8 < r.lo <= r.mid <= r.hi < 3.4, r
    assert r.verdict == "faster"
    assert r.why == "the 95% interval lies above 1x"
    assert stock.ratio(ours).verdict == "slower" and "lies below 1x" in stock.ratio(ours).why
    # the same rate measured twice: the interval holds 1x, and says so
    again = Spread((102.0, 98.0, 100.0, 35.0, 99.0, 104.0, 97.0))
    same = again.ratio(stock)
    assert same.lo < 1.0 < same.hi and same.verdict == "cannot tell"
    assert same.why.endswith("holds 1x")
    # seeded: the same runs give the same interval; the JSON says what the interval is
    assert ours.ratio(stock) == r
    assert r.to_dict() == {"ratio": r.mid, "ratio_lo": r.lo, "ratio_hi": r.hi,
                           "interval": "95% bootstrap", "verdict": "faster", "why": r.why}


def test_a_ratio_is_taken_between_the_faster_halves():
    """Interference only slows runs down: runs slowed on one side, even in most rounds, leave
    the ratio of the undisturbed runs (2x here). The median of per-round ratios gave 3.3x."""
    stock = Spread((60.0, 60.0, 60.0, 100.0, 100.0))  # slowed in three rounds of five
    gpufeed = Spread((200.0, 200.0, 200.0, 200.0, 200.0))
    assert gpufeed.ratio(stock).mid == pytest.approx(2.0)
    assert stock.ratio(gpufeed).mid == pytest.approx(0.5)
    assert gpufeed.median / stock.median == pytest.approx(200 / 60)
    # and a slow patch that hits both sides of some rounds leaves it alone too
    stock = Spread((100.0, 100.0, 50.0, 50.0, 100.0))
    gpufeed = Spread((220.0, 200.0, 100.0, 90.0, 180.0))
    assert gpufeed.ratio(stock).mid == pytest.approx(2.0)
    assert Spread((5.0, 1.0, 3.0)).ratio(Spread((1.0,))).mid == 4.0  # the faster ceil(n / 2)
    none = Spread(()).ratio(stock)
    assert (none.mid, none.lo, none.hi) == (0.0, 0.0, 0.0)  # nothing measured: no ratio


@pytest.mark.parametrize(("runs", "done"), [
    ((100.0, 101.0), False),               # fewer than MIN_RUNS
    ((100.0, 101.0, 102.0), True),         # 3 runs agreeing within 5%
    ((100.0, 130.0, 80.0), False),         # 3 runs far apart: go on
    ((100.0, 130.0, 80.0, 90.0, 95.0), True),  # the limit of 5 runs
])
def test_runs_stop_at_five_or_when_the_spread_is_small(runs, done):
    assert Spread(runs).done(5, 0.05) is done


def test_many_runs_need_a_third_of_them_in_agreement_to_stop_early():
    """Three lucky runs of a noisy row must not end it when 21 were asked for."""
    lucky = (100.0, 101.0, 102.0)
    assert not Spread(lucky).done(21, 0.05)
    assert not Spread(lucky + (101.0,) * 3).done(21, 0.05)
    assert Spread(lucky + (101.0,) * 4).done(21, 0.05)  # 7 runs within 5%
    assert not Spread(lucky + (101.0,) * 3 + (70.0,)).done(21, 0.05)  # 7, far apart
    assert [min_runs_to_stop(n) for n in (1, 5, 9, 21)] == [3, 3, 3, 7]


@pytest.mark.parametrize(("other", "steal", "busy"), [
    (0.02, 0.0, False), (0.3, 0.0, True), (0.02, 0.06, True), (0.5, None, True),
    (0.5, 0.0, False),  # 0.5 of 16 CPUs is under the 10% share on a large machine
])
def test_busy_thresholds(other, steal, busy):
    cpus = 16 if other == 0.5 and steal == 0.0 else 2
    load = MachineLoad(10.0, cpus, other, steal)
    assert load.busy is busy
    assert load.summary.startswith("machine busy" if busy else "machine quiet")
    assert load.to_dict()["busy"] is busy


def test_monitor_counts_other_processes_not_ours(monkeypatch):
    # Fabricated clocks: in 2 s the machine was busy 3 CPU-s, 0.2 of it stolen; our tree used
    # 1 CPU-s, so other processes used 2 CPU-s = 1 CPU on average.
    stats = iter([(100.0, 1.0, 400.0), (103.0, 1.2, 404.0)])
    ours = iter([10.0, 11.0])
    clock = iter([0.0, 2.0])
    monkeypatch.setattr(_repeat, "_proc_stat", lambda: next(stats))
    monkeypatch.setattr(_repeat, "_tree_cpu_s", lambda: next(ours))
    monkeypatch.setattr(_repeat.time, "perf_counter", lambda: next(clock))
    load = LoadMonitor(cpus=2).stop()
    assert load.other_cpus == pytest.approx(1.0)
    assert load.steal_share == pytest.approx(0.05)
    assert load.busy


def test_monitor_on_this_machine_reads_real_counters():
    load = LoadMonitor().stop()
    assert load.other_cpus >= 0 and load.cpus >= 1
    assert load.steal_share is None or 0 <= load.steal_share <= 1
