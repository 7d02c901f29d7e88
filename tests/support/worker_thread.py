"""One gpufeed worker loop on a thread, driven message by message: ``send`` what the main
process would send, read its ``answer``s."""

from __future__ import annotations

import queue
import threading
from typing import Any

from gpufeed._host.messages import ThreadChannel, ToMain, WorkerSpec
from gpufeed._host.worker import worker_loop


class WorkerThread:
    """A thread worker on its channel; ``queued``: messages waiting before it reads any."""

    def __init__(self, spec: WorkerSpec, *queued: Any) -> None:
        self.results: queue.SimpleQueue[tuple[int, ToMain]] = queue.SimpleQueue()
        self.chan = ThreadChannel(0, self.results)
        for msg in queued:
            self.chan.tasks.put(msg)
        self.thread = threading.Thread(target=worker_loop, args=(spec,), daemon=True,
                                       kwargs=dict(worker_id=0, kind="thread", chan=self.chan))
        self.thread.start()

    def send(self, msg: Any) -> None:
        self.chan.tasks.put(msg)

    def answer(self) -> Any:
        w, msg = self.results.get(timeout=30)
        assert w == 0
        return msg

    def stop(self) -> None:
        self.send(None)
        self.thread.join(30)
        assert not self.thread.is_alive() and self.results.empty()
