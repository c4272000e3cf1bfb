"""The GPU peer: chorus_gpu_bench's workloads in PyTorch — eager, nn.DataParallel and
CUDA-graph captured — timed with CUDA events. Writes JSON records.

usage: pytorch_gpu_bench.py [--repeats N] [--json FILE]
"""
import argparse
import json
import os
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F


def measure(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), min(times), max(times)


def mlp(i, h, o, layers):
    mods = [nn.Linear(i, h)]
    for _ in range(layers - 2):
        mods += [nn.ReLU(), nn.Linear(h, h)]
    mods += [nn.ReLU(), nn.Linear(h, o)]
    return nn.Sequential(*mods).cuda()


def step_fn(model, x, y, loss):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        l = loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        l.backward()
        opt.step()
    return step, opt


def graphed(model, x, y, loss):
    """The whole training step captured in a CUDA graph (static inputs)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss(model(x), y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        l = loss(model(x), y)
        l.backward()
        opt.step()
    return g.replay


class BasicBlock(nn.Module):
    """ResNet-20's block as examples/resnet.hpp builds it (option-A shortcut: subsample, zero-pad)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.pad = (cout - cin) // 2 if stride != 1 or cin != cout else None
        self.stride = stride

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        sc = x if self.pad is None else F.pad(x[:, :, ::self.stride, ::self.stride],
                                              (0, 0, 0, 0, self.pad, self.pad))
        return F.relu(out + sc)


class ResNet20(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        stage = lambda i, o, s: nn.Sequential(BasicBlock(i, o, s), BasicBlock(o, o, 1), BasicBlock(o, o, 1))
        self.layer1, self.layer2, self.layer3 = stage(16, 16, 1), stage(16, 32, 2), stage(32, 64, 2)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


def resnet20_bench(add, repeats):
    """resnet20-cifar: batch 128, SGD with momentum, eager, NCHW and channels_last (cuDNN's
    preferred NHWC layout; the input and the weights converted once, outside the step)."""
    flops = 6.0 * 40551040 * 128  # as bench::resnet20_step_flops
    for channels_last in (False, True):
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        model = ResNet20().cuda().to(memory_format=fmt)
        x = torch.randn(128, 3, 32, 32, device="cuda").to(memory_format=fmt)
        y = torch.randint(0, 10, (128,), device="cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step():
            l = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            l.backward()
            opt.step()
        add("pytorch-eager", "resnet20-cifar", "1 GPU fp32" + (" channels_last" if channels_last else ""), 1,
            measure(step, 10, repeats or 50), flops)


def mlp_flops(batch, layers):
    f = 0.0
    for k, (i, o) in enumerate(layers):
        f += 2 * batch * i * o * (2 if k == 0 else 3)
    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--json", default="pytorch_gpu_bench.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    records = []

    def add(impl, workload, config, devices, res, flops=0.0):
        med, lo, hi = res
        r = dict(impl=impl, workload=workload, config=config, devices=devices, threads=0, median_ms=med, min_ms=lo,
                 max_ms=hi, version=torch.__version__)
        if flops:
            r["tflops"] = flops / (med * 1e9)
        records.append(r)
        print(f"  {impl:22s} {workload:10s} {config:34s} median {med:9.3f} ms", flush=True)
        write()  # after every record: a timeout later still leaves what was measured

    def write():
        with open(args.json + ".tmp", "w") as f:
            json.dump({"records": records}, f, indent=2)
        os.replace(args.json + ".tmp", args.json)

    # tutorial: Linear(5, 2), 100 samples on the host, batches of 30, forward only, nn.DataParallel on 1 GPU.
    reps = args.repeats or 200
    data = torch.randn(100, 5)
    model = nn.DataParallel(nn.Linear(5, 2).cuda(), device_ids=[0])

    def epoch():
        perm = torch.randperm(100)
        for s in range(0, 100, 30):
            model(data[perm[s:s + 30]])
    add("pytorch-dataparallel", "tutorial", "DataParallel 1 GPU", 1, measure(epoch, 20, reps))

    # mlp-small: eager and CUDA graph.
    reps = args.repeats or 100
    flops = mlp_flops(256, [(784, 512), (512, 512), (512, 10)])
    x, y = torch.randn(256, 784, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
    step, _ = step_fn(mlp(784, 512, 10, 3), x, y, F.cross_entropy)
    add("pytorch-eager", "mlp-small", "1 GPU", 1, measure(step, 10, reps), flops)
    add("pytorch-cudagraph", "mlp-small", "1 GPU", 1, measure(graphed(mlp(784, 512, 10, 3), x, y, F.cross_entropy), 10, reps),
        flops)

    # mlp-large: fp32 and TF32, eager and CUDA graph; nn.DataParallel on [0, 0] is refused by
    # PyTorch (duplicate device ids), so its peer there is the one-GPU eager step.
    reps = args.repeats or 20
    flops = mlp_flops(8192, [(4096, 4096)] * 4)
    x, y = torch.randn(8192, 4096, device="cuda"), torch.randn(8192, 4096, device="cuda")
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        name = "1 GPU " + ("tf32" if tf32 else "fp32")
        step, _ = step_fn(mlp(4096, 4096, 4096, 4), x, y, F.mse_loss)
        add("pytorch-eager", "mlp-large", name, 1, measure(step, 3, reps), flops)
        add("pytorch-cudagraph", "mlp-large", name, 1, measure(graphed(mlp(4096, 4096, 4096, 4), x, y, F.mse_loss), 3, reps),
            flops)
    torch.backends.cuda.matmul.allow_tf32 = False
    resnet20_bench(add, args.repeats)
    write()
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
