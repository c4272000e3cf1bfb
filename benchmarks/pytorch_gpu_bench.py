"""The GPU peer: chorus_gpu_bench's workloads in PyTorch — eager, nn.DataParallel and CUDA-graph
captured — timed with CUDA events, in rounds. With --chorus it also drives `chorus_gpu_bench
--serve` (Note [peer protocol] in benchmarks/peer.hpp) and alternates rounds with it (Note
[paired rounds] in benchmarks/bench_util.hpp), writing chorus's records too; then
scripts/compare_benchmarks.py takes every ratio round by round (median, min-max).

usage: pytorch_gpu_bench.py [--workloads tutorial,mlp-small,mlp-large,resnet20-cifar,lstm-lm,transformer-lm] [--rounds R]
                            [--repeats N] [--json FILE]
                            [--chorus CHORUS_GPU_BENCH [--chorus-env NAME=VALUE ...] [--chorus-json FILE]]

--chorus-env sets variables for chorus_gpu_bench only (its LD_LIBRARY_PATH, say); PyTorch keeps
this process's environment. Exit status 1 when any configuration of either side failed.

TF32: every row runs with TF32 off, for matrix products and for cuDNN's convolutions alike
(PyTorch's cuDNN default is on), except the rows labelled tf32, where both are on; chorus's rows
do the same (chorus::cuda::set_allow_tf32 covers cuBLAS and cuDNN).
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench_rounds import PeerProcess, drive


def mlp(i, h, o, layers):
    mods = [nn.Linear(i, h)]
    for _ in range(layers - 2):
        mods += [nn.ReLU(), nn.Linear(h, h)]
    mods += [nn.ReLU(), nn.Linear(h, o)]
    return nn.Sequential(*mods).cuda()


def step_fn(model, x, y, loss, momentum=0.0):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)

    def step():
        l = loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        l.backward()
        opt.step()
    return step


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


def set_tf32(on):
    """TF32 for matrix products and cuDNN convolutions together, as chorus's flag."""
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def prepare(meta):
    """Before every round of a PyTorch configuration: TF32 exactly as its label says."""
    set_tf32(meta["tf32"])


