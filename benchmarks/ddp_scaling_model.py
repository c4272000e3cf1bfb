#!/usr/bin/env python3
"""Model of DistributedDataParallel's efficiency for mlp-large on 8 x H200 (NVLink, NCCL ring).

The buckets are the ones DistributedDataParallel builds (Note [DDP buckets]): parameters in
reverse order, the first bucket closing at 1 MB, the others at 25 MB; a tensor larger than the
cap closes its bucket alone, so mlp-large (4 x Linear(4096, 4096)) gets one bucket per layer.
A bucket's all-reduce takes bytes * 2 (n - 1) / n / bus_bandwidth (NCCL's bus bandwidth
definition) and starts when its layer's backward is done; it is hidden while the backward of
the layers below still runs. What is left exposed delays the optimizer step.

  python3 benchmarks/ddp_scaling_model.py [--busbw GB/s] [--gpus N] [--batch B]
"""
import argparse

p = argparse.ArgumentParser()
p.add_argument("--busbw", type=float, default=480.0, help="NCCL all-reduce bus bandwidth, GB/s")
p.add_argument("--gpus", type=int, default=8)
p.add_argument("--batch", type=int, default=8192, help="samples per GPU")
p.add_argument("--tflops", type=str, default="50,300,400,495", help="achieved matmul TFLOP/s to tabulate")
a = p.parse_args()

layers, width, fp32 = 4, 4096, 4
bucket_bytes = [(width * width + width) * fp32] * layers  # fc4, fc3, fc2, fc1 (reverse order)
comm_ms = [b * 2 * (a.gpus - 1) / a.gpus / (a.busbw * 1e9) * 1e3 for b in bucket_bytes]
matmul_gflop = 2 * a.batch * width * width / 1e9
print(f"buckets: {len(bucket_bytes)} x {bucket_bytes[0] / 2**20:.2f} MiB; all-reduce per bucket "
      f"{comm_ms[0]:.3f} ms at {a.busbw:.0f} GB/s bus bandwidth on {a.gpus} GPUs")
print(f"{'TFLOP/s':>8} {'fwd ms':>8} {'bwd/layer ms':>13} {'step ms':>8} {'exposed ms':>11} {'efficiency':>11}")
for f in (float(x) for x in a.tflops.split(",")):
    mm = matmul_gflop / f  # ms per matmul (GFLOP / TFLOP/s = ms)
    fwd = layers * mm
    bwd = [2 * mm] * (layers - 1) + [mm]  # fc4, fc3, fc2 need weight and input gradients; fc1 only weights
    # Timeline: compute runs back to back; each bucket's all-reduce starts when its layer is
    # done and after the previous bucket's (one NCCL stream).
    t, comm_end = fwd, 0.0
    for k in range(layers):
        t += bwd[k]
        comm_end = max(comm_end, t) + comm_ms[k]
    compute = t  # (the SGD step is a memory pass, ~0.2 ms, left out of both)
    step = max(compute, comm_end)
    print(f"{f:8.0f} {fwd:8.3f} {bwd[0]:13.3f} {step:8.3f} {step - compute:11.3f} {100 * compute / step:10.1f}%")

# ZeRO-1 (optim::ZeroRedundancyOptimizer: each GPU keeps and steps 1/n of the optimizer state,
# then every owner's updated parameters go to every GPU). Per GPU and step: the gradient
# all-reduce as above, plus receiving the (n - 1)/n of the parameters it does not own, after the
# optimizer step (not overlapped with compute in this model). Memory: fp32 parameters and
# gradients on every GPU; Adam's two moments (SGD momentum: one) on the owner only.
params = sum(bucket_bytes) // fp32
n = a.gpus
allreduce_bytes = 2 * (n - 1) / n * params * fp32
gather_bytes = (n - 1) / n * params * fp32
gather_ms = gather_bytes / (a.busbw * 1e9) * 1e3
print()
print(f"ZeRO-1 on {n} GPUs, {params / 1e6:.1f} M parameters:")
print(f"  bytes per GPU and step: DDP {allreduce_bytes / 2**20:.0f} MiB (all-reduce); ZeRO-1 "
      f"{(allreduce_bytes + gather_bytes) / 2**20:.0f} MiB (all-reduce + parameters from their owners, "
      f"+{gather_ms:.3f} ms exposed after the step)")
for name, states in (("SGD momentum", 1), ("Adam", 2)):
    plain = (2 + states) * params * fp32
    zero = 2 * params * fp32 + states * params * fp32 / n
    print(f"  {name:>12}: parameters + gradients + optimizer state per GPU {plain / 2**20:.0f} MiB plain, "
          f"{zero / 2**20:.0f} MiB ZeRO-1 ({100 * (1 - zero / plain):.0f} % less)")
