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

# ZeRO-2 (DistributedDataParallel::shard_gradients): each bucket is reduced to its owner (half an
# all-reduce's bytes, at the same bus bandwidth) and, after the owners' steps, the parameters go
# from the owners to every GPU as under ZeRO-1: 2 Psi bytes a step, as DDP's all-reduce.
# ZeRO-3 (FullyShardedDataParallel, each Linear a unit, prefetch on): a layer's parameters are
# all-gathered before its forward and again before its backward, its gradients reduce-scattered
# after it: 3 Psi bytes. The timeline follows the implementation (Note [fully sharded parameters]):
# one communication stream; in forward a layer's gather is issued with the next one's; in backward
# the first layer's gather is issued when backward starts, each layer then issues the previous
# layer's gather once its own is in, and a layer's reduce-scatter waits for the last one's.
layer_bytes = bucket_bytes[0]
gather_layer_ms = layer_bytes * (n - 1) / n / (a.busbw * 1e9) * 1e3  # all-gather or reduce-scatter
print()
print(f"ZeRO-2 and ZeRO-3 on {n} GPUs (one unit per layer; all-gather or reduce-scatter of a layer "
      f"{gather_layer_ms:.3f} ms):")
print(f"  bytes per GPU and step: DDP {allreduce_bytes / 2**20:.0f} MiB; ZeRO-2 {allreduce_bytes / 2**20:.0f} MiB; "
      f"ZeRO-3 {1.5 * allreduce_bytes / 2**20:.0f} MiB")
print(f"{'TFLOP/s':>8} {'DDP exposed':>12} {'ZeRO-2 exposed':>15} {'ZeRO-3 exposed':>15} {'ZeRO-3 efficiency':>18}")
for f in (float(x) for x in a.tflops.split(",")):
    mm = matmul_gflop / f
    bwd = [mm] + [2 * mm] * (layers - 1)  # fc1 (weights only), fc2, fc3, fc4
    free = 0.0  # when the communication stream is free

    def collective(issued):
        global free
        free = max(free, issued) + gather_layer_ms
        return free

    t, ready = 0.0, {0: collective(0.0)}
    for k in range(layers):  # forward: fc1 … fc4
        if k + 1 < layers:
            ready[k + 1] = collective(t)
        t = max(t, ready[k]) + mm
    compute = layers * mm + sum(bwd)
    ready = {layers - 1: collective(t)}
    reduced = 0.0
    for k in reversed(range(layers)):  # backward: fc4 … fc1
        t = max(t, ready[k])
        if k > 0:
            ready[k - 1] = collective(t)
        t = max(t + bwd[k], reduced)
        reduced = collective(t)
    step = max(t, reduced)
    # DDP's timeline (as above), and ZeRO-2's: reduces (half an all-reduce's time) and the
    # parameters' broadcast from their owners after the step.
    bwd_rev = list(reversed(bwd))  # fc4 … fc1
    ddp_t, ddp_end, zero2_end = layers * mm, 0.0, 0.0
    for k in range(layers):
        ddp_t += bwd_rev[k]
        ddp_end = max(ddp_end, ddp_t) + comm_ms[k]
        zero2_end = max(zero2_end, ddp_t) + gather_layer_ms
    zero2_exposed = max(ddp_t, zero2_end) - ddp_t + gather_ms
    print(f"{f:8.0f} {max(ddp_t, ddp_end) - ddp_t:10.3f}ms {zero2_exposed:13.3f}ms {step - compute:13.3f}ms "
          f"{100 * compute / step:17.1f}%")
