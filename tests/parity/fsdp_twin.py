"""tests/parity/fsdp_twin.py: the Python half of the fully sharded parity check
(tests/parity/fsdp_parity.cc; both driven by ddp_twin_test.sh).

    fsdp_twin.py OUT_DIR N [N ...]     (after `tools/launch -n N -- fsdp_parity OUT_DIR` for each N)

For each world size N, starts N processes of itself (subprocesses joined by a
FileStore in OUT_DIR, Gloo, bounded timeouts) that train what the C++ half
trained with PyTorch's own FSDP2: torch.distributed.fsdp.fully_shard on each
block, then on the root, with MixedPrecisionPolicy(param_dtype, reduce_dtype)
as the run names it, torch.optim.AdamW(fused=True) on the DTensor parameters,
torch.nn.utils.clip_grad_norm_ in the clipping run. Then compares, rank by
rank, every loss, every clip norm, every parameter shard (DTensor.to_local())
after every step and the final exp_avg, exp_avg_sq and step, bit for bit.
Exit 1 on any difference.

One thing is changed in torch, and it is a copy, not arithmetic: Gloo in
Debian's torch 2.14 rejects bf16 tensors ("Invalid scalar type"), so
dist.all_gather_single, which FSDP2 gathers its bf16 parameters with, is
wrapped to send 16-bit buffers as uint8 views of the same memory.
"""
import datetime
import sys
import time

import torch

from parity_io import bits, init, launch_workers, read_rank_steps, same_bits, timeout_s  # noqa: E402

STEPS = 16  # fsdp_parity.cc's kSteps
MAX_NORM = 0.5  # its kMaxNorm
WIDTH, HIDDEN, VOCAB, BLOCKS, BATCH, SEQ = 21, 42, 10, 3, 4, 6  # fsdp_model.h's
RUNS = {  # name: (param_dtype, reduce_dtype, clip), as fsdp_parity.cc's
    "fp32": (None, None, False),
    "bf16": (torch.bfloat16, torch.float32, False),
    "bf16-clip": (torch.bfloat16, torch.float32, True),
}



