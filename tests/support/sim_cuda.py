"""SimCuda: a CPU backend for ``to_device`` that simulates CUDA's asynchrony, for tests.

Streams are FIFOs of operations that run *later*, in order per stream, in interleavings chosen
by a seeded random scheduler; the caller (the "CPU") never waits unless it calls
``Event.synchronize()``. Everything is deterministic for a given seed and call sequence, and
no thread is started.

    caller ──► copy / record_event / wait_event / launch   enqueue an op, return at once
               every backend call is a tick: the "GPU" runs 0..max_steps random steps
    stream ──► [alloc][copy][marker][wait E][kernel] ...   head op advanced one step at a
               time (ops cost steps); a wait blocks its stream until E has completed

What is faithful, and so what a missing or misplaced synchronisation breaks:

* ``copy(t)`` returns a device tensor at once; the bytes are read from the host tensor when
  the op *executes*. The op holds the host tensor weakly (a DMA holds a pointer, not a
  reference): if the host batch was released before the copy ran (a ring slot recycled) it
  is a violation, and the device tensor keeps poison bytes.
* Device tensors come from a caching allocator with one pool per stream (the stream current
  at allocation). When Python frees a device tensor (the last view of its storage goes) its
  block returns to that pool; if ``record_stream(t, s)`` was called, not before the work
  queued on ``s`` at the time of the free has completed (CUDA's rule). A reused block is the
  *same* memory; its (re)allocation is an op on the allocating stream that poisons it.
* Kernels (``launch``; the consumer's work, and a transform's) hold raw handles, not
  tensors, and read memory when they run. Each block has a generation: a kernel or copy that
  runs while its block holds another generation than the one it was launched on either ran
  before the allocation was ordered (a missing ``wait_event``) or after the memory was
  reused (a missing ``record_stream``). Both are recorded in ``violations``.

Device bytes in use (live blocks plus freed ones not yet reusable) are tracked, with a peak.

The CUDA runtime around the device stage (``install(monkeypatch)``), for the user idioms:

* Devices: ``devices`` of them. As in CUDA, the current device and each device's current
  stream are per *thread*: every thread starts on device 0 and on each device's default
  stream (``consumers[d]``; device 0's is ``consumer``), and ``use_stream``/``device_ctx``
  (installed as ``_cuda.device_guard``) change them for the calling thread only. Every CUDA
  call is logged in ``calls`` with the device it ran on, and that device gets a context
  (``contexts``): a call for the loader's device made under another is a context created on
  the wrong GPU.
* ``cudaHostRegister``/``cudaHostUnregister`` (a fake ``torch.cuda.cudart()``) keep the
  registered ranges; ``register_code`` injects a failure. ``Tensor.pin_memory`` gives a
  pinned copy (torch's caching host allocator: kept until the test ends).
* ``Tensor.cuda(non_blocking=True)`` / ``Tensor.to("cuda", non_blocking=True)``: from
  registered memory an op on the current stream that holds the *address* (a DMA) and reads
  the bytes when it executes, so a slot rewritten in between is seen as the wrong batch;
  unregistering a range such a copy still has to read is a violation. From pageable memory
  the bytes are staged at the call (CUDA returns once the pageable buffer is copied).
* ``torch.cuda.is_initialized`` (True after the first CUDA call), graph capture (``capture``:
  the current stream; ``capturing_streams``: given streams, where recording an event is a
  violation).

What the tests steer:

* ``background=True`` (or ``start_background()``): the "GPU" also advances on a thread of its
  own, every ``interval_s``, so work completes while the CPU blocks elsewhere (waiting for a
  worker, sleeping), not only when it calls CUDA. Still bounded: ``stop_background()``.
* ``collect_at``: names of calls ("event", "query", "synchronize", "record_event", "h2d", ...)
  at which the simulator runs ``gc.collect()`` before anything else, so finalizers (a batch's
  slot release) run inside whatever gpufeed code made the call.
"""

from __future__ import annotations

import ctypes
import gc
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpufeed._device.streams import SyncBackend

POISON = 0xFF  # every byte: NaN for floats, -1 for ints
INSTALLED: list[SimCuda] = []  # installed during the running test (tests/conftest.py)


