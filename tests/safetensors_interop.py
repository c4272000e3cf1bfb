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

# 3. 16-bit tensors. numpy has float16 but no bfloat16: the BF16 bits are computed here
# from float32 bits with round-to-nearest-even, and BF16 files are read and written by hand
# (the format is 8 bytes of header length, the JSON header, the data).
def bf16_bits(f32):
    u = np.asarray(f32, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def lowp_reference(add):
    w = (np.arange(6, dtype=np.float32) - np.float32(7)) / np.float32(3) + np.float32(add)
    h = np.arange(4, dtype=np.float32) * np.float32(1000.5) + np.float32(add)
    return bf16_bits(w).reshape(2, 3), h.astype(np.float16).reshape(4)  # numpy's astype rounds to nearest even


def read_raw(path):
    import json

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def write_raw(path, tensors):  # name -> (dtype code, shape, bytes)
    import json

    header, blobs, off = {}, b"", 0
    for name, (code, shape, raw) in tensors.items():
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs += raw
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + blobs)


lowp_ours = os.path.join(work, "lowp_from_chorus.safetensors")
subprocess.run([helper, "write-lowp", lowp_ours], check=True)
header, data = read_raw(lowp_ours)
want_w, want_h = lowp_reference(0)
for name, code, want in (("w", "BF16", want_w), ("h", "F16", want_h)):
    e = header[name]
    assert e["dtype"] == code, f"{name}: dtype {e['dtype']}, expected {code}"
    assert tuple(e["shape"]) == want.shape, f"{name}: shape {e['shape']}"
    b, end = e["data_offsets"]
    got = np.frombuffer(data[b:end], dtype=np.uint16)
    assert np.array_equal(got, want.view(np.uint16).reshape(-1)), f"{name}: bits {got} vs {want.view(np.uint16)}"
# safetensors itself reads the F16 tensor of chorus's file (safetensors.numpy has no BF16).
lowp_f16 = os.path.join(work, "lowp_f16_only.safetensors")
write_raw(lowp_f16, {"h": ("F16", want_h.shape, want_h.tobytes())})
assert np.array_equal(load_file(lowp_f16)["h"], want_h)

lowp_theirs = os.path.join(work, "lowp_from_python.safetensors")
w1, h1 = lowp_reference(1)
write_raw(lowp_theirs, {"w": ("BF16", w1.shape, w1.tobytes()), "h": ("F16", h1.shape, h1.tobytes())})
subprocess.run([helper, "check-lowp", lowp_theirs], check=True)
print("BF16 and F16 tensors move both ways")

# 4. If PyTorch is installed, its save_file output loads too.
try:
    import torch
    from safetensors.torch import save_file as torch_save

    torch_file = os.path.join(work, "from_torch.safetensors")
    torch_save({k: torch.from_numpy(v + 1) for k, v in expected.items()}, torch_file)
    subprocess.run([helper, "check", torch_file], check=True)
    # PyTorch's own bfloat16 rounding, and its reading of chorus's BF16 file.
    torch_lowp = os.path.join(work, "lowp_from_torch.safetensors")
    tw = torch.from_numpy((np.arange(6, dtype=np.float32) - np.float32(7)) / np.float32(3) + np.float32(1))
    th = torch.from_numpy(np.arange(4, dtype=np.float32) * np.float32(1000.5) + np.float32(1))
    torch_save({"w": tw.to(torch.bfloat16).reshape(2, 3), "h": th.to(torch.float16)}, torch_lowp)
    subprocess.run([helper, "check-lowp", torch_lowp], check=True)
    from safetensors.torch import load_file as torch_load

    tl = torch_load(lowp_ours)
    assert tl["w"].dtype == torch.bfloat16 and tl["h"].dtype == torch.float16
    assert np.array_equal(tl["w"].view(torch.int16).numpy().view(np.uint16), want_w)
    print("PyTorch's save_file output loads (bfloat16 and float16 too)")
except ImportError:
    print("PyTorch not installed: checked with safetensors.numpy, which writes the same format")
print("safetensors interop: ok")
