"""tests/parity/parity_twin.py: the Python half of the parity check.

    python3 parity_twin.py OUT_DIR [cuda|cpu]     (after `parity OUT_DIR [cuda|cpu]`)

Runs the steps of tests/parity/parity.cc with Python's torch.amp (autocast,
GradScaler; SGD(foreach=False) for the hand recipe, the per-tensor loop
LibTorch's C++ SGD is; fused=True optimizers for the Trainers, whose path is
the fused kernel) and compares every step's loss and loss scale and the final
parameters with the C++ run bit for bit. Fails unless every scaled run both
backed off and grew its scale (so skipped steps were compared). On cuda,
also writes a GradScaler state_dict with torch.save for the Python -> C++
direction. Exit 1 on any difference.
"""
import struct
import sys

import torch

STEPS = 300

# name: (autocast dtype, or the model's dtype for a True run; GradScaler init_scale or None; optimizer;
#        max_grad_norm)
RUNS = {
    "recipe-16-mixed": (torch.float16, 65536.0,
                        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False), None),
    "trainer-16-mixed": (torch.float16, 65536.0, lambda p: torch.optim.Adam(p, lr=1e-3, fused=True), None),
    "trainer-bf16-mixed": (torch.bfloat16, None, lambda p: torch.optim.Adam(p, lr=1e-3, fused=True), None),
    "trainer-16-mixed-adamw-clip": (
        torch.float16, 65536.0,
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, amsgrad=True, fused=True), 1.0),
    "trainer-16-mixed-sgd": (
        torch.float16, 1024.0,
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4, fused=True), None),
    "trainer-bf16-true": (torch.bfloat16, None, lambda p: torch.optim.Adam(p, lr=1e-3, fused=True), None),
    "trainer-64-true": (torch.float64, None, lambda p: torch.optim.Adam(p, lr=1e-3, fused=True), None),
}


def bits(x):
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def make_model(device):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                            torch.nn.ReLU(), torch.nn.Linear(256, 10))
    with torch.no_grad():  # as parity.cc: explicit randn weights (module init differs between C++ and Python)
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    return m.to(device)


def data(device):
    torch.manual_seed(1)
    x = (torch.randn(STEPS, 128, 64) * 4).to(device)
    y = torch.randint(0, 10, (STEPS, 128)).to(device)
    return x, y


def run(name, device, x, y):
    dtype, init_scale, make_opt, max_norm = RUNS[name]
    true = name.endswith("-true")  # Lightning's "bf16-true"/"64-true": the model in that dtype, no autocast
    model = make_model(device).to(dtype) if true else make_model(device)
    opt = make_opt(model.parameters())
    scaled = init_scale is not None
    scaler = torch.amp.GradScaler(device, init_scale=init_scale or 1.0, growth_interval=20, enabled=scaled)
    rows = []
    for i in range(STEPS):
        opt.zero_grad()
        if true:
            loss = torch.nn.functional.cross_entropy(model(x[i].to(dtype)), y[i])
        else:
            with torch.autocast(device, dtype=dtype):
                loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
        scaler.scale(loss).backward()
        if max_norm is not None:
            scaler.unscale_(opt)
            # foreach=False: amp clips tensor by tensor, as LibTorch's C++ clip_grad_norm_ does.
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False)
        scaler.step(opt)
        scaler.update()
        rows.append((name, i, bits(loss.item()), bits(scaler.get_scale() if scaled else 1.0)))
    return rows, [p.detach().cpu() for p in model.parameters()], scaled


def main(out, device):
    x, y = data(device)
    m = make_model(device)
    w = next(m.parameters())
    print(f"python: torch {torch.__version__} on {device}: inputs x.sum {x.sum().item():g} y.sum {y.sum().item()} "
          f"w0[0,0] {w.view(-1)[0].item():g} w.sum {w.sum().item():g}")
    cpp = {}
    for line in open(f"{out}/cpp_steps.txt"):
        run_name, i, loss, scale = line.split()
        cpp[(run_name, int(i))] = (int(loss), int(scale))
    failures = 0
    for name in RUNS:
        rows, params, scaled = run(name, device, x, y)
        diff_steps = [r[1] for r in rows if cpp.get((r[0], r[1])) != (r[2], r[3])]
        cpp_params = torch.load(f"{out}/cpp_{name}.pt", weights_only=False)
        same_params = len(cpp_params) == len(params) and all(torch.equal(a, b) for a, b in zip(cpp_params, params))
        scales = [struct.unpack("<f", struct.pack("<I", r[3]))[0] for r in rows]
        backoffs = sum(1 for a, b in zip(scales, scales[1:]) if b < a)
        growths = sum(1 for a, b in zip(scales, scales[1:]) if b > a)
        if diff_steps:
            i = diff_steps[0]
            c = cpp.get((name, i))
            print(f"  first difference at step {i}: python loss/scale bits {rows[i][2]:#x}/{rows[i][3]:#x}, "
                  f"C++ {c[0]:#x}/{c[1]:#x}" if c else f"  step {i} missing in the C++ log")
        exercised = not scaled or (backoffs > 0 and growths > 0)
        ok = not diff_steps and same_params and exercised
        failures += 0 if ok else 1
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {STEPS} steps, losses and scales "
              f"{'bitwise equal' if not diff_steps else f'differ at steps {diff_steps[:5]}'}; "
              f"final parameters {'bitwise equal' if same_params else 'DIFFER'}; "
              + (f"scale backed off {backoffs}x, grew {growths}x, final {scales[-1]:g}"
                 + ("" if exercised else " (a scaled run must both back off and grow)") if scaled else "unscaled"))
    if device == "cuda":
        # Python -> C++: a GradScaler state as torch.save writes it (read by tests/scaler_test.cc's twin file).
        s = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_factor=3.0, growth_interval=7)
        w = torch.zeros(2, device="cuda", requires_grad=True)
        o = torch.optim.SGD([w], lr=0.1)
        s.scale((w * float("inf")).sum()).backward()
        s.step(o)
        s.update()
        torch.save(s.state_dict(), f"{out}/python_grad_scaler.pt")
        print("wrote", f"{out}/python_grad_scaler.pt", s.state_dict())
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] not in ("cuda", "cpu")):
        sys.exit("usage: parity_twin.py OUT_DIR [cuda|cpu]")
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else "cuda"))