class SimEvent:
    def __init__(self, sim: SimCuda, stream: SimStream) -> None:
        self.sim, self.stream, self.done = sim, stream, False

    def query(self) -> bool:
        self.sim.maybe_collect("query")
        with self.sim.lock:
            self.sim.tick()
            return self.done

    def synchronize(self) -> None:
        self.sim.maybe_collect("synchronize")
        self.sim.syncs += 1
        self.sim.run_until(lambda: self.done, f"event on {self.stream.name}")

    def __repr__(self) -> str:
        return f"SimEvent({self.stream.name}, done={self.done})"


@dataclass
class _Op:
    what: str
    cost: int
    run: Callable[[], None] | None = None
    wait: SimEvent | None = None  # blocks the stream until this event is done


@dataclass(eq=False)  # a stream is itself: hashable, compared by identity
class SimStream:
    name: str
    device: int = 0
    ops: deque[_Op] = field(default_factory=deque)

    def runnable(self) -> bool:
        return bool(self.ops) and (self.ops[0].wait is None or self.ops[0].wait.done)

    def __repr__(self) -> str:
        return f"SimStream({self.name})"


@dataclass(eq=False)
class _Block:
    mem: np.ndarray  # the "device memory", held by the allocator for ever
    stream: SimStream  # whose pool it belongs to
    gen: int = 0  # bumped at each (re)allocation, on the CPU
    exec_gen: int = -1  # bumped when that allocation's op runs on the stream
    live: bool = False
    recorded: set[int] = field(default_factory=set)  # id(stream) of record_stream calls
    pending: list[SimEvent] = field(default_factory=list)  # markers to pass before reuse

    @property
    def nbytes(self) -> int:
        return int(self.mem.nbytes)


