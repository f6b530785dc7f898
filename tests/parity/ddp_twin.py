"""tests/parity/ddp_twin.py: the Python half of the data-parallel parity check
(tests/parity/ddp_parity.cc; both driven by ddp_twin_test.sh).

    ddp_twin.py OUT_DIR N [N ...]     (after `tools/launch -n N -- ddp_parity OUT_DIR` for each N)

For each world size N, starts N processes of itself (subprocesses joined by
a FileStore in OUT_DIR, Gloo, bounded timeouts) that train what the C++ half
trained with torch.nn.parallel.DistributedDataParallel (its defaults: 25 MiB
buckets, no comm hook, unless the run names a cap or hook), torch.autocast and
torch.amp.GradScaler (torch's recipe: scale(loss).backward(), step, update),
then compares every rank's per-step losses and loss scales and final
parameters with the C++ rank's, bit for bit. SGD(foreach=False) where the C++
half runs LibTorch's own SGD step (the per-tensor loop it is), AdamW(fused=True)
where it takes the fused path. Fails unless the C++ half ran exactly the runs
this torch can run (as this twin decides them), and every scaled run both
backed off and grew its scale. Gloo's sum of an element depends on its offset
in the bucket, so both sides must lay their buckets out alike: each worker
first records DDP's layouts of the first three steps of every run (a throwaway
model) and fails with both if they are not the C++ rank's (its layouts.txt).
Exit 1 on any difference.
"""
import datetime
import math
import struct
import sys
import time

import torch

from parity_io import backward_and_step, bits, launch_workers, read_rank_steps, same_bits, timeout_s  # noqa: E402

STEPS = 30  # as ddp_parity.cc's kSteps
BATCH = 32  # per rank, as kBatch
INF_STEPS = (3, 4, 17)  # the last rank's loss times inf, in the "-inf" runs


def version():
    return tuple(int(v) for v in torch.__version__.split(".")[:2])



# --- the runs, as ddp_parity.cc decides them ------------------------------------

def gloo_takes(dtype):
    """Whether this build's Gloo all-reduces `dtype` (it rejects one it lacks before sending anything)."""
    import torch.distributed as dist
    try:
        dist.all_reduce(torch.zeros(1, dtype=dtype))
        return True
    except RuntimeError as e:
        if "Invalid scalar type" in str(e):
            return False
        raise


def runs():
    """(runs: name -> spec, skipped: [reason]) for this torch and its Gloo (call with the group up)."""
    r, skipped = {}, []
    sgd = dict(opt="sgd", hook=None)
    r["sgd-bf16-mixed"] = dict(sgd, policy="bf16-mixed")
    r["sgd-bf16-mixed-buckets"] = dict(sgd, policy="bf16-mixed", cap=0.02)  # several buckets after step 0 (2.6+)
    if version() >= (2, 3):  # CPU fp16 autocast and GradScaler kernels
        r["sgd-16-mixed-inf"] = dict(sgd, policy="16-mixed")
        if version() >= (2, 4):
            r["adamw-16-mixed-inf"] = dict(opt="adamw", hook=None, policy="16-mixed")
        else:
            skipped.append("adamw-16-mixed-inf: no CPU fused AdamW before torch 2.4")
    else:
        skipped.append("sgd-16-mixed-inf: no CPU fp16 autocast / GradScaler kernels before torch 2.3")
        skipped.append("adamw-16-mixed-inf: no CPU fp16 autocast / GradScaler kernels before torch 2.3")
    if version() >= (2, 4):
        r["adamw-bf16-mixed"] = dict(opt="adamw", hook=None, policy="bf16-mixed")
    else:
        skipped.append("adamw-bf16-mixed: no CPU fused AdamW before torch 2.4")
    # bf16_compress_hook needs CUDA and NCCL (DDP refuses it on CPU): the fp16 hook only.
    if gloo_takes(torch.float16):
        r["sgd-bf16-mixed-fp16hook"] = dict(sgd, policy="bf16-mixed", hook="fp16")
    else:
        skipped.append(f"sgd-bf16-mixed-fp16hook: this torch's Gloo does not take {torch.float16}")
    return r, skipped


