"""Interleaved timing: every configuration once per round, so drift of the machine's speed cancels in the ratios."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA), so a timer stops after it; a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict, repeats: int, warmup: int, device: torch.device) -> tuple[dict, dict]:
    """Times each callable in ``fns`` once per round, for ``repeats`` rounds after ``warmup`` rounds.

    Returns:
        ``(wall, cpu)``: per name, the list of wall-clock and of process-CPU seconds.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync(device)
            tic, cpu_tic = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            wall[k].append(time.perf_counter() - tic)
            cpu[k].append(time.process_time() - cpu_tic)
    return wall, cpu


def medians(times: dict) -> dict:
    """The median of each list of :func:`interleaved`'s times, per name."""
    return {k: statistics.median(v) for k, v in times.items()}

