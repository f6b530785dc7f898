"""bench/fused_step_twin.py: bench/fused_step_bench.cc's CUDA models with
Python's torch.amp: Adam(fused=True) + torch.amp.GradScaler (16-mixed) or
plain autocast (bf16-mixed), the same shapes, warm-up and timing, and the host
syncs per step counted with torch.cuda.set_sync_debug_mode(1).

    python3 bench/fused_step_twin.py
"""
import torch

from twin_timing import best_steps_per_s, syncs_per_step


class Ffn(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def launch_bound():
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def compute_bound():
    return torch.nn.Sequential(*[Ffn(2048) for _ in range(4)])


def bench(name, make, dtype, scaled, rows, width, steps, rounds):
    torch.manual_seed(0)
    model = make().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=scaled)
    torch.manual_seed(1)
    x, y = torch.randn(rows, width, device="cuda"), torch.randn(rows, width, device="cuda")

    def step():
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    best = best_steps_per_s(step, steps, rounds, warmup=5)
    syncs = syncs_per_step(step, 20)
    print(f"python {name}: {best:.1f} steps/s (best of {rounds} rounds of {steps}), {syncs:g} syncs/step")


if __name__ == "__main__":
    bench("launch-bound 16-mixed Adam(fused)", launch_bound, torch.float16, True, 64, 256, 200, 5)
    bench("compute-bound bf16-mixed Adam(fused)", compute_bound, torch.bfloat16, False, 8192, 2048, 10, 3)
