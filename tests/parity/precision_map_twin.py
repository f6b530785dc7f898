"""The Python half of the precision-map parity check (tests/parity/precision_map_parity.cc).

    precision_map_twin.py OUT_DIR

The same models, data and steps as the C++ half, with each module that the
C++ half maps to fp32 wrapped in `with torch.autocast("cpu", enabled=False):
m(x.float())` (Keras' "make the output float32", written the way Python users
do it), under torch.autocast and torch.amp.GradScaler as each run says.
Compares losses, scales and final parameters bit for bit; exits 1 on any difference.
"""
import math
import sys

import torch

from parity_io import backward_and_step, bits, first_difference, init, read_steps  # noqa: E402

STEPS = 100
B, T, D, V = 4, 8, 32, 16


class Fp32(torch.nn.Module):
    """Runs `m` with autocast off and its input in fp32."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return self.m(x.float())


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(D)
        self.q, self.k, self.v, self.proj = (torch.nn.Linear(D, D) for _ in range(4))
        self.ln2 = torch.nn.LayerNorm(D)
        self.fc1, self.fc2 = torch.nn.Linear(D, 4 * D), torch.nn.Linear(4 * D, D)
        self.ln_f = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V)

    def forward(self, x):
        a = self.ln1(x)
        qs, ks, vs = (m(a).view(B, T, D) for m in (self.q, self.k, self.v))
        att = torch.softmax(torch.matmul(qs, ks.transpose(1, 2)) / math.sqrt(D), -1)
        h = x + self.proj(torch.matmul(att, vs).reshape(B * T, D))
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(h))))
        return self.head(self.ln_f(h))

    def map(self):  # every LayerNorm and the head
        for name in ("ln1", "ln2", "ln_f", "head"):
            setattr(self, name, Fp32(getattr(self, name)))


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(D, 64), torch.nn.Linear(64, D)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class MemberNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block, self.head = torch.nn.Linear(D, D), Mlp(), torch.nn.Linear(D, V)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        return self.head(h + self.block(h))

    def map(self):
        self.block = Fp32(self.block)


def runs():
    out = {"block-bf16-mixed": (Block, torch.bfloat16), "member-bf16-mixed": (MemberNet, torch.bfloat16)}
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 3):
        out["block-16-mixed"] = (Block, torch.float16)
        out["member-16-mixed"] = (MemberNet, torch.float16)
    return out


def data():
    torch.manual_seed(1)
    x = torch.randn(STEPS, B * T, D)
    y = torch.randint(0, V, (STEPS, B * T))
    return x, y


def run(name, cls, dtype, x, y, mapped=True):
    model = cls()
    init(model)
    if mapped:
        model.map()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10) if dtype == torch.float16 else None
    rows = []
    for i in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(x[i]).float(), y[i])
        if dtype == torch.float16 and i in (3, 4, 40):
            loss = loss * math.inf
        scale = backward_and_step(loss, opt, scaler)
        rows.append((name, i, bits(loss.item()), bits(scale)))
    return rows, [p.detach() for p in model.parameters()]


def main(out):
    print(f"precision_map_twin: torch {torch.__version__} on cpu")
    expected = runs()
    cpp = read_steps(out, expected)
    if cpp is None:
        return 1
    x, y = data()
    failed = 0
    for name, (cls, dtype) in expected.items():
        rows, params = run(name, cls, dtype, x, y)
        cpp_params = torch.load(f"{out}/{name}.params.pt", weights_only=False)
        first = first_difference(rows, cpp[name])
        same_steps = first is None
        same_params = len(params) == len(cpp_params) and all(torch.equal(a, b) for a, b in zip(params, cpp_params))
        # The map is not vacuous: without the fp32 wrappers the twin differs.
        unmapped, _ = run(name, cls, dtype, x, y, mapped=False)
        differs = unmapped != rows
        ok = same_steps and same_params and differs
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {STEPS} steps, losses and scales "
              f"{'bitwise equal' if same_steps else f'differ from step {first}'}, parameters "
              f"{'bitwise equal' if same_params else 'DIFFER'}; unmapped twin "
              f"{'differs' if differs else 'EQUAL (the map changed nothing)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: precision_map_twin.py OUT_DIR")
    sys.exit(main(sys.argv[1]))