class Mlp(torch.nn.Module):
    """ddp_parity.cc's Mlp: parity_io.h's MLP (its weights), F.linear as the C++ torch::linear, its
    parameters registered in their order, w1, b1, w2, b2, w3, b3: DDP's first bucket holds them so,
    its rebuilt one in the order their gradients arrive (w3, b3, w2, b2, w1, b1 under autocast), and
    amp must follow both. Gloo's sum of an element depends on its offset in the bucket; see
    ddp_parity.cc."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # parity_io.h's make_mlp: seed 0, then randn * 0.05 per parameter
        ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                  torch.nn.ReLU(), torch.nn.Linear(128, 10))
        w1, b1, w2, b2, w3, b3 = (torch.randn(p.shape) * 0.05 for p in ref.parameters())
        for n, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2), ("w3", w3), ("b3", b3)):
            self.register_parameter(n, torch.nn.Parameter(t))

    def forward(self, x):
        f = torch.nn.functional
        return f.linear(f.relu(f.linear(f.relu(f.linear(x, self.w1, self.b1)), self.w2, self.b2)), self.w3, self.b3)

    def canonical(self):
        return [self.w1, self.b1, self.w2, self.b2, self.w3, self.b3]


def data(rank):  # ddp_parity.cc's Data
    torch.manual_seed(100 + rank)
    x = torch.randn(STEPS, BATCH, 64) * 2
    y = torch.randint(0, 10, (STEPS, BATCH))
    return x, y


def train(name, r, rank, world, x, y):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model = Mlp()
    ddp = make_ddp(model, r)
    if r["hook"] is not None:
        ddp.register_comm_hook(None, {"fp16": default_hooks.fp16_compress_hook,
                                      "bf16": default_hooks.bf16_compress_hook}[r["hook"]])
    if r["opt"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    scaled = r["policy"] == "16-mixed"
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5) if scaled else None
    ac = autocast_dtype(r)
    rows = []
    for i in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=ac):
            loss = torch.nn.functional.cross_entropy(ddp(x[i]), y[i])
            if name.endswith("-inf") and rank == world - 1 and i in INF_STEPS:
                loss = loss * math.inf
        scale = backward_and_step(loss, opt, scaler)
        rows.append((name, i, bits(loss.item()), bits(scale)))
    return rows, [p.detach().clone() for p in model.canonical()]


def make_ddp(model, r):
    """DDP with its defaults, bucket_cap_mb where the run names one (as DataParallelOptions)."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model, **({"bucket_cap_mb": r["cap"]} if r.get("cap") else {}))


def autocast_dtype(r):
    return torch.float16 if r["policy"] == "16-mixed" else torch.bfloat16


def bucket_layouts(x, y, r):
    """DDP's buckets in its first three iterations, as ddp_parity.cc writes amp's ("w3,b3,w2|b2,w1|b1":
    launch order; a throwaway model, a recording hook around allreduce_hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model = Mlp()
    ddp = make_ddp(model, r)
    names = {id(p): n for n, p in model.named_parameters()}
    seen = []

    def hook(state, bucket):
        seen[-1].append(",".join(names[id(p)] for p in bucket.parameters()))
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    for i in range(3):
        seen.append([])
        with torch.autocast("cpu", dtype=autocast_dtype(r)):
            torch.nn.functional.cross_entropy(ddp(x[i]), y[i]).backward()
    return ["|".join(s) for s in seen]


def cpp_layouts(path):
    """ddp_parity.cc's layouts.txt: {run: [layout of step 0, 1, 2]}."""
    out = {}
    for line in open(path):
        name, i, layout = line.split()
        out.setdefault(name, []).append(layout)
    return out