class Block(torch.nn.Module):
    """fsdp_model.h's Block: pre-norm, x + fc2(gelu(fc1(ln(x)))), with F.linear (aten::linear)."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(WIDTH)
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        f = torch.nn.functional
        h = f.layer_norm(x, (WIDTH,), self.ln.weight, self.ln.bias, 1e-5)
        return x + f.linear(f.gelu(f.linear(h, self.fc1.weight, self.fc1.bias)), self.fc2.weight, self.fc2.bias)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln_f = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        init(self)

    def forward(self, x):
        f = torch.nn.functional
        for b in self.blocks:
            x = b(x)
        x = f.layer_norm(x, (WIDTH,), self.ln_f.weight, self.ln_f.bias, 1e-5)
        return f.linear(x, self.head.weight, self.head.bias)


def data(rank):  # fsdp_model.h's Data
    torch.manual_seed(100 + rank)
    x = torch.randn(STEPS, BATCH, SEQ, WIDTH)
    y = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ))
    return x, y


def loss_of(logits, y):
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def bytes_all_gather():
    """dist.all_gather_single with 16-bit buffers sent as uint8 views (Gloo lacks their dtypes)."""
    import torch.distributed as dist
    plain = dist.all_gather_single

    def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
        if output_tensor.dtype in (torch.bfloat16, torch.float16):
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return plain(output_tensor, input_tensor, group=group, async_op=async_op)

    dist.all_gather_single = all_gather_single


def train(name, x, y):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    param_dtype, reduce_dtype, clip = RUNS[name]
    model = Net()
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    rows, saved = [], []
    for i in range(STEPS):
        loss = loss_of(model(x[i]), y[i])
        loss.backward()
        norm = 0.0
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor().item()
        opt.step()
        opt.zero_grad()
        rows.append((name, i, bits(loss.item()), bits(norm)))
        saved += [p.to_local().detach().clone() for p in model.parameters()]
    for p in model.parameters():
        st = opt.state[p]
        local = [t.to_local() if hasattr(t, "to_local") else t for t in (st["exp_avg"], st["exp_avg_sq"])]
        saved += [local[0].detach().clone(), local[1].detach().clone(), torch.tensor(float(st["step"]))]
    return rows, saved


def worker(out, world, rank, store):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, world_size=world, rank=rank,
                            timeout=datetime.timedelta(seconds=timeout_s()))
    bytes_all_gather()
    x, y = data(rank)
    prefix = f"{out}/py_w{world}_r{rank}"
    with open(prefix + "_steps.txt", "w") as f:
        for name in RUNS:
            rows, saved = train(name, x, y)
            f.writelines(" ".join(str(v) for v in row) + "\n" for row in rows)
            torch.save(saved, f"{prefix}_{name}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --- the driver -------------------------------------------------------------------

def launch(out, world):
    return launch_workers(__file__, out, world, "fully_shard", env={"USE_LIBUV": "0"})


def as_float(b):
    import struct
    return struct.unpack("<f", struct.pack("<I", b))[0]


def compare(out, world):
    failures = 0
    py = [read_rank_steps(f"{out}/py_w{world}_r{r}_steps.txt") for r in range(world)]
    cpp = [read_rank_steps(f"{out}/cpp_w{world}_r{r}_steps.txt") for r in range(world)]
    if any(sorted(c) != sorted(RUNS) for c in cpp):
        print(f"FAIL world {world}: the C++ half ran {sorted(cpp[0])}, expected {sorted(RUNS)}")
        return 1
    n_params = len(list(Net().parameters()))
    for name in RUNS:
        first_row, first_param, state_equal = None, None, True
        for r in range(world):
            d = next((row[1] for row, c in zip(py[r][name], cpp[r][name]) if row != c), None)
            if d is None and len(py[r][name]) != len(cpp[r][name]):
                d = min(len(py[r][name]), len(cpp[r][name]))
            if d is not None and (first_row is None or d < first_row[1]):
                first_row = (r, d)
            a = torch.load(f"{out}/py_w{world}_r{r}_{name}.pt")
            b = torch.load(f"{out}/cpp_w{world}_r{r}_{name}.pt", weights_only=False)
            if len(a) != len(b) or len(a) != STEPS * n_params + 3 * n_params:
                print(f"FAIL w{world} {name} rank {r}: {len(a)} Python tensors, {len(b)} C++")
                failures += 1
                continue
            for k in range(STEPS * n_params):
                if not same_bits(a[k], b[k]):
                    if first_param is None or k // n_params < first_param[1]:
                        first_param = (r, k // n_params, k % n_params)
                    break
            state_equal &= all(same_bits(p, q) for p, q in zip(a[STEPS * n_params:], b[STEPS * n_params:]))
        clip = RUNS[name][2]
        norms = [as_float(row[3]) for row in py[0][name]]
        clipped = sum(1 for n in norms if n > MAX_NORM)
        exercised = not clip or clipped > 0
        ok = first_row is None and first_param is None and state_equal and exercised
        failures += not ok
        if first_row is not None:
            r, i = first_row
            p, c = py[r][name][i], cpp[r][name][i]
            print(f"  w{world} {name}: first difference at rank {r} step {i}: python loss/norm bits "
                  f"{p[2]:#x}/{p[3]:#x}, C++ {c[2]:#x}/{c[3]:#x}")
        if first_param is not None:
            print(f"  w{world} {name}: first parameter difference at rank {first_param[0]} after step "
                  f"{first_param[1]}, parameter #{first_param[2]}")
        print(f"{'ok  ' if ok else 'FAIL'} w{world} {name}: {STEPS} steps x {world} ranks, losses"
              + (" and clip norms" if clip else "")
              + f" {'bitwise equal' if first_row is None else 'DIFFER'}; every shard after every step "
              f"{'bitwise equal' if first_param is None else 'DIFFERS'}; final optimizer state "
              f"{'bitwise equal' if state_equal else 'DIFFERS'}"
              + (f"; clipped at {clipped} of {STEPS} steps" + ("" if exercised else " (the run does not test clipping)")
                 if clip else ""))
    return failures


def main(out, worlds):
    print(f"fsdp_twin: torch {torch.__version__} on cpu, worlds {worlds}")
    failures = 0
    for world in worlds:
        t0 = time.monotonic()
        if launch(out, world):
            failures += 1
            continue
        failures += compare(out, world)
        print(f"fsdp_twin: world {world} done in {time.monotonic() - t0:.0f} s")
    print("fsdp_twin: PASS" if not failures else f"fsdp_twin: {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
    if len(sys.argv) < 3 or not all(a.isdigit() and int(a) >= 1 for a in sys.argv[2:]):
        sys.exit("usage: fsdp_twin.py OUT_DIR N [N ...]")
    sys.exit(main(sys.argv[1], [int(a) for a in sys.argv[2:]]))
