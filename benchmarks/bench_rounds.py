"""Rounds, paired ratios and the peer protocol for the Python side of the benchmarks: the same
logic as benchmarks/bench_util.hpp and peer.hpp (Note [paired rounds], Note [peer protocol]).
Used by pytorch_gpu_bench.py (which drives chorus_gpu_bench --serve) and by
scripts/compare_benchmarks.py and plot_benchmarks.py; tested by test_bench_rounds.py."""
import json
import os
import statistics
import subprocess
import time
import uuid


def spread(values):
    """{"median", "min", "max"} of some values."""
    if not values:
        raise ValueError("spread of no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired_ratios(num, den):
    """num[i] / den[i] for each round i: the same rounds on both sides, positive times."""
    if len(num) != len(den) or not num:
        raise ValueError(f"paired ratios need the same number of rounds on both sides (got {len(num)} and {len(den)})")
    if any(not (x > 0) for x in list(num) + list(den)):
        raise ValueError("paired ratios of a non-positive time")
    return [a / b for a, b in zip(num, den)]


def paired(num_record, den_record):
    """The per-round ratios of two records' round_ms, with their median, min and max."""
    r = paired_ratios(num_record["round_ms"], den_record["round_ms"])
    return dict(spread(r), rounds=r)


def round_order(a, b, rnd):
    """Indices 0..a-1 (one side) and a..a+b-1 (the other) alternating, the longer side's rest at
    the end; odd rounds backwards."""
    order = []
    for i in range(max(a, b)):
        if i < a:
            order.append(i)
        if i < b:
            order.append(a + i)
    return order[::-1] if rnd % 2 else order


def run_rounds(a, b, rounds, reps):
    """a, b: lists of callables round(reps) -> list of times. Returns samples[config][round]."""
    entries = list(a) + list(b)
    samples = [[] for _ in entries]
    for r in range(rounds):
        for i in round_order(len(a), len(b), r):
            samples[i].append(entries[i](reps))
    return samples


def make_record(meta, samples, rate_key="tflops", rate_scale=1e9):
    """meta plus every round's times, the per-round medians (round_ms) and their median/min/max."""
    rec = dict(meta)
    round_ms = [statistics.median(s) for s in samples]
    s = spread(round_ms)
    rec.update(median_ms=s["median"], min_ms=s["min"], max_ms=s["max"], rounds=len(samples),
               repeats=len(samples[0]) if samples else 0, round_ms=round_ms, samples_ms=samples)
    flops = rec.pop("flops", 0) or 0
    if flops > 0:
        rec[rate_key] = flops / (s["median"] * rate_scale)
    return rec


class Timed:
    """One configuration measured in rounds: `warmup` untimed calls before the first round, one
    before each later round (a GPU clock: the caller paces warm-up by count)."""

    def __init__(self, step, warmup, clock):
        self.step, self.warmup, self.clock, self.first = step, warmup, clock, True

    def __call__(self, reps):
        for _ in range(max(1, self.warmup) if self.first else 1):
            self.step()
        self.first = False
        return [self.clock(self.step) for _ in range(reps)]


class PeerError(RuntimeError):
    pass


class PeerProcess:
    """A server by Note [peer protocol] (e.g. chorus_gpu_bench --serve) on pipes."""

    def __init__(self, argv, env=None, stderr=None):
        self.name = " ".join(argv)
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env,
                                  text=True, bufsize=1)

    def request(self, req):
        try:
            self.p.stdin.write(json.dumps(req) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            raise PeerError(f"peer {self.name} is gone (writing {json.dumps(req)})")
        line = self.p.stdout.readline()
        if not line:
            raise PeerError(f"peer {self.name} exited (status {self.p.poll()}) without answering {json.dumps(req)}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(f"peer: {reply['error']} (for {json.dumps(req)})")
        return reply

    def configs(self, workload):
        return self.request({"cmd": "configs", "workload": workload})["configs"]

    def round_fn(self, workload, config):
        return lambda reps: self.request({"cmd": "round", "workload": workload, "config": config,
                                          "reps": reps})["samples_ms"]

    def release(self, workload):
        self.request({"cmd": "release", "workload": workload})

    def alive(self):
        return self.p.poll() is None

    def close(self, timeout=30):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()
        finally:
            self.p.stdout.close()


def wall_clock(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


class Guarded:
    """One configuration in the rounds; after a failure it is skipped, its error recorded once."""

    def __init__(self, meta, fn, errors):
        self.meta, self.fn, self.errors, self.failed = meta, fn, errors, False

    def __call__(self, reps):
        if self.failed:
            return None
        try:
            return self.fn(reps)
        except Exception as e:  # one failed configuration must not stop the other side's rounds
            self.failed = True
            self.errors.append(dict(workload=self.meta.get("workload"), config=self.meta.get("config"), error=str(e)))
            print(f"  error in {self.meta.get('impl')} {self.meta.get('workload')} {self.meta.get('config')}: {e}",
                  flush=True)
            return None


class Local:
    """A configuration of this process, built at its first round, after prepare(meta) (which
    runs before every round: TF32 on or off, say)."""

    def __init__(self, meta, build, warmup, clock, prepare):
        self.meta, self.build, self.warmup, self.clock, self.prepare = meta, build, warmup, clock, prepare
        self.timed = None

    def __call__(self, reps):
        if self.prepare:
            self.prepare(self.meta)
        if self.timed is None:
            self.timed = Timed(self.build(), self.warmup, self.clock)
        return self.timed(reps)


def drive(workloads, offers, reps_for, rounds, peer=None, peer_name="peer", local_name="local", clock=wall_clock,
          prepare=None, after_workload=None, paths=(None, None), rate=("tflops", 1e9)):
    """Per workload, `rounds` rounds alternating the peer's configurations (a PeerProcess, one
    side) with this process's (offers(w) -> [(record fields, build, warm-up calls)], the other),
    reps_for(w) timed calls each. A failing configuration is recorded and left out; a peer that
    died is recorded and the local rounds go on. Returns (local document, peer document), both
    with the same run_id (compare_benchmarks.py pairs rounds only then); writes them to paths
    (local, peer) after every workload, so a timeout still leaves what was measured."""
    run_id = uuid.uuid4().hex
    mine = dict(records=[], errors=[], run_id=run_id, rounds=rounds, interleaved_with=peer_name if peer else None)
    theirs = dict(records=[], errors=[], run_id=run_id, rounds=rounds, interleaved_with=local_name)

    def write():
        for doc, path in ((mine, paths[0]), (theirs, paths[1] if peer else None)):
            if path:
                with open(path + ".tmp", "w") as f:
                    json.dump(doc, f, indent=2)
                os.replace(path + ".tmp", path)

    for w in workloads:
        reps = reps_for(w)
        a, b = [], []
        if peer:
            try:
                if not peer.alive():
                    raise PeerError(f"{peer.name} exited (status {peer.p.poll()})")
                for m in peer.configs(w):
                    a.append(Guarded(m, peer.round_fn(w, m["config"]), theirs["errors"]))
            except Exception as e:
                theirs["errors"].append(dict(workload=w, error=str(e)))
                print(f"  error in {peer_name} {w}: {e}", flush=True)
        try:
            for m, build, warmup in offers(w):
                b.append(Guarded(m, Local(m, build, warmup, clock, prepare), mine["errors"]))
        except Exception as e:
            mine["errors"].append(dict(workload=w, error=str(e)))
            print(f"  error in {local_name} {w}: {e}", flush=True)
        print(f"{w}: {rounds} rounds of {len(a)} {peer_name} + {len(b)} {local_name} configurations, "
              f"{reps} timed calls each", flush=True)
        samples = run_rounds(a, b, rounds, reps)
        for k, (entry, s) in enumerate(zip(a + b, samples)):
            if entry.failed or any(x is None for x in s):
                continue
            rec = make_record(entry.meta, s, *rate)
            (theirs if k < len(a) else mine)["records"].append(rec)
            print(f"  {rec.get('impl', ''):22s} {w:14s} {rec.get('config', ''):36s} median {rec['median_ms']:9.3f} ms "
                  f"(rounds {rec['min_ms']:.3f}-{rec['max_ms']:.3f})", flush=True)
        if peer and a and peer.alive():
            try:
                peer.release(w)
            except Exception as e:
                theirs["errors"].append(dict(workload=w, error=f"release: {e}"))
        del a, b, samples
        if after_workload:
            after_workload()
        write()
    if peer:
        rc = peer.close()
        if rc != 0:
            theirs["errors"].append(dict(error=f"{peer.name} exited with status {rc}"))
    write()
    return mine, theirs
