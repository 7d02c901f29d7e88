"""Release fences under garbage collection and interruption (NOTE [ Slot lifetime ], NOTE
[ Registered memory lifetime ]), on the simulated CUDA runtime.

A batch's slot release may run inside any allocation of any code on the same thread: a
collection finalizes a pinned batch caught in a reference cycle, and its release adds a fence.
Nothing that allocates may therefore hold a lock that the release path takes. And a wait that
is interrupted (Ctrl-C at an epoch end) must leave memory registered and the handle ready to
try again. The first test and the interrupted unregister failed on the code before them.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from gpufeed._base.cuda import Fences
from gpufeed._memory import pinning as _pinning
from gpufeed._memory.region import PAGE
from gpufeed._memory.ring import SlotRing
from support.procs import deadline
from support.release_checks import InterruptOnce
from support.sim_cuda import SimCuda


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    with deadline(60):
        yield


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimCuda]:
    sim = SimCuda(0, max_steps=2)
    sim.install(monkeypatch)
    yield sim
    sim.stop_background()


class CollectingLock:
    """A lock that runs a full collection as soon as it is taken: whatever the critical
    section would allocate, a collection inside it is forced."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock

    def __enter__(self) -> bool:
        got = self.lock.__enter__()
        gc.collect()
        return bool(got)

    def __exit__(self, *exc: object) -> None:
        self.lock.__exit__(*exc)

    def acquire(self, *args: Any, **kw: Any) -> bool:
        got = self.lock.acquire(*args, **kw)
        gc.collect()
        return bool(got)

    def release(self) -> None:
        self.lock.release()


class CollectingList(list):
    """``retain``'s argument: a full collection while ``retain`` reads it."""

    def __iter__(self) -> Any:
        gc.collect()
        return super().__iter__()


def collect_inside_locks(obj: Any) -> None:
    """Replace every lock held in ``obj``'s attributes by a :class:`CollectingLock`."""
    kinds = (type(threading.Lock()), type(threading.RLock()))
    names = [*getattr(obj, "__dict__", {}), *getattr(type(obj), "__slots__", ())]
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, kinds):
            setattr(obj, name, CollectingLock(value))


def pinned_ring(sim: SimCuda) -> SlotRing:
    ring = SlotRing(reserve=1 << 22, budget=None, shared=False, pin=True, slots_hint=8)
    ring.learn(PAGE)
    return ring


def batch_in_a_cycle(ring: SlotRing) -> int:
    """Lease a pinned slot and leave its batch in a garbage cycle: only a collection frees it."""
    acquired = ring.acquire()
    assert acquired is not None
    sid = acquired[0]
    base = ring.lease(sid, PAGE)
    cycle: list[Any] = [base]
    cycle.append(cycle)
    return sid


def run_bounded(fn: Callable[[], Any], seconds: float = 10.0) -> None:
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it does not return."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"deadlock: {fn} did not return in {seconds} s"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("section", ["done", "retain", "wait"])
def test_a_collection_inside_a_fences_section_cannot_deadlock(sim: SimCuda, section: str) -> None:
    """A collection forced inside each of ``Fences``' sections finalizes a pinned batch whose
    release adds a fence to the ring's ``Fences``: it must neither deadlock nor lose the slot.
    ``retain`` is walked on a device stage's ``Fences`` (the only kind it is for: no
    finalizer adds to it), the others on the ring's own."""
    gc.collect()
    ring = pinned_ring(sim)
    sid = batch_in_a_cycle(ring)
    fences = ring._fences if section != "retain" else Fences()
    fences.add(sim.record_on(sim.consumer), None)  # some work for the section
    collect_inside_locks(fences)
    collect_inside_locks(ring._fences)
    call: dict[str, Callable[[], Any]] = {
        "done": fences.done, "retain": lambda: fences.retain(CollectingList()),
        "wait": fences.wait,
    }
    sim.collect_at = {"query", "synchronize"}  # and at each event the section looks at
    run_bounded(call[section])
    sim.collect_at = set()
    gc.collect()  # where the section had nothing to collect inside (no lock, no event)
    sim.drain()
    ring._collect_released()
    ring._unfence()
    held = set(ring._free) | {p for p in ring._fences.done() if p is not None}
    assert sid in held or sid in ring._free, "the slot released by the collection was lost"
    ring.close()


