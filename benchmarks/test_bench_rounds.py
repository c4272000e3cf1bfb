"""The Python side of the benchmarks' round logic (bench_rounds.py; Note [paired rounds] in
bench_util.hpp): pairing, spreads, the order, records, and drive() against the C++ server of
Note [peer protocol] (test_bench_util started with BENCH_UTIL_SERVE=1; the path in
BENCH_UTIL_SERVER, set by CTest). Nothing here is timed."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rounds as br  # noqa: E402


class Pairing(unittest.TestCase):
    def test_ratios_are_taken_round_by_round(self):
        self.assertEqual(br.paired_ratios([1, 4, 4], [2, 2, 8]), [0.5, 2, 0.5])
        self.assertEqual(br.spread(br.paired_ratios([1, 3, 2], [2, 2, 2])), {"median": 1.0, "min": 0.5, "max": 1.5})

    def test_refuses_unequal_rounds_and_non_positive_times(self):
        for num, den in (([1, 2], [1]), ([], []), ([1], [0])):
            with self.assertRaises(ValueError):
                br.paired_ratios(num, den)

    def test_order_alternates_and_reverses(self):
        self.assertEqual(br.round_order(4, 3, 0), [0, 4, 1, 5, 2, 6, 3])
        self.assertEqual(br.round_order(4, 3, 1), [3, 6, 2, 5, 1, 4, 0])
        self.assertEqual(br.round_order(1, 3, 0), [0, 1, 2, 3])

    def test_run_rounds_alternates_the_sides(self):
        log = []
        entry = lambda name: (lambda reps: log.append(name) or [1.0] * reps)
        samples = br.run_rounds([entry("a0"), entry("a1")], [entry("b0")], 3, 2)
        self.assertEqual(log, ["a0", "b0", "a1", "a1", "b0", "a0", "a0", "b0", "a1"])
        self.assertEqual(samples[2], [[1.0, 1.0]] * 3)

    def test_record_and_paired(self):
        r = br.make_record({"impl": "x", "flops": 6e9}, [[1, 9, 2], [4, 4, 5], [3, 1, 3]])
        self.assertEqual(r["round_ms"], [2, 4, 3])
        self.assertEqual((r["median_ms"], r["min_ms"], r["max_ms"], r["rounds"], r["repeats"]), (3, 2, 4, 3, 3))
        self.assertAlmostEqual(r["tflops"], 6e9 / (3 * 1e9))
        self.assertNotIn("flops", r)
        q = br.paired(r, br.make_record({}, [[4], [8], [12]]))
        self.assertEqual((q["median"], q["min"], q["max"]), (0.5, 0.25, 0.5))

    def test_timed_warms_up_first_round_then_once(self):
        calls = []
        t = br.Timed(lambda: calls.append(1), 4, lambda f: f() or 1.0)
        self.assertEqual(t(3), [1.0] * 3)
        self.assertEqual(len(calls), 4 + 3)
        t(2)
        self.assertEqual(len(calls), 7 + 1 + 2)


class CompareBenchmarks(unittest.TestCase):
    """scripts/compare_benchmarks.py pairs rounds only within one interleaved run."""

    def docs(self, run_ids):
        rec = lambda impl, w, c, rounds: br.make_record(dict(impl=impl, workload=w, config=c), [[x] for x in rounds])
        chorus = dict(run_id=run_ids[0], records=[rec("chorus", "mlp-small", "1 GPU", [1, 4, 4]),
                                                  rec("chorus", "mlp-large", "1 GPU fp32", [2, 2, 2]),
                                                  rec("chorus", "mlp-large", "DataParallel {cuda:0, cuda:0} fp32",
                                                      [2, 3, 2])])
        torch = dict(run_id=run_ids[1], records=[rec("pytorch-eager", "mlp-small", "1 GPU", [2, 2, 8])])
        return chorus, torch

    def setUp(self):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
        import compare_benchmarks
        self.cb = compare_benchmarks

    def test_paired_in_one_run(self):
        rows = {(r["workload"], r["chorus_config"], r["peer"]): r for r in self.cb.compare(*self.docs(["x", "x"]))}
        r = rows[("mlp-small", "1 GPU", "pytorch-eager 1 GPU")]
        self.assertTrue(r["paired"])
        self.assertEqual((r["ratio"], r["ratio_min"], r["ratio_max"]), (0.5, 0.5, 2))
        self.assertEqual(r["round_ratios"], [0.5, 2, 0.5])
        self.assertFalse(r["met"])  # target 0.25 against the median 0.5
        # chorus against itself is always paired (one file, the same rounds)
        dp = rows[("mlp-large", "DataParallel {cuda:0, cuda:0} fp32", "chorus 1 GPU fp32")]
        self.assertEqual((dp["ratio"], dp["ratio_max"], dp["paired"], dp["met"]), (1.0, 1.5, True, True))

    def test_unpaired_across_runs(self):
        rows = self.cb.compare(*self.docs(["x", "y"]))
        r = next(r for r in rows if r["peer"] == "pytorch-eager 1 GPU")
        self.assertFalse(r["paired"])
        self.assertEqual(r["ratio"], 4 / 2)  # the medians' ratio
        self.assertEqual(r["round_ratios"], [])


class PytorchGpuBenchTf32(unittest.TestCase):
    """Like for like (issue 17, item 12): each PyTorch row runs with TF32 for matrix products and
    for cuDNN exactly as its label says; PyTorch's own default leaves cuDNN's on. Checked against
    a stand-in for torch (no GPU, no PyTorch here): the flags are all this touches."""

    def test_every_row_sets_both_flags_as_labelled(self):
        import types
        from unittest import mock
        torch = types.ModuleType("torch")
        torch.__version__ = "stand-in"
        torch.nn = types.ModuleType("torch.nn")
        torch.nn.Module = object
        torch.nn.functional = types.ModuleType("torch.nn.functional")
        torch.channels_last, torch.contiguous_format = "channels_last", "contiguous"
        ns = types.SimpleNamespace
        torch.backends = ns(cuda=ns(matmul=ns(allow_tf32=False)), cudnn=ns(allow_tf32=True))  # PyTorch's defaults
        with mock.patch.dict(sys.modules, {"torch": torch, "torch.nn": torch.nn,
                                           "torch.nn.functional": torch.nn.functional}):
            sys.modules.pop("pytorch_gpu_bench", None)
            import pytorch_gpu_bench as pgb
            rows = 0
            for w in ("tutorial", "mlp-small", "mlp-large", "resnet20-cifar", "lstm-lm", "transformer-lm"):
                for meta, _, _ in pgb.offers(w):
                    for before in (False, True):  # whatever the row before left
                        pgb.set_tf32(before)
                        pgb.prepare(meta)
                        want = meta["config"].endswith("tf32")
                        self.assertEqual(meta["tf32"], want, meta)
                        self.assertEqual(torch.backends.cuda.matmul.allow_tf32, want, meta)
                        self.assertEqual(torch.backends.cudnn.allow_tf32, want, meta)
                    rows += 1
            self.assertEqual(rows, 11)
            sys.modules.pop("pytorch_gpu_bench", None)


@unittest.skipUnless(os.environ.get("BENCH_UTIL_SERVER"), "BENCH_UTIL_SERVER not set (CTest sets it)")
class DriveAgainstTheCppServer(unittest.TestCase):
    def peer(self):
        env = dict(os.environ, BENCH_UTIL_SERVE="1")
        return br.PeerProcess([os.environ["BENCH_UTIL_SERVER"]], env=env, stderr=subprocess.DEVNULL)

    def offers(self, w):
        built = []

        def build(name):
            built.append(name)
            return lambda: None
        meta = lambda c: dict(impl="local", workload=w, config=c)
        return [(meta("l0"), lambda: build("l0"), 1), (meta("l1"), lambda: build("l1"), 1)]

    def test_both_sides_recorded_with_one_run_id(self):
        with tempfile.TemporaryDirectory() as d:
            paths = (os.path.join(d, "local.json"), os.path.join(d, "peer.json"))
            mine, theirs = br.drive(["ok"], self.offers, lambda w: 3, 3, peer=self.peer(), paths=paths)
            self.assertEqual(mine["errors"], [])
            self.assertEqual(theirs["errors"], [])
            self.assertEqual([r["config"] for r in mine["records"]], ["l0", "l1"])
            self.assertEqual([r["config"] for r in theirs["records"]], ["chatty"])
            for r in mine["records"] + theirs["records"]:
                self.assertEqual((r["rounds"], r["repeats"], len(r["round_ms"])), (3, 3, 3))
            self.assertEqual(mine["run_id"], theirs["run_id"])
            self.assertEqual(json.load(open(paths[1]))["records"][0]["config"], "chatty")
            self.assertEqual(json.load(open(paths[0]))["interleaved_with"], "peer")

    def test_failures_are_recorded_and_the_local_rounds_go_on(self):
        # "bad build" fails to build, "dies" ends the server in round 0; chatty then fails too.
        mine, theirs = br.drive(["w", "ok"], self.offers, lambda w: 2, 3, peer=self.peer())
        self.assertEqual([r["config"] for r in mine["records"]], ["l0", "l1", "l0", "l1"])
        self.assertEqual(theirs["records"], [])
        errors = " | ".join(e["error"] for e in theirs["errors"])
        self.assertIn("cannot build", errors)
        self.assertIn("exited", errors)
        self.assertEqual(mine["errors"], [])

    def test_local_failure_leaves_the_others(self):
        def offers(w):
            def bad():
                raise RuntimeError("out of memory")
            return self.offers(w) + [(dict(impl="local", workload=w, config="bad"), bad, 1)]
        mine, theirs = br.drive(["ok"], offers, lambda w: 2, 2, peer=self.peer())
        self.assertEqual([r["config"] for r in mine["records"]], ["l0", "l1"])
        self.assertEqual([e["config"] for e in mine["errors"]], ["bad"])
        self.assertEqual(len(theirs["records"]), 1)


if __name__ == "__main__":
    unittest.main()