def cuda_clock(fn):
    """Milliseconds of one call, by CUDA events on the current stream."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def mlp_flops(batch, layers):
    f = 0.0
    for k, (i, o) in enumerate(layers):
        f += 2 * batch * i * o * (2 if k == 0 else 3)
    return f


# Timed steps per round (and untimed calls before the first): the same as chorus_gpu_bench's.
REPEATS = {"tutorial": 40, "mlp-small": 20, "mlp-large": 4, "resnet20-cifar": 10, "lstm-lm": 10, "transformer-lm": 20}

# The language models of benchmarks/lm_models.hpp: tokens [B, L] of a 96-symbol vocabulary ->
# Embedding(96, 256) -> the model -> Linear(256, 96), cross-entropy over all B*L positions, Adam.
LM_VOCAB, LM_WIDTH = 96, 256


class LstmLm(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(LM_VOCAB, LM_WIDTH)
        self.lstm = nn.LSTM(LM_WIDTH, LM_WIDTH, num_layers=2, batch_first=True)
        self.head = nn.Linear(LM_WIDTH, LM_VOCAB)

    def forward(self, tokens):
        return self.head(self.lstm(self.embed(tokens))[0])


class TransformerLm(nn.Module):
    SEQ = 128

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(LM_VOCAB, LM_WIDTH)
        self.pos = nn.Embedding(self.SEQ, LM_WIDTH)
        layer = nn.TransformerEncoderLayer(LM_WIDTH, 4, dim_feedforward=1024, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(LM_WIDTH, LM_VOCAB)

    def forward(self, tokens):
        length = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.encoder(x.transpose(0, 1), mask).transpose(0, 1))


def lm_step(model, batch, length):
    model = model.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randint(0, LM_VOCAB, (batch, length), device="cuda")
    y = torch.randint(0, LM_VOCAB, (batch * length,), device="cuda")

    def step():
        loss = F.cross_entropy(model(x).reshape(-1, LM_VOCAB), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def lm_flops(kind):
    """As bench::lstm_lm_step_flops / bench::transformer_lm_step_flops."""
    if kind == "lstm-lm":
        b, s, h = 64, 64, LM_WIDTH
        return 6.0 * b * s * (2 * 4 * h * (h + h) + h * LM_VOCAB)
    b, s, d, ff = 32, 128, LM_WIDTH, 1024
    return 6.0 * b * s * (4 * (4 * d * d + 2 * d * ff + 2 * s * d) + d * LM_VOCAB)


def offers(w):
    """PyTorch's configurations of workload w: (record fields, build -> step, warm-up calls)."""
    def meta(impl, config, flops=0.0, tf32=False):
        return dict(impl=impl, workload=w, config=config, devices=1, threads=0, flops=flops, tf32=tf32,
                    version=torch.__version__)
    if w == "tutorial":  # Linear(5, 2), 100 samples on the host, batches of 30, forward only
        def build():
            data = torch.randn(100, 5)
            model = nn.DataParallel(nn.Linear(5, 2).cuda(), device_ids=[0])

            def epoch():
                perm = torch.randperm(100)
                for s in range(0, 100, 30):
                    model(data[perm[s:s + 30]])
            return epoch
        return [(meta("pytorch-dataparallel", "DataParallel 1 GPU"), build, 20)]
    if w == "mlp-small":
        flops = mlp_flops(256, [(784, 512), (512, 512), (512, 10)])
        def small():
            return torch.randn(256, 784, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
        return [(meta("pytorch-eager", "1 GPU", flops),
                 lambda: step_fn(mlp(784, 512, 10, 3), *small(), F.cross_entropy), 10),
                (meta("pytorch-cudagraph", "1 GPU", flops),
                 lambda: graphed(mlp(784, 512, 10, 3), *small(), F.cross_entropy), 10)]
    if w == "mlp-large":  # nn.DataParallel on [0, 0] is refused by PyTorch (duplicate device ids)
        flops = mlp_flops(8192, [(4096, 4096)] * 4)
        def large():
            return torch.randn(8192, 4096, device="cuda"), torch.randn(8192, 4096, device="cuda")
        out = []
        for tf32 in (False, True):  # built under its setting (Local calls set_tf32 first)
            name = "1 GPU " + ("tf32" if tf32 else "fp32")
            out += [(meta("pytorch-eager", name, flops, tf32),
                     lambda: step_fn(mlp(4096, 4096, 4096, 4), *large(), F.mse_loss), 3),
                    (meta("pytorch-cudagraph", name, flops, tf32),
                     lambda: graphed(mlp(4096, 4096, 4096, 4), *large(), F.mse_loss), 3)]
        return out
    if w == "resnet20-cifar":
        # Batch 128, SGD with momentum, eager, NCHW and channels_last (cuDNN's preferred NHWC
        # layout; the input and the weights converted once, outside the step).
        flops = 6.0 * 40551040 * 128  # as bench::resnet20_step_flops
        out = []
        for channels_last in (False, True):
            fmt = torch.channels_last if channels_last else torch.contiguous_format

            def build(fmt=fmt):
                model = ResNet20().cuda().to(memory_format=fmt)
                x = torch.randn(128, 3, 32, 32, device="cuda").to(memory_format=fmt)
                y = torch.randint(0, 10, (128,), device="cuda")
                return step_fn(model, x, y, F.cross_entropy, momentum=0.9)
            name = "1 GPU fp32" + (" channels_last" if channels_last else "")
            out.append((meta("pytorch-eager", name, flops), build, 10))
        return out
    if w == "lstm-lm":  # batch 64, sequence 64; cuDNN's LSTM, as PyTorch picks it
        return [(meta("pytorch-eager", "1 GPU fp32", lm_flops(w)), lambda: lm_step(LstmLm(), 64, 64), 5)]
    if w == "transformer-lm":  # batch 32, sequence 128
        return [(meta("pytorch-eager", "1 GPU fp32", lm_flops(w)),
                 lambda: lm_step(TransformerLm(), 32, TransformerLm.SEQ), 5)]
    raise ValueError(f"unknown workload '{w}'")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="tutorial,mlp-small,mlp-large,resnet20-cifar,lstm-lm,transformer-lm")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=0, help="timed steps per round (default: per workload)")
    ap.add_argument("--json", default="pytorch_gpu_bench.json")
    ap.add_argument("--chorus", help="chorus_gpu_bench, run as a server whose rounds alternate with these")
    ap.add_argument("--chorus-env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--chorus-json", default="chorus_gpu_bench.json")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    torch.manual_seed(0)
    chorus = None
    if args.chorus:
        env = dict(os.environ)
        env.update(kv.split("=", 1) for kv in args.chorus_env)
        chorus = PeerProcess([args.chorus, "--serve"], env=env)
    mine, theirs = drive(args.workloads.split(","), offers, lambda w: args.repeats or REPEATS.get(w, 5), args.rounds,
                         peer=chorus, peer_name="chorus", local_name="pytorch", clock=cuda_clock,
                         prepare=prepare, after_workload=torch.cuda.empty_cache,
                         paths=(args.json, args.chorus_json if chorus else None), rate=("tflops", 1e9))
    set_tf32(False)
    print(f"wrote {args.json}" + (f" and {args.chorus_json}" if chorus else ""))
    return 1 if mine["errors"] or theirs["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
