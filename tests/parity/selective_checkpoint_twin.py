"""The Python half of the activation-checkpointing parity check (tests/parity/selective_checkpoint_parity.cc).

    selective_checkpoint_twin.py OUT_DIR

The same model, data and steps as the C++ half under torch.autocast("cpu",
bfloat16), each block run plainly ("none"), through
torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) ("full"), and
with context_fn=partial(create_selective_checkpoint_contexts, policy) where the
policy saves the outputs of aten.mm, addmm, bmm and baddbmm and recomputes the
rest ("selective"). Compares losses and final parameters bit for bit; exits 1
on any difference. Not vacuous: the selective policy saves outputs at every
step, and the same run without preserve_rng_state (other dropout masks in the
recompute) differs.
"""
import functools
import math
import sys

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parity_io import bits, first_difference, init, read_steps  # noqa: E402

STEPS = 100
B, T, D, V = 4, 8, 32, 16
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default)
saved_outputs = [0]  # MUST_SAVE decisions in forwards


def policy(ctx, op, *args, **kwargs):
    if op in MATMULS:
        saved_outputs[0] += not ctx.is_recompute
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(D)
        self.q, self.k, self.v, self.proj = (torch.nn.Linear(D, D) for _ in range(4))
        self.ln2 = torch.nn.LayerNorm(D)
        self.fc1, self.fc2 = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        a = self.ln1(x)
        qs, ks, vs = (m(a).view(B, T, D) for m in (self.q, self.k, self.v))
        att = self.drop(torch.softmax(torch.matmul(qs, ks.transpose(1, 2)) / math.sqrt(D), -1))
        h = x + self.drop(self.proj(torch.matmul(att, vs).reshape(B * T, D)))
        return h + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(h)))))


class Net(torch.nn.Module):
    def __init__(self, mode, preserve_rng_state=True):
        super().__init__()
        self.mode, self.preserve = mode, preserve_rng_state
        self.block1, self.block2 = Block(), Block()
        self.ln_f = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V)

    def run(self, block, x):
        if self.mode == "none":
            return block(x)
        kwargs = {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)} \
            if self.mode == "selective" else {}
        return checkpoint(block, x, use_reentrant=False, preserve_rng_state=self.preserve, **kwargs)

    def forward(self, x):
        return self.head(self.ln_f(self.run(self.block2, self.run(self.block1, x))))


def data():
    torch.manual_seed(1)
    x = torch.randn(STEPS, B * T, D)
    y = torch.randint(0, V, (STEPS, B * T))
    return x, y


def run(name, x, y, preserve_rng_state=True):
    model = Net(name, preserve_rng_state)
    init(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    rows = []
    for i in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x[i]).float(), y[i])
        loss.backward()
        opt.step()
        rows.append((name, i, bits(loss.item()), bits(1.0)))
    return rows, [p.detach() for p in model.parameters()]


def main(out):
    print(f"selective_checkpoint_twin: torch {torch.__version__} on cpu")
    expected = ("none", "full", "selective")
    cpp = read_steps(out, expected)
    if cpp is None:
        return 1
    x, y = data()
    failed = 0
    for name in expected:
        saved_outputs[0] = 0
        rows, params = run(name, x, y)
        saved = saved_outputs[0]
        cpp_params = torch.load(f"{out}/{name}.params.pt", weights_only=False)
        first = first_difference(rows, cpp[name])
        same_steps = first is None
        same_params = len(params) == len(cpp_params) and all(torch.equal(a, b) for a, b in zip(params, cpp_params))
        # 2 blocks x (q, k, v, proj, fc1, fc2 addmm + 2 bmm) per step
        saves = saved == (2 * 8 * STEPS if name == "selective" else 0)
        ok = same_steps and same_params and saves
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {STEPS} steps, losses "
              f"{'bitwise equal' if same_steps else f'differ from step {first}'}, parameters "
              f"{'bitwise equal' if same_params else 'DIFFER'}; {saved} matmul outputs saved")
    # Not vacuous: without the random state the recompute draws other dropout masks.
    other, _ = run("selective", x, y, preserve_rng_state=False)
    differs = other != cpp["selective"]
    failed += not differs
    print(f"{'ok  ' if differs else 'FAIL'} selective without preserve_rng_state: "
          f"{'differs' if differs else 'EQUAL (the random state changed nothing)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: selective_checkpoint_twin.py OUT_DIR")
    sys.exit(main(sys.argv[1]))
