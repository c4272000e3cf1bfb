#!/usr/bin/env python3
"""Merges the Chrome traces of a job's ranks (chorus::profiler writes one file per rank, its
process named "chorus rank R") into one file that Perfetto or chrome://tracing opens: a process
per rank, the ranks' clocks aligned on the wall-clock start each file records
(otherData.origin_unix_ns).

usage: merge_traces.py OUT.json RANK0.json RANK1.json ...
"""
import argparse
import json
import sys


def merge(paths):
    """The merged trace (a dict) of the files at `paths`."""
    traces = []
    for path in paths:
        with open(path) as f:
            trace = json.load(f)
        if "traceEvents" not in trace:
            sys.exit(f"merge_traces: {path} is not a Chrome trace (no traceEvents)")
        traces.append(trace)
    origins = [t.get("otherData", {}).get("origin_unix_ns", 0) for t in traces]
    base = min(origins)
    events, ranks = [], []
    for i, (path, trace) in enumerate(zip(paths, traces)):
        rank = trace.get("otherData", {}).get("rank", -1)
        pid = rank if rank is not None and rank >= 0 else i
        if pid in ranks:
            sys.exit(f"merge_traces: {path} is rank {pid} too; pass each rank's file once")
        ranks.append(pid)
        shift_us = (origins[i] - base) / 1e3
        for e in trace["traceEvents"]:
            e = dict(e)
            e["pid"] = pid
            if "ts" in e:
                e["ts"] = e["ts"] + shift_us
            events.append(e)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"library": "chorus", "ranks": ranks, "origin_unix_ns": base, "merged_from": list(paths)},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", help="the merged trace to write")
    ap.add_argument("inputs", nargs="+", help="one trace per rank")
    args = ap.parse_args()
    merged = merge(args.inputs)
    with open(args.output, "w") as f:
        json.dump(merged, f)
    print(f"merge_traces: {len(args.inputs)} ranks, {len(merged['traceEvents'])} events -> {args.output}")


if __name__ == "__main__":
    main()
