"""Writes what Python's `torch.save(scaler.state_dict(), path)` writes for a
torch.amp.GradScaler, with the standard library only (no torch needed): a zip
of `<archive>/data.pkl` (the dict pickled with protocol 2, Python floats and
ints, no type tags), `byteorder`, `version` and `.data/serialization_id`, as
torch/serialization.py's _save lays them out.

    python3 write_python_scaler_state.py OUT.pt

The values are a GradScaler(init_scale=1024, growth_factor=3, growth_interval=7)
after one overflow: scale 512, tracker 0. tests/data/ also holds a file written
by torch 2.11's own torch.save, for the same check.
"""
import pickle
import sys
import zipfile

STATE = {
    "scale": 512.0,
    "growth_factor": 3.0,
    "backoff_factor": 0.5,
    "growth_interval": 7,
    "_growth_tracker": 0,
}


def main(path):
    archive = "python_scaler_state"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{archive}/data.pkl", pickle.dumps(STATE, protocol=2))
        z.writestr(f"{archive}/byteorder", b"little")
        z.writestr(f"{archive}/version", b"3\n")
        z.writestr(f"{archive}/.data/serialization_id", b"0000000000000000000000000000000000000000")


if __name__ == "__main__":
    main(sys.argv[1])
