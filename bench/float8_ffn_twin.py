"""bench/float8_ffn_twin.py: bench/float8_ffn_bench.cc's model in plain Python
torch: the same float8 recipes (tests/parity/float8_twin.py: torch._scaled_mm
in an autograd.Function, tensorwise, delayed or torchao's rowwise scaling)
against bf16 autocast,
AdamW(fused=True), the same shapes, warm-up and timing; host syncs per step
(torch.cuda.set_sync_debug_mode(1)) and peak memory per step.

    python3 bench/float8_ffn_twin.py           # CUDA: d=4096, 2 blocks, 8192 tokens
    python3 bench/float8_ffn_twin.py --small   # CPU: d=64, 1 block, 128 tokens (a smoke run)
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
from float8_twin import Delayed, delayed_update_vectorized, linear_for  # noqa: E402  the recipe the parity check holds amp to
from twin_timing import best_steps_per_s, syncs_per_step  # noqa: E402


class Ffn(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x, lin):
        if lin is None:  # bf16-mixed: the modules as they are
            return x + self.down(F.gelu(self.up(self.norm(x))))
        return x + lin(F.gelu(lin(self.norm(x), self.up)), self.down)


def bench(name, recipe, d, blocks, tokens, steps, rounds, device):
    torch.manual_seed(0)
    model = torch.nn.ModuleList([Ffn(d) for _ in range(blocks)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fp8 = Delayed(model, 1024, update=delayed_update_vectorized) if recipe == "delayed" else None
    lin = None if recipe == "bf16" else linear_for(recipe, fp8)
    torch.manual_seed(1)
    x, y = torch.randn(tokens, d, device=device), torch.randn(tokens, d, device=device)
    cuda = device == "cuda"

    def step():
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            h = x
            for block in model:
                h = block(h, lin)
            loss = F.mse_loss(h.float(), y)
        loss.backward()
        opt.step()
        if fp8:
            fp8.update()

    best = best_steps_per_s(step, steps, rounds, warmup=3, cuda=cuda)
    line = f"python {name}: {best:.2f} steps/s (best of {rounds} rounds of {steps})"
    if cuda:
        syncs = syncs_per_step(step, 5)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        line += f", {syncs:g} syncs/step, peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB"
    print(line, flush=True)
    return best


if __name__ == "__main__":
    small = "--small" in sys.argv
    device = "cpu" if small or not torch.cuda.is_available() else "cuda"
    shape = (64, 1, 128, 5, 2) if device == "cpu" else (4096, 2, 8192, 10, 3)
    recipes = ("tensorwise", "delayed", "rowwise", "rowwise-gw-hp")
    rates = {r: bench(f"ffn {r} ({device})", r, *shape, device) for r in ("bf16",) + recipes}
    for r in recipes:
        print(f"python ffn fp8 {r} / bf16-mixed: {rates[r] / rates['bf16']:.2f}x")
