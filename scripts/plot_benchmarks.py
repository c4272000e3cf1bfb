#!/usr/bin/env python3
"""Plots benchmark JSON (from chorus_bench, and from pytorch_gpu_bench.py) as one PNG:
time per workload for chorus and its peer, and DataParallel scaling against device count.

usage: plot_benchmarks.py OUT.png BENCH.json [MORE.json ...]   (needs: pip install matplotlib)
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(paths):
    records = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        records += doc["records"] if isinstance(doc, dict) else doc
    return records


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, records = sys.argv[1], load(sys.argv[2:])
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))

    # Left: median time per workload and configuration, chorus next to its peer.
    ax = axes[0]
    labels, chorus_ms, peer_ms = [], [], []
    for w in workloads:
        for r in records:
            if r["impl"] != "chorus" or r["workload"] != w:
                continue
            peer = [p for p in records if p["impl"] != "chorus" and p["workload"] == w and p["threads"] == r["threads"]]
            labels.append(f"{w}\n{r['config']}")
            chorus_ms.append(r["median_ms"])
            peer_ms.append(min(p["median_ms"] for p in peer) if peer else 0)
    x = range(len(labels))
    ax.barh([i + 0.2 for i in x], chorus_ms, height=0.4, label="chorus")
    ax.barh([i - 0.2 for i in x], peer_ms, height=0.4, label="peer (LibTorch / PyTorch)")
    ax.set_yticks(list(x))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("median time per step / epoch (ms, log scale)")
    ax.set_title("chorus and its peer, same thread count")
    ax.legend(fontsize=8)

    # Right: DataParallel speed-up against device count.
    ax = axes[1]
    for w in workloads:
        dp = sorted((r["devices"], r["median_ms"]) for r in records
                    if r["impl"] == "chorus" and r["workload"] == w and r["config"].startswith("DataParallel"))
        if len(dp) < 2:
            continue
        base = dict(dp).get(1, dp[0][1])
        ax.plot([d for d, _ in dp], [base / t for _, t in dp], marker="o", label=w)
    ax.plot([1, 2], [1, 2], "k:", label="ideal")
    ax.set_xlabel("devices")
    ax.set_ylabel("speed-up over 1 device")
    ax.set_title("DataParallel scaling")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
