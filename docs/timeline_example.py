"""The README's timeline picture: ``python docs/timeline_example.py [OUT.png]`` (and the trace,
OUT.json.gz, to open in Perfetto).

Two process workers read batches of 64 small images; a batch takes 10 ms to read, except one
in twenty, which takes 80 ms (a slow disk read, say). The training step takes 6 ms, so the two
workers keep up, except when the loop reaches a slow batch. The device stage (on the CPU here)
normalises each batch. The picture shows 0.8 s of the run from batch 20 on.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import gpufeed


class Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64 * 400

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        time.sleep(0.080 if indices[0] // 64 % 20 == 7 else 0.010)
        return [(torch.full((3, 32, 32), i % 255, dtype=torch.uint8), i % 10) for i in indices]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.__getitems__([i])[0]


def main(out: str) -> None:
    torch.set_num_threads(1)  # the main process's own torch work: one thread, as the workers'
    loader = gpufeed.DataLoader(
        Images(), batch_size=64, num_workers=2, device="cpu",
        device_transform=gpufeed.Normalize((0.5,) * 3, (0.25,) * 3, key=0))
    trace_path = Path(out).with_suffix(".json.gz")
    with gpufeed.trace(trace_path) as recording:
        for step, _batch in enumerate(loader):
            time.sleep(0.006)  # the training step
            if step == 200:
                break
    # from batch 20 on: the workers' start-up (its length varies with the machine) left out
    start_us = next(e["ts"] for e in recording.to_dict()["traceEvents"]
                    if e["name"] == "wait" and e["args"]["batch"] == 20)
    recording.plot(out, seconds=0.8, start_s=start_us / 1e6)
    print(f"wrote {out} and {trace_path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "timeline.png")
