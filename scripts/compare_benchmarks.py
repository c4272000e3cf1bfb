#!/usr/bin/env python3
"""Prints chorus's GPU benchmark results against PyTorch's, measured in the same run, with the
targets of the benchmark issue, and writes the comparison as JSON.

usage: compare_benchmarks.py CHORUS.json PYTORCH.json [OUT.json]
"""
import json
import sys


def load(p):
    with open(p) as f:
        d = json.load(f)
    return d["records"] if isinstance(d, dict) else d


def find(records, impl, workload, config):
    for r in records:
        if r["impl"] == impl and r["workload"] == workload and r["config"] == config:
            return r
    return None


# (workload, chorus config, peer impl, peer config, target ratio)
TARGETS = [
    ("tutorial", "DataParallel 1 GPU", "pytorch-dataparallel", "DataParallel 1 GPU", 0.25),
    ("mlp-small", "1 GPU", "pytorch-eager", "1 GPU", 0.25),
    ("mlp-small", "1 GPU", "pytorch-cudagraph", "1 GPU", None),
    ("mlp-large", "1 GPU fp32", "pytorch-eager", "1 GPU fp32", 1.0),
    ("mlp-large", "1 GPU tf32", "pytorch-eager", "1 GPU tf32", 1.0),
    ("mlp-large", "1 GPU fp32", "pytorch-cudagraph", "1 GPU fp32", None),
    ("mlp-large", "1 GPU tf32", "pytorch-cudagraph", "1 GPU tf32", None),
    ("mlp-large", "DataParallel {cuda:0, cuda:0} fp32", "chorus", "1 GPU fp32", 1.15),
    ("resnet20-cifar", "1 GPU fp32", "pytorch-eager", "1 GPU fp32", 1.0),
    ("resnet20-cifar", "1 GPU fp32", "pytorch-eager", "1 GPU fp32 channels_last", None),
]


def main():
    chorus, peer = load(sys.argv[1]), load(sys.argv[2])
    rows = []
    print(f"{'workload':10s} {'chorus configuration':36s} {'chorus ms':>10s} {'peer':34s} {'peer ms':>10s} "
          f"{'ratio':>7s} {'target':>7s}")
    for w, cc, pi, pc, target in TARGETS:
        c = find(chorus, "chorus", w, cc)
        p = find(chorus if pi == "chorus" else peer, pi, w, pc)
        if not c or not p:
            continue
        ratio = c["median_ms"] / p["median_ms"]
        ok = None if target is None else ratio <= target
        rows.append(dict(workload=w, chorus_config=cc, chorus_ms=c["median_ms"], peer=f"{pi} {pc}",
                         peer_ms=p["median_ms"], ratio=ratio, target=target, met=ok))
        mark = "" if ok is None else ("  met" if ok else "  MISSED")
        print(f"{w:10s} {cc:36s} {c['median_ms']:10.3f} {pi + ' ' + pc:34s} {p['median_ms']:10.3f} {ratio:6.2f}x "
              f"{'' if target is None else f'<={target}':>7s}{mark}")
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