def worker(out, world, rank, store):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, world_size=world, rank=rank,
                            timeout=datetime.timedelta(seconds=timeout_s()))
    todo, skipped = runs()
    x, y = data(rank)
    # The bitwise comparison needs amp's buckets laid out as DDP's in every iteration.
    cpp = cpp_layouts(f"{out}/cpp_w{world}_r{rank}_layouts.txt")
    for name, r in todo.items():
        seen = bucket_layouts(x, y, r)
        if seen != cpp.get(name):
            print(f"FAIL rank {rank} {name}: DDP's buckets in its first three iterations are {seen}, amp's "
                  f"{cpp.get(name)}", flush=True)
            return 3
    prefix = f"{out}/py_w{world}_r{rank}"
    with open(prefix + "_steps.txt", "w") as f:
        for name, r in todo.items():
            rows, params = train(name, r, rank, world, x, y)
            f.writelines(" ".join(str(v) for v in row) + "\n" for row in rows)
            torch.save(params, f"{prefix}_{name}.pt")
    if rank == 0:
        with open(f"{out}/py_w{world}_skipped.txt", "w") as f:
            f.writelines(s + "\n" for s in skipped)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --- the driver -------------------------------------------------------------------

def launch(out, world):
    return launch_workers(__file__, out, world, "DDP")


def compare(out, world):
    failures = 0
    py = [read_rank_steps(f"{out}/py_w{world}_r{r}_steps.txt") for r in range(world)]
    cpp = [read_rank_steps(f"{out}/cpp_w{world}_r{r}_steps.txt") for r in range(world)]
    for s in open(f"{out}/py_w{world}_skipped.txt"):
        print(f"skip w{world} {s.strip()}")
    if any(sorted(c) != sorted(py[0]) for c in cpp):
        print(f"FAIL world {world}: the C++ half ran {sorted(cpp[0])}, this torch runs {sorted(py[0])}")
        return 1
    for name in py[0]:
        first_diff, params_equal, scales = None, True, []
        for r in range(world):
            d = next((row[1] for row, c in zip(py[r][name], cpp[r][name]) if row != c), None)
            if d is None and len(py[r][name]) != len(cpp[r][name]):
                d = min(len(py[r][name]), len(cpp[r][name]))
            if d is not None and (first_diff is None or d < first_diff[1]):
                first_diff = (r, d)
            a = torch.load(f"{out}/py_w{world}_r{r}_{name}.pt")
            b = torch.load(f"{out}/cpp_w{world}_r{r}_{name}.pt", weights_only=False)
            params_equal &= len(a) == len(b) and all(same_bits(p, q) for p, q in zip(a, b))
        scales = [struct.unpack("<f", struct.pack("<I", row[3]))[0] for row in py[0][name]]
        backoffs = sum(1 for a, b in zip(scales, scales[1:]) if b < a)
        growths = sum(1 for a, b in zip(scales, scales[1:]) if b > a)
        scaled = "-16-mixed" in name
        exercised = not scaled or (backoffs > 0 and growths > 0)
        ok = first_diff is None and params_equal and exercised
        failures += not ok
        if first_diff is not None:
            r, i = first_diff
            p, c = py[r][name][i], cpp[r][name][i]
            print(f"  w{world} {name}: first difference at rank {r} step {i}: python loss/scale bits "
                  f"{p[2]:#x}/{p[3]:#x}, C++ {c[2]:#x}/{c[3]:#x}")
        print(f"{'ok  ' if ok else 'FAIL'} w{world} {name}: {STEPS} steps x {world} ranks, losses and scales "
              f"{'bitwise equal' if first_diff is None else 'DIFFER'}; final parameters of every rank "
              f"{'bitwise equal' if params_equal else 'DIFFER'}; "
              + (f"scale backed off {backoffs}x, grew {growths}x, final {scales[-1]:g}"
                 + ("" if exercised else " (a scaled run must both back off and grow)") if scaled else "unscaled"))
    return failures


def main(out, worlds):
    print(f"ddp_twin: torch {torch.__version__} on cpu, worlds {worlds}")
    failures = 0
    for world in worlds:
        t0 = time.monotonic()
        if launch(out, world):
            failures += 1
            continue
        failures += compare(out, world)
        print(f"ddp_twin: world {world} done in {time.monotonic() - t0:.0f} s")
    print("ddp_twin: PASS" if not failures else f"ddp_twin: {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
    if len(sys.argv) < 3 or not all(a.isdigit() and int(a) >= 1 for a in sys.argv[2:]):
        sys.exit("usage: ddp_twin.py OUT_DIR N [N ...]")
    sys.exit(main(sys.argv[1], [int(a) for a in sys.argv[2:]]))
