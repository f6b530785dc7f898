"""bench/twin_timing.py: the timing and host-sync counting that the Python
twins of the CUDA benchmarks share (bench/fused_step_twin.py,
bench/float8_ffn_twin.py; their C++ side counts syncs with bench/cuda_syncs.h)."""
import time
import warnings

import torch


def best_steps_per_s(step, steps, rounds, warmup, cuda=True):
    """`warmup` steps, then the best of `rounds` rounds of `steps` steps, in steps/s."""

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        best = max(best, steps / (time.perf_counter() - t0))
    return best


def syncs_per_step(step, calls):
    """Host syncs per step over `calls` steps (torch.cuda.set_sync_debug_mode(1): one warning per sync)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        for _ in range(calls):
            step()
        torch.cuda.set_sync_debug_mode(0)
    return sum(1 for w in caught if "synchroniz" in str(w.message)) / calls
