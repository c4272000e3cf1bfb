"""Python's safetensors reads what chorus writes, and chorus reads what Python writes.

usage: safetensors_interop.py HELPER WORKDIR
Exits 77 (skipped) when safetensors/numpy are missing, unless CHORUS_REQUIRE_PYTHON_INTEROP=1.
"""
import os
import subprocess
import sys

helper, work = sys.argv[1], sys.argv[2]
try:
    import numpy as np
    from safetensors.numpy import load_file, save_file
except ImportError as e:
    print(f"safetensors or numpy missing ({e}); pip install safetensors numpy")
    sys.exit(1 if os.environ.get("CHORUS_REQUIRE_PYTHON_INTEROP") == "1" else 77)

os.makedirs(work, exist_ok=True)
ours = os.path.join(work, "from_chorus.safetensors")
theirs = os.path.join(work, "from_python.safetensors")

# 1. chorus writes, Python reads.
subprocess.run([helper, "write", ours], check=True)
t = load_file(ours)
expected = {
    "fc1.weight": (np.arange(12, dtype=np.float32).reshape(4, 3) * 0.5 - 3).astype(np.float32),
    "fc1.bias": np.arange(4, dtype=np.float32),
    "head.weight": np.arange(8, dtype=np.float64).reshape(2, 4) * 0.25,
    "steps": np.array([10, 20, 30], dtype=np.int64),
}
assert sorted(t) == sorted(expected), f"names {sorted(t)}"
for k, v in expected.items():
    assert t[k].dtype == v.dtype, f"{k}: dtype {t[k].dtype}, expected {v.dtype}"
    assert t[k].shape == v.shape, f"{k}: shape {t[k].shape}, expected {v.shape}"
    assert np.array_equal(t[k], v), f"{k}: values {t[k]}"
with open(ours, "rb") as f:
    import json
    n = int.from_bytes(f.read(8), "little")
    meta = json.loads(f.read(n)).get("__metadata__", {})
assert meta.get("producer") == "chorus", meta

# 2. Python writes (values + 1), chorus reads.
save_file({k: v + 1 for k, v in expected.items()}, theirs, metadata={"producer": "python"})
subprocess.run([helper, "check", theirs], check=True)

# 3. If PyTorch is installed, its save_file output loads too.
try:
    import torch
    from safetensors.torch import save_file as torch_save

    torch_file = os.path.join(work, "from_torch.safetensors")
    torch_save({k: torch.from_numpy(v + 1) for k, v in expected.items()}, torch_file)
    subprocess.run([helper, "check", torch_file], check=True)
    print("PyTorch's save_file output loads")
except ImportError:
    print("PyTorch not installed: checked with safetensors.numpy, which writes the same format")
print("safetensors interop: ok")
