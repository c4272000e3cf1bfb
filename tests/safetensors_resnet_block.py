"""A ResNet basic block's checkpoint moves between chorus and Python safetensors both ways,
with PyTorch's names (torchvision's BasicBlock state_dict), dtypes and shapes.

usage: safetensors_resnet_block.py HELPER WORKDIR
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
ours = os.path.join(work, "block_from_chorus.safetensors")
theirs = os.path.join(work, "block_from_python.safetensors")


def seed(name):
    return sum(map(ord, name)) % 97


def pattern(name, shape, dtype):
    """The values resnet_block.hpp's fill_pattern gives the tensor called `name`."""
    n = int(np.prod(shape))
    j = np.arange(n, dtype=np.int64)
    if dtype == np.int64:
        return np.full(shape, 3 + seed(name) % 5, dtype=np.int64)
    if name.endswith("running_var"):
        v = 0.5 + ((j * 5 + seed(name)) % 11) / 8.0
    else:
        v = ((j * 7 + seed(name)) % 17) / 16.0 - 0.5
    return v.astype(dtype).reshape(shape)


# torchvision.models.resnet.BasicBlock(4, 8, stride=2, downsample=conv1x1 + BatchNorm2d).state_dict()
f32, i64 = np.float32, np.int64
bn = lambda p, c: {f"{p}.weight": ((c,), f32), f"{p}.bias": ((c,), f32), f"{p}.running_mean": ((c,), f32),
                   f"{p}.running_var": ((c,), f32), f"{p}.num_batches_tracked": ((), i64)}
expected = {"conv1.weight": ((8, 4, 3, 3), f32), **bn("bn1", 8), "conv2.weight": ((8, 8, 3, 3), f32), **bn("bn2", 8),
            "downsample.0.weight": ((8, 4, 1, 1), f32), **bn("downsample.1", 8)}

# 1. chorus writes, Python reads: names, dtypes, shapes and values as PyTorch would have them.
subprocess.run([helper, "write", ours], check=True)
t = load_file(ours)
assert sorted(t) == sorted(expected), f"names {sorted(t)} != {sorted(expected)}"
for k, (shape, dtype) in expected.items():
    assert t[k].dtype == dtype, f"{k}: dtype {t[k].dtype}, expected {dtype}"
    assert t[k].shape == shape, f"{k}: shape {t[k].shape}, expected {shape}"
    assert np.array_equal(t[k], pattern(k, shape, dtype)), f"{k}: values {t[k]}"

# 2. Python writes (values + 1), chorus reads.
save_file({k: np.asarray(pattern(k, s, d) + d(1), dtype=d) for k, (s, d) in expected.items()}, theirs, metadata={"producer": "python"})
subprocess.run([helper, "check", theirs], check=True)

# 3. If PyTorch (and torchvision) are installed: a real BasicBlock's state_dict has these names.
try:
    import torch
    from torchvision.models.resnet import BasicBlock
    from safetensors.torch import save_file as torch_save

    block = BasicBlock(4, 8, stride=2, downsample=torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 1, stride=2, bias=False), torch.nn.BatchNorm2d(8)))
    sd = block.state_dict()
    assert sorted(sd) == sorted(expected), f"torchvision names {sorted(sd)}"
    torch_file = os.path.join(work, "block_from_torch.safetensors")
    torch_save({k: torch.from_numpy(np.asarray(pattern(k, s, d) + d(1), dtype=d)) for k, (s, d) in expected.items()}, torch_file)
    subprocess.run([helper, "check", torch_file], check=True)
    print("torchvision's BasicBlock state_dict has the same names; PyTorch's save_file output loads")
except ImportError:
    print("PyTorch/torchvision not installed: names checked against torchvision's documented state_dict")
print("safetensors ResNet block interop: ok")