@dataclass(frozen=True)
class _Handle:
    """A raw pointer into a block: what a kernel holds (not the tensor)."""

    block: _Block
    gen: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class SimCuda(SyncBackend):
    """The simulated CUDA backend (see the module docstring).

    Args:
        seed: the scheduler's seed (interleavings, op costs, steps per tick).
        max_steps: most scheduler steps run per tick (0..max_steps, at random).
        copy_cost: (lo, hi) steps a copy takes.
        time_limit_s: ``synchronize`` raises past this many seconds (a hang, not a wait).
        devices: how many devices there are.
        target: the device the device stage (``to_device``) copies to.
        background: the GPU also advances on a thread of its own (see the module docstring).
        collect_at: calls at which to run ``gc.collect()`` first.
    """

    needs_pinned = False

    def __init__(
        self, seed: int = 0, *, max_steps: int = 3, copy_cost: tuple[int, int] = (1, 3),
        time_limit_s: float = 20.0, devices: int = 1, target: int = 0,
        background: bool = False, collect_at: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(torch.device("cuda", target))
        self.rng = random.Random(seed)
        self.max_steps, self.copy_cost, self.time_limit_s = max_steps, copy_cost, time_limit_s
        self.lock = threading.RLock()  # finalizers may run in any thread
        self.consumer = SimStream("consumer", 0)
        self.consumers = [self.consumer,
                          *(SimStream(f"consumer{i}", i) for i in range(1, devices))]
        self.streams: list[SimStream] = list(self.consumers)
        self._tls = threading.local()  # per thread: current device, current stream per device
        self.contexts: set[int] = set()  # devices with a context (a call ran on them)
        self.collect_at = set(collect_at)
        self.collections = 0  # gc.collect() runs made at collect_at points
        self.syncs = 0  # Event.synchronize() calls: the CPU blocked on the GPU
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()
        self.initialized = False  # torch.cuda.is_initialized()
        self.capture = False  # the current stream is capturing a graph
        self.capturing_streams: set[SimStream] = set()  # these streams are capturing
        self.calls: list[tuple[str, int]] = []  # (CUDA call, current device at the call)
        self.registered: dict[int, int] = {}  # cudaHostRegister'ed ptr -> nbytes
        self.register_code = 0  # what cudaHostRegister returns (0: success)
        self._pinned: list[torch.Tensor] = []  # from pin_memory(): the caching host allocator
        self._reads: dict[int, tuple[int, int]] = {}  # queued DMA reads: id -> (ptr, nbytes)
        self.violations: list[str] = []
        self._blocks: dict[int, _Block] = {}  # data pointer -> block
        self._pools: dict[tuple[int, int], list[_Block]] = {}  # (id(stream), nbytes) -> free
        self._waiting: list[_Block] = []  # freed, but record_stream markers not yet passed
        self.peak_bytes = 0
        self.allocs = self.reuses = 0
        if background:
            self.start_background()

    # -- per-thread state, as in CUDA -----------------------------------------------------------
    @property
    def device_index(self) -> int:
        """The calling thread's current device."""
        return int(getattr(self._tls, "device", 0))

    @device_index.setter
    def device_index(self, index: int) -> None:
        self._tls.device = index

    def _streams_of_thread(self) -> dict[int, SimStream]:
        table = getattr(self._tls, "current", None)
        if table is None:
            table = self._tls.current = dict(enumerate(self.consumers))
        return table

    def current_of(self, index: int) -> SimStream:
        """The calling thread's current stream of device ``index``."""
        return self._streams_of_thread()[index]

    @property
    def current(self) -> SimStream:
        """The calling thread's current stream of its current device."""
        return self.current_of(self.device_index)

    @current.setter
    def current(self, stream: SimStream) -> None:
        self._streams_of_thread()[self.device_index] = stream

    def log(self, what: str, device: int | None = None) -> None:
        self.maybe_collect(what)
        self.initialized = True
        index = self.device_index if device is None else device
        self.contexts.add(index)
        self.calls.append((what, index))

    def maybe_collect(self, what: str) -> None:
        if what in self.collect_at:
            self.collections += 1
            gc.collect()

    # -- the GPU on a thread of its own ---------------------------------------------------------
    def start_background(self, interval_s: float = 0.0005) -> None:
        if self._background is not None:
            return
        self._stop_background.clear()

        def run() -> None:
            while not self._stop_background.wait(interval_s):
                with self.lock:
                    self.tick()

        self._background = threading.Thread(target=run, name="sim-gpu", daemon=True)
        self._background.start()

    def stop_background(self) -> None:
        thread, self._background = self._background, None
        if thread is not None:
            self._stop_background.set()
            thread.join(5)

    # -- the backend interface ----------------------------------------------------------------
    def new_stream(self) -> SimStream:
        with self.lock:
            self.log("new_stream")
            stream = SimStream(f"side{len(self.streams)}", self.device_index)
            self.streams.append(stream)
            return stream

    def current_stream(self) -> SimStream:
        return self.current_of(self.device.index or 0)  # the target's, as CudaBackend's

    def guard(self) -> Any:
        return self.device_ctx(self.device.index)

    def capturing(self) -> bool:
        return self.capture

    @contextmanager  # type: ignore[override]
    def use_stream(self, stream: Any) -> Iterator[None]:
        """``torch.cuda.stream(s)``: ``s``'s device current, ``s`` its current stream, for the
        calling thread; both restored on exit."""
        device = self.device_index
        self.device_index = stream.device
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous
            self.device_index = device

    def record_event(self, stream: Any) -> SimEvent:
        with self.lock:
            self.log("record_event", stream.device)
            self.tick()
            return self._marker(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        with self.lock:
            self.log("wait_event", stream.device)
            self.tick()
            stream.ops.append(_Op("wait", 0, wait=event))

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        with self.lock:
            nbytes = t.numel() * t.element_size()
            if t.is_contiguous() and nbytes and self._is_registered(t.data_ptr(), nbytes):
                self.calls.append(("copy", self.device_index))
                return self.h2d(t, non_blocking=True)  # a DMA from registered memory
            self.log("copy")
            self.tick()
            stream = self.current
            out = self.empty(t.shape, t.dtype)
            dst, src = self._handle(out), weakref.ref(t)

            def run() -> None:
                host = src()
                view = self._resolve(dst, f"copy on {stream.name}")
                if host is None:
                    self.violations.append(
                        f"copy on {stream.name}: the host tensor was released before the copy "
                        "ran (its slot may be recycled)"
                    )
                elif view is not None:
                    view.copy_(host)

            stream.ops.append(_Op("copy", self.rng.randint(*self.copy_cost), run))
            return out

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        with self.lock:
            self.log("record_stream")
            self.tick()
            block = self._block_of(t)
            if block is not None and stream is not block.stream:
                block.recorded.add(id(stream))

    def on_device(self, t: torch.Tensor) -> bool:
        return self._block_of(t) is not None

    def is_pinned(self, t: torch.Tensor) -> bool:
        return True

    # -- the CUDA runtime around the stage (install) -------------------------------------------
    def install(self, monkeypatch: Any) -> None:
        """Make gpufeed's CUDA calls (``_pinning``'s seams, ``cudart``) and the user's
        ``Tensor.cuda``/``Tensor.to``/``Tensor.pin_memory`` go to this simulator. The test's
        end (tests/conftest.py) calls ``finish`` before the monkeypatch is undone."""
        INSTALLED.append(self)
        from gpufeed._base import cuda as _cuda
        from gpufeed._device import prefetch as _prefetch
        from gpufeed._memory import pinning as _pinning

        for name, fn in {
            "cuda_initialized": lambda: self.initialized,
            "device_count": lambda: len(self.consumers),
            "current_device": self._current_device,
            "device_guard": self.device_ctx,
            "_current_stream_capturing": lambda: self.capture or self.current in
            self.capturing_streams,
            # the seams of per-device release fences (absent from older code: set anyway)
            "_has_context": lambda index: index in self.contexts,
            "_current_stream_of": self.current_of,
            "_record_on": self.record_on,
            "_capturing_on": lambda stream: stream in self.capturing_streams,
        }.items():
            monkeypatch.setattr(_cuda, name, fn, raising=False)
        monkeypatch.setattr(_cuda, "_with_context", set(), raising=False)  # this run's devices
        for name, fn in {
            "cuda_usable": lambda: True, "_pinned_ptr": self.pinned_ptr, "pin": self.pin,
            "pinned_empty": self.pinned_empty,
        }.items():
            monkeypatch.setattr(_pinning, name, fn)
        monkeypatch.setattr(_prefetch, "backend_for", lambda device: self)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart(self))
        sim, real_to = self, torch.Tensor.to

        def cuda(t: torch.Tensor, device: Any = None, non_blocking: bool = False) -> torch.Tensor:
            return sim.h2d(t, device, non_blocking=non_blocking)

        def to(t: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
            dev = args[0] if args else kw.get("device")
            if isinstance(dev, str | torch.device) and torch.device(dev).type == "cuda":
                return sim.h2d(t, dev, non_blocking=kw.get("non_blocking", False))
            return real_to(t, *args, **kw)

        monkeypatch.setattr(torch.Tensor, "cuda", cuda)
        monkeypatch.setattr(torch.Tensor, "to", to)

    @contextmanager
    def device_ctx(self, index: int | None) -> Iterator[None]:
        """``torch.cuda.device(index)``: the current device inside (None: unchanged)."""
        if index is None:
            yield
            return
        previous, self.device_index = self.device_index, index
        try:
            yield
        finally:
            self.device_index = previous

    def _current_device(self) -> int:
        self.initialized = True  # torch.cuda.current_device() initialises CUDA
        return self.device_index

    def set_device(self, index: int) -> None:
        self.device_index = index

    def _release_event(self) -> SimEvent:
        with self.lock:
            self.log("event")
            self.tick()
            return self._marker(self.current)

    def record_on(self, stream: SimStream) -> SimEvent:
        """``torch.cuda.Event().record(stream)``: on the stream's own device (torch guards it)."""
        with self.lock:
            self.log("event", stream.device)
            if stream in self.capturing_streams:
                self.violations.append(f"an event recorded on {stream.name} while it captures "
                                       "a CUDA graph (it would be part of the graph)")
            self.tick()
            return self._marker(stream)

    def pinned_ptr(self, ptr: int) -> bool:
        spans = [*self.registered.items(),
                 *((p.data_ptr(), p.numel() * p.element_size()) for p in self._pinned)]
        return any(p <= ptr < p + n for p, n in spans)

    def _is_registered(self, ptr: int, nbytes: int) -> bool:
        return any(p <= ptr and ptr + nbytes <= p + n for p, n in self.registered.items())

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.log("pin_memory")
            out = t.clone()
            self._pinned.append(out)
            return out

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``torch.empty(..., pin_memory=True)``: logged as a pinning, on the current device."""
        with self.lock:
            self.log("pin_memory")
            out = torch.empty(shape, dtype=dtype)
            self._pinned.append(out)
            return out

    def h2d(self, t: torch.Tensor, device: Any = None, *, non_blocking: bool) -> torch.Tensor:
        """``t.to(device, non_blocking=...)`` from host memory (see the module docstring)."""
        with self.lock:
            index = self.device_index
            if device is not None:
                dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(
                    device)
                index = self.device_index if dev.index is None else dev.index
            with self.device_ctx(index):
                self.log("h2d")
                self.tick()
                stream = self.current
                out = self._alloc(tuple(t.shape), t.dtype, stream)
                dst = self._handle(out) if out.numel() else None
                ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
                pinned = any(p is t or p.data_ptr() == ptr for p in self._pinned)
                if (non_blocking and t.is_contiguous() and nbytes
                        and self._is_registered(ptr, nbytes)):
                    key = id(object())
                    self._reads[key] = (ptr, nbytes)
                    dtype, shape = t.dtype, tuple(t.shape)

                    def read() -> torch.Tensor | None:  # the DMA reads the address now
                        self._reads.pop(key, None)
                        if not self._is_registered(ptr, nbytes):
                            self.violations.append(
                                f"copy on {stream.name} read {nbytes} bytes at {ptr:#x} after "
                                "they were unregistered")
                            return None
                        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
                        return torch.frombuffer(raw, dtype=torch.uint8).clone().view(
                            dtype).view(shape)
                else:  # pinned by the caching allocator (kept alive), or staged now
                    staged = t if non_blocking and pinned else t.clone()

                    def read() -> torch.Tensor | None:
                        return staged

                def run() -> None:
                    host = read()
                    view = self._resolve(dst, f"h2d on {stream.name}") if dst else None
                    if host is not None and view is not None:
                        view.copy_(host)

                stream.ops.append(_Op("h2d", self.rng.randint(*self.copy_cost), run))
                return out

    def check_unregister(self, ptr: int) -> None:
        nbytes = self.registered.get(ptr, 0)
        for p, n in self._reads.values():
            if p < ptr + nbytes and ptr < p + n:
                self.violations.append(
                    f"cudaHostUnregister at {ptr:#x} while a copy from it is still queued")
                return

    # -- for tests: kernels and allocations ----------------------------------------------------
    def launch(self, stream: SimStream | None, fn: Callable[..., None], *tensors: torch.Tensor,
               cost: int = 1) -> None:
        """Enqueue kernel ``fn(*views)`` on ``stream`` (None: the current one). ``tensors``
        must be device tensors; the kernel holds raw handles and gets views made when it runs."""
        with self.lock:
            self.tick()
            stream = self.current if stream is None else stream
            handles = [self._handle(t) for t in tensors]
            name = getattr(fn, "__name__", "kernel")

            def run() -> None:
                views = [self._resolve(h, f"kernel {name} on {stream.name}") for h in handles]
                if all(v is not None for v in views):
                    fn(*views)

            stream.ops.append(_Op(name, cost, run))

    def empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor from the current stream's pool (contents: poison, in stream order)."""
        with self.lock:
            return self._alloc(tuple(shape), dtype, self.current)

    def in_use_bytes(self) -> int:
        """Device bytes not available to a new allocation: live, or freed but waiting."""
        with self.lock:
            self._collect()
            return sum(b.nbytes for b in self._blocks.values() if b.live) + sum(
                b.nbytes for b in self._waiting
            )

    # -- the scheduler ------------------------------------------------------------------------
    def tick(self) -> None:
        with self.lock:
            for _ in range(self.rng.randint(0, self.max_steps)):
                if not self.step():
                    break

    def step(self) -> bool:
        """Advance one runnable stream's head op by one step; False if none can run."""
        with self.lock:
            ready = [s for s in self.streams if s.runnable()]
            if not ready:
                return False
            stream = self.rng.choice(ready)
            op = stream.ops[0]
            if op.cost > 1:
                op.cost -= 1
                return True
            stream.ops.popleft()
            if op.run is not None:
                op.run()
            return True

    def run_until(self, done: Callable[[], bool], what: str) -> None:
        start = time.monotonic()
        with self.lock:
            while not done():
                if not self.step():
                    raise RuntimeError(f"deadlock: {what} can never complete; {self.streams}")
                if time.monotonic() - start > self.time_limit_s:
                    raise RuntimeError(f"{what} not complete after {self.time_limit_s} s")

    def finish(self) -> None:
        """The end of a test: the GPU catches up, what the test left is collected, and the
        rings it closed unregister their slots, while this runtime is still installed (a
        later test's runtime must not see them)."""
        from gpufeed._memory import pinning
        from support.cuda_memory import finish_closed_rings

        self.stop_background()
        gc.collect()
        try:  # a test may leave a stream waiting for ever on purpose
            self.drain()
            finish_closed_rings()
        except RuntimeError:
            pass
        pinning.retry_stranded()

    def drain(self) -> None:
        """Run every queued op (the end of a test: the GPU catches up)."""
        self.run_until(lambda: not any(s.ops for s in self.streams), "drain")

    # -- the allocator ------------------------------------------------------------------------
    def _marker(self, stream: SimStream) -> SimEvent:
        event = SimEvent(self, stream)

        def run() -> None:
            event.done = True

        stream.ops.append(_Op("marker", 0, run))
        return event

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, stream: SimStream) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        size = (nbytes + 7) // 8 * 8
        self._collect()
        pool = self._pools.setdefault((id(stream), size), [])
        if pool:
            block = pool.pop()
            self.reuses += 1
        else:
            block = _Block(np.full(size, POISON, dtype=np.uint8), stream)
            self._blocks[block.mem.ctypes.data] = block
            self.allocs += 1
        block.gen += 1
        block.live, block.recorded = True, set()
        gen = block.gen

        def run() -> None:  # the new owner's writes start here, in stream order
            block.exec_gen = gen
            block.mem.fill(POISON)

        stream.ops.append(_Op("alloc", 0, run))
        base = block.mem.view()  # the storage's owner: its finalizer is the free
        fin = weakref.finalize(base, self._free, block)
        fin.atexit = False
        out = torch.from_numpy(base)[:nbytes].view(dtype).view(shape)
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes())
        return out

    def _free(self, block: _Block) -> None:
        with self.lock:
            block.live = False
            streams = [s for s in self.streams if id(s) in block.recorded]
            if streams:  # CUDA: events recorded on those streams at free time
                block.pending = [self._marker(s) for s in streams]
                self._waiting.append(block)
            else:
                self._pools[(id(block.stream), block.nbytes)].append(block)

    def _collect(self) -> None:
        for block in list(self._waiting):
            if all(e.done for e in block.pending):
                self._waiting.remove(block)
                self._pools[(id(block.stream), block.nbytes)].append(block)

    def _block_of(self, t: torch.Tensor) -> _Block | None:
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        return self._blocks.get(t.untyped_storage().data_ptr())

    def _handle(self, t: torch.Tensor) -> _Handle:
        block = self._block_of(t)
        if block is None or not block.live:
            raise TypeError("launch() and copy() take device tensors of this backend")
        return _Handle(block, block.gen, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())

    def _resolve(self, h: _Handle, what: str) -> torch.Tensor | None:
        block = h.block
        if block.exec_gen != h.gen:
            why = (
                "ran before its memory's allocation was ordered on its stream (missing wait_event?)"
                if block.exec_gen < h.gen
                else "ran after its memory was reused by a new tensor (missing record_stream?)"
            )
            self.violations.append(f"{what} {why}")
            return None
        raw = torch.from_numpy(block.mem).view(h.dtype)
        return raw.as_strided(h.shape, h.stride, h.offset)


class _Cudart:
    """``torch.cuda.cudart()`` of the simulator: host registration, logged per device."""

    cudaError = int  # the runtime's spelling

    def __init__(self, sim: SimCuda) -> None:
        self.sim = sim

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        sim = self.sim
        with sim.lock:
            sim.log("register")
            if sim.register_code:
                return sim.register_code
            sim.registered[ptr] = nbytes
            return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        sim = self.sim
        with sim.lock:
            sim.log("unregister")
            sim.check_unregister(ptr)
            return 0 if sim.registered.pop(ptr, None) is not None else 1

    def cudaGetErrorString(self, code: Any) -> str:
        return {2: "cudaErrorMemoryAllocation: out of memory",
                801: "cudaErrorNotSupported: operation not supported"}.get(int(code), "unknown")

    def cudaGetLastError(self) -> int:
        return 0
