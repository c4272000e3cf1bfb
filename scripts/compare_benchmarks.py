#!/usr/bin/env python3
"""Prints chorus's GPU benchmark results against PyTorch's with the targets of the benchmark
issue, and writes the comparison as JSON.

Each ratio is taken round by round (Note [paired rounds] in benchmarks/bench_util.hpp): chorus's
round i against the peer's round i, reported as the median with its min-max. That pairing holds
only for two files of one interleaved run (`pytorch_gpu_bench.py --chorus ...`: the same run_id);
two files from separate runs get the ratio of their medians, marked "unpaired". A target is met
when the median ratio is at most the target.

usage: compare_benchmarks.py CHORUS.json PYTORCH.json [OUT.json]
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_rounds import paired  # noqa: E402


def load(p):
    with open(p) as f:
        d = json.load(f)
    return d if isinstance(d, dict) else {"records": d}


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
    ("lstm-lm", "1 GPU fp32", "pytorch-eager", "1 GPU fp32", None),
    ("transformer-lm", "1 GPU fp32", "pytorch-eager", "1 GPU fp32", None),
]


def ratio(c, p, pairable):
    """{"median", "min", "max", "paired", "rounds"} of chorus record c against peer record p."""
    if pairable and c.get("round_ms") and p.get("round_ms") and len(c["round_ms"]) == len(p["round_ms"]):
        return dict(paired(c, p), paired=True)
    r = c["median_ms"] / p["median_ms"]
    return {"median": r, "min": r, "max": r, "paired": False, "rounds": []}


def compare(chorus_doc, peer_doc):
    """The rows of TARGETS found in the two documents."""
    chorus, peer = chorus_doc["records"], peer_doc["records"]
    same_run = chorus_doc.get("run_id") is not None and chorus_doc.get("run_id") == peer_doc.get("run_id")
    rows = []
    for w, cc, pi, pc, target in TARGETS:
        c = find(chorus, "chorus", w, cc)
        p = find(chorus if pi == "chorus" else peer, pi, w, pc)
        if not c or not p:
            continue
        q = ratio(c, p, same_run or pi == "chorus")  # chorus against itself: the same rounds
        ok = None if target is None else q["median"] <= target
        rows.append(dict(workload=w, chorus_config=cc, chorus_ms=c["median_ms"], peer=f"{pi} {pc}",
                         peer_ms=p["median_ms"], ratio=q["median"], ratio_min=q["min"], ratio_max=q["max"],
                         paired=q["paired"], round_ratios=q["rounds"], target=target, met=ok))
    return rows


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rows = compare(load(sys.argv[1]), load(sys.argv[2]))
    print(f"{'workload':14s} {'chorus configuration':36s} {'chorus ms':>10s} {'peer':36s} {'peer ms':>10s} "
          f"{'ratio [min-max]':>20s} {'target':>7s}")
    for r in rows:
        spread = (f"{r['ratio']:.2f}x [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}]" if r["paired"]
                  else f"{r['ratio']:.2f}x unpaired")
        mark = "" if r["met"] is None else ("  met" if r["met"] else "  MISSED")
        target = "" if r["target"] is None else f"<={r['target']}"
        print(f"{r['workload']:14s} {r['chorus_config']:36s} {r['chorus_ms']:10.3f} {r['peer']:36s} "
              f"{r['peer_ms']:10.3f} {spread:>20s} {target:>7s}{mark}")
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
