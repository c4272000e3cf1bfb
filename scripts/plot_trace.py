#!/usr/bin/env python3
"""Draws one step of a chorus::profiler trace (Chrome trace JSON, one rank's file or a merged one
from merge_traces.py) as a PNG timeline: a lane per process and thread (device streams, the
communication lanes, the main thread), spans coloured by what they were (forward, backward,
communication, copy, optimizer, data), nested spans drawn over their parents.

usage: plot_trace.py TRACE.json OUT.png [--step N] [--title TEXT]   (needs: pip install matplotlib)
       By default the last step but one (the last full step of a recording that stopped mid-step).
"""
import argparse
import json
import sys

COLOURS = {
    "forward": "#4c78a8",
    "backward": "#f58518",
    "communication": "#e45756",
    "copy": "#9d9d9d",
    "optimizer": "#54a24b",
    "data": "#b279a2",
    "other": "#d8d8d8",
}


def lanes_of(trace, step):
    """{(pid, tid): [span events of `step`]}, the lane names and the step's start (us)."""
    names, procs, lanes = {}, {}, {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "X" and e.get("args", {}).get("step") == step:
            lanes.setdefault((e["pid"], e["tid"]), []).append(e)
    if not lanes:
        sys.exit(f"plot_trace: no spans of step {step} in the trace")
    start = min(e["ts"] for spans in lanes.values() for e in spans)
    several = len({pid for pid, _ in lanes}) > 1
    labels = {}
    for key in lanes:
        label = names.get(key, f"thread {key[1]}")
        labels[key] = f"{procs.get(key[0], key[0])}: {label}" if several else label
    return lanes, labels, start


def lane_order(key, label):
    """Main threads first, then device streams, then communication lanes and other threads."""
    name = label.split(": ")[-1]
    kind = 0 if name == "main" else 1 if " stream " in name else 2 if name.startswith("comm") else 3
    return (key[0], kind, name)


def steps_of(trace):
    return sorted({e["args"]["step"] for e in trace["traceEvents"] if e.get("ph") == "X" and "step" in e.get("args", {})})


def plot(trace, out, step=None, title=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    steps = steps_of(trace)
    if not steps:
        sys.exit("plot_trace: the trace has no spans")
    if step is None:
        step = steps[-2] if len(steps) > 1 else steps[0]
    lanes, labels, start = lanes_of(trace, step)
    keys = sorted(lanes, key=lambda k: lane_order(k, labels[k]))
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(keys) + 1.2))
    end = 0.0
    for row, key in enumerate(keys):
        y = len(keys) - 1 - row
        # Longest first, so that nested spans are drawn over their parents.
        for e in sorted(lanes[key], key=lambda e: -e["dur"]):
            x0, w = (e["ts"] - start) / 1e3, e["dur"] / 1e3
            end = max(end, x0 + w)
            ax.broken_barh([(x0, max(w, 1e-4))], (y - 0.38, 0.76), facecolors=COLOURS.get(e.get("cat"), "#d8d8d8"),
                           edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([labels[k] for k in reversed(keys)], fontsize=8)
    ax.set_xlim(0, end * 1.01 if end > 0 else 1)
    ax.set_xlabel("ms from the step's first span")
    ax.set_title(title or f"step {step}", fontsize=10, loc="left", pad=22)
    used = sorted({e.get("cat") for spans in lanes.values() for e in spans} & COLOURS.keys(), key=list(COLOURS).index)
    ax.legend(handles=[Patch(color=COLOURS[c], label=c) for c in used], loc="lower right", bbox_to_anchor=(1.0, 1.0),
              ncol=len(used), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("output")
    ap.add_argument("--step", type=int, default=None, help="the step to draw (default: the last but one)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    step = plot(trace, args.output, args.step, args.title)
    print(f"plot_trace: step {step} -> {args.output}")


if __name__ == "__main__":
    main()
