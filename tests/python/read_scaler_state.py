"""Reads what torch::pickle_save wrote of a GradScaler state_dict the way
Python's torch.load does (a zip with archive/data.pkl), with the standard
library only: the one global in it is torch.jit._pickle.restore_type_tag,
which torch defines as `return value`. Checks torch's keys, Python types and
values. Where Python has torch, also torch.load (weights_only=True) and
torch.amp.GradScaler.load_state_dict.   read_scaler_state.py STATE.pt"""
import io
import pickle
import sys
import zipfile

ALLOWED = {("torch.jit._pickle", "restore_type_tag"): lambda value, type_str: value}


class Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"unexpected global {module}.{name}")
        return ALLOWED[(module, name)]

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"unexpected tensor in a GradScaler state_dict: {pid!r}")


def main(path):
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith("/data.pkl")]
        assert len(names) == 1, z.namelist()
        state = Unpickler(io.BytesIO(z.read(names[0]))).load()
    expected = {"scale": 512.0, "growth_factor": 3.0, "backoff_factor": 0.5, "growth_interval": 7, "_growth_tracker": 0}
    assert state == expected, f"{state!r} != {expected!r}"
    # torch.amp.GradScaler.load_state_dict reads these as Python float/int.
    types = {k: type(v) for k, v in state.items()}
    assert types == {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
                     "_growth_tracker": int}, types
    print("PASS: Python reads", state)
    try:
        import torch
        import torch.jit._pickle  # not imported by `import torch` on 2.6
    except ImportError:
        print("(no Python torch here: torch.load and GradScaler.load_state_dict not tried)")
        return
    # Python's own loader (with torch.load's default since 2.6, weights_only=True, where that needs
    # the one global allowed), then torch.amp.GradScaler (2.3+) loads it.
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals([torch.jit._pickle.restore_type_tag])
        loaded = torch.load(path, weights_only=True)
    else:
        loaded = torch.load(path)
    assert loaded == expected, f"torch.load: {loaded!r} != {expected!r}"
    print(f"PASS: torch {torch.__version__}: torch.load gives", loaded)
    if not hasattr(torch.amp, "GradScaler"):
        print("(no torch.amp.GradScaler in this torch: load_state_dict not tried)")
        return
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(loaded)
    got = (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
    assert got == (512.0, 3.0, 0.5, 7), got
    assert scaler.state_dict() == expected, scaler.state_dict()
    print(f"PASS: torch {torch.__version__}: GradScaler.load_state_dict gives", got)

if __name__ == "__main__":
    main(sys.argv[1])
