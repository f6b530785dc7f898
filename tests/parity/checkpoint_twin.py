"""The Python half of the activation-checkpoint parity check (tests/parity/checkpoint_parity.cc).

    checkpoint_twin.py OUT_DIR

The same model, data and steps as the C++ half, each block run through
torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) (its default
preserve_rng_state=True) under torch.autocast("cpu", dtype=torch.bfloat16),
SGD with momentum. Compares losses and final parameters bit for bit; exits 1
on any difference. Also: the same run without checkpointing must equal it
(torch's own guarantee), and one whose recompute draws other dropout masks
(preserve_rng_state=False) must differ (the comparison can fail).
"""
import math
import sys

import torch
import torch.utils.checkpoint

from parity_io import bits, first_difference, init, read_steps  # noqa: E402

STEPS = 100
B, T, D, V, BLOCKS = 4, 8, 32, 16, 2
NAME = "checkpoint-bf16-mixed"


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
    def __init__(self, checkpointed, preserve_rng_state=True):
        super().__init__()
        for i in range(BLOCKS):
            setattr(self, f"block{i}", Block())
        self.ln_f = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V)
        self.checkpointed, self.preserve = checkpointed, preserve_rng_state

    def forward(self, x):
        for i in range(BLOCKS):
            block = getattr(self, f"block{i}")
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                                      preserve_rng_state=self.preserve)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


def run(checkpointed, preserve_rng_state=True):
    torch.manual_seed(1)
    x = torch.randn(STEPS, B * T, D)
    y = torch.randint(0, V, (STEPS, B * T))
    model = Net(checkpointed, preserve_rng_state)
    init(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    torch.manual_seed(2)  # dropout's masks
    rows = []
    for i in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x[i]).float(), y[i])
        loss.backward()
        opt.step()
        rows.append((NAME, i, bits(loss.item()), bits(1.0)))
    return rows, [p.detach() for p in model.parameters()]


def main(out):
    print(f"checkpoint_twin: torch {torch.__version__} on cpu")
    cpp = read_steps(out, {NAME: None})
    if cpp is None:
        return 1
    rows, params = run(True)
    cpp_params = torch.load(f"{out}/{NAME}.params.pt", weights_only=False)
    first = first_difference(rows, cpp[NAME])
    same_steps = first is None
    same_params = len(params) == len(cpp_params) and all(torch.equal(a, b) for a, b in zip(params, cpp_params))
    plain_rows, plain_params = run(False)
    plain_same = plain_rows == rows and all(torch.equal(a, b) for a, b in zip(plain_params, params))
    other_masks, _ = run(True, preserve_rng_state=False)
    differs = other_masks != rows
    ok = same_steps and same_params and plain_same and differs
    print(f"{'ok  ' if ok else 'FAIL'} {NAME}: {STEPS} steps, losses "
          f"{'bitwise equal' if same_steps else f'differ from step {first}'}, parameters "
          f"{'bitwise equal' if same_params else 'DIFFER'}; Python without checkpointing "
          f"{'equal' if plain_same else 'DIFFERS'}; with preserve_rng_state=False "
          f"{'differs' if differs else 'EQUAL (dropout changed nothing)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: checkpoint_twin.py OUT_DIR")
    sys.exit(main(sys.argv[1]))