@pytest.mark.parametrize("where", ["query", "synchronize"])
def test_releases_run_by_a_collection_inside_a_query_or_wait_are_kept(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Collections forced at every event query (``done``) and wait (``wait``): each one
    releases a batch, whose fence lands in the ``Fences`` being walked. None is lost, and
    ``wait`` returns only once every fence it could see has completed."""
    sim = SimCuda(3, max_steps=1, collect_at={where})
    sim.install(monkeypatch)
    ring = pinned_ring(sim)
    sids = [batch_in_a_cycle(ring) for _ in range(6)]
    fences = ring._fences
    fences.add(sim.record_on(sim.consumer), None)
    seen = [entry[0] for entry in fences._entries.values()]
    run_bounded(fences.done if where == "query" else fences.wait)
    assert sim.collections >= 1
    if where == "synchronize":
        assert all(e.done for e in seen), "wait() returned before a fence it saw completed"
    sim.drain()
    freed: set[int] = set()
    for _ in range(len(sids) + 1):  # until every release has shown up
        ring._collect_released()
        freed |= {p for p in ring._fences.done() if p is not None}
        gc.collect()
    assert set(sids) <= freed | set(ring._free), (sids, freed, ring._free)
    ring.close()


# -- an interrupted unregister ------------------------------------------------------------------
def test_an_interrupted_unregister_leaves_the_memory_registered_and_can_retry(
    sim: SimCuda,
) -> None:
    """Ctrl-C lands in unregister's wait for pending copies (the epoch-end wait): the memory
    stays registered, counted and mapped, the handle stays active, and unregistering again
    completes; the address can then be registered again (no error 712)."""
    t = torch.zeros(PAGE, dtype=torch.uint8)
    fences = Fences()
    handle = _pinning.register(t, device=0, fences=fences)
    assert handle is not None and _pinning.registered_bytes() == PAGE
    fences.add(InterruptOnce(), None)
    with pytest.raises(KeyboardInterrupt):
        _pinning.unregister(handle)
    assert handle.active, "an interrupted unregister marked the handle released"
    assert _pinning.registered_bytes() == PAGE
    assert t.data_ptr() in sim.registered
    _pinning.unregister(handle)
    assert not handle.active and _pinning.registered_bytes() == 0 and sim.registered == {}
    again = _pinning.register(t, device=0)
    assert again is not None
    _pinning.unregister(again)


def test_an_interrupted_device_stage_close_keeps_its_copies_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C in the device stage's close, while it waits for its copies in flight: those
    copies stay tracked, so no unregistration can run under them afterwards."""
    import gpufeed
    from support.fakes import IndexDataset

    sim = SimCuda(1, max_steps=1, copy_cost=(20, 30))
    sim.install(monkeypatch)
    loader = gpufeed.DataLoader(IndexDataset(400), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, device="cuda")
    it = iter(loader)
    for _ in range(12):
        next(it)
    stage = it.inner  # type: ignore[attr-defined]
    copies = stage._copies
    assert len(copies) > 0 and copies in _pinning._tracked
    real_sync = type(sim.record_on(sim.consumer)).synchronize
    calls = 0

    def interrupted_once(self: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyboardInterrupt
        real_sync(self)

    event_type = type(sim.record_on(sim.consumer))
    monkeypatch.setattr(event_type, "synchronize", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        stage.close()
    assert copies in _pinning._tracked, "copies in flight were forgotten"
    monkeypatch.setattr(event_type, "synchronize", real_sync)
    sim.drain()
    copies.wait()
    _pinning.untrack_copies(copies)
    del it, stage, loader
    gc.collect()
    assert sim.registered == {}


class Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def test_an_interrupted_wait_hands_over_what_it_already_removed() -> None:
    """The payloads of entries already waited for reach the sink as each is removed: an
    interruption at the next one loses none, and the rest stay for the next wait."""
    from collections import deque

    fences = Fences()
    fences.add(Done(), "slot 1")
    fences.add(InterruptOnce(), "slot 2")
    sink: deque[str] = deque()
    with pytest.raises(KeyboardInterrupt):
        fences.wait(sink)
    assert list(sink) == ["slot 1"] and fences.payloads() == ["slot 2"]
    fences.wait(sink)
    assert list(sink) == ["slot 1", "slot 2"] and len(fences) == 0


def test_a_handle_collected_during_a_ctrl_c_stays_registered_and_is_retried(
    sim: SimCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handle collected while active (its ring collected without close) whose wait is
    interrupted: the Ctrl-C is raised again in the main thread (not swallowed by the
    finalizer), the memory stays registered and mapped, and the next reap unregisters it."""
    from gpufeed._memory import keeper as _keeper

    again: list[int] = []
    monkeypatch.setattr(_pinning, "interrupt_main_later", lambda: again.append(1))
    t = torch.zeros(PAGE, dtype=torch.uint8)
    ptr = t.data_ptr()
    fences = Fences()
    handle = _pinning.register(t, device=0, fences=fences)
    fences.add(InterruptOnce(), None)
    del handle, t  # only the handle's reference keeps the memory mapped now
    gc.collect()
    assert again == [1], "the Ctrl-C was swallowed by the handle's finalizer"
    assert ptr in sim.registered and _pinning.registered_bytes() == PAGE
    assert len(_pinning._stranded) == 1 and _pinning._stranded[0].keep is not None
    _keeper.reap_closed()
    assert sim.registered == {} and _pinning.registered_bytes() == 0
    assert _pinning._stranded == []
