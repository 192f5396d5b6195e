"""Placement of each tensor's compression, GPU (in the training process,
libbytecomp_gpu) or CPU (the daemon's pool), from the strategy (issue 27),
and libbytecomp_gpu through ctypes on this machine."""

import unittest

import torch

from bytecomp import _lib, gpu, gpu_profile

DOC = {
    "version": 1,
    "default": {"compressor": "efsignsgd", "comp_device": "gpu", "decomp_device": "gpu"},
    "rules": [
        {"match": "*.bias", "option": {"compressor": "none"}},
        {"match": "*", "min_bytes": "1MiB", "max_bytes": "1GiB",
         "option": {"compressor": "topk", "params": {"ratio": "0.01"}, "comp_device": "gpu",
                    "decomp_device": "gpu", "cpu_share": 0.25}},
        {"match": "emb.*", "option": {"compressor": "qsgd", "comp_device": "cpu"}},
    ],
    "entries": [{"tensor": "fc.weight", "option": {"compressor": "fp16"}}],
}

ALL = gpu.Capabilities(True, 1, lambda name: name != "qsgd")


class Placement(unittest.TestCase):
    def test_resolve_follows_entries_rules_default(self):
        self.assertEqual(gpu.resolve(DOC, "fc.weight", 10)["compressor"], "fp16")
        self.assertEqual(gpu.resolve(DOC, "fc.bias", 10 << 20)["compressor"], "none")
        self.assertEqual(gpu.resolve(DOC, "conv.weight", 1 << 20)["compressor"], "topk")
        self.assertEqual(gpu.resolve(DOC, "conv.weight", (1 << 20) - 1)["compressor"],
                         "efsignsgd")
        self.assertEqual(gpu.resolve(DOC, "emb.weight", 100)["compressor"], "qsgd")
        self.assertEqual(gpu.resolve({}, "x", 1), {})

    def test_byte_sizes(self):
        self.assertEqual(gpu._bytes("2 KiB"), 2048)
        self.assertEqual(gpu._bytes("3MB"), 3000000)
        self.assertEqual(gpu._bytes(7), 7)
        with self.assertRaisesRegex(ValueError, "unit"):
            gpu._bytes("3 parsecs")

    def test_gpu_where_the_strategy_says_and_everything_allows(self):
        p = gpu.placement(DOC, [("conv.weight", 4096, "cuda"), ("big.weight", 4 << 20, "cuda"),
                                ("fc.weight", 4096, "cuda"), ("fc.bias", 40, "cuda"),
                                ("emb.weight", 400, "cuda")], ALL)
        self.assertEqual(p["conv.weight"], ("gpu", "efsignsgd", "comp_device: gpu"))
        self.assertEqual(p["big.weight"][:2], ("gpu", "topk:ratio=0.01"))
        self.assertIn("cpu_share 0.25", p["big.weight"][2])
        self.assertEqual(p["fc.weight"], ("cpu", "fp16", "comp_device: cpu"))
        self.assertEqual(p["fc.bias"], ("none", "none", "uncompressed"))
        self.assertEqual(p["emb.weight"][0], "cpu")

    def test_cpu_with_the_reason_otherwise(self):
        t = [("conv.weight", 4096, "cuda")]
        cases = [
            (gpu.Capabilities(False, 0, lambda n: False), "no CUDA kernels"),
            (gpu.Capabilities(True, 0, lambda n: True), "no CUDA device"),
            (gpu.Capabilities(True, 1, lambda n: False), "efsignsgd has no CUDA kernels"),
        ]
        for caps, why in cases:
            where, spec, reason = gpu.placement(DOC, t, caps)["conv.weight"]
            self.assertEqual((where, spec), ("cpu", "efsignsgd"))
            self.assertIn(why, reason)
        where, _, reason = gpu.placement(DOC, [("conv.weight", 4096, "cpu")], ALL)["conv.weight"]
        self.assertEqual(where, "cpu")
        self.assertIn("tensor is on cpu", reason)

    def test_no_strategy_is_uncompressed(self):
        self.assertEqual(gpu.placement(None, [("a", 4, "cuda")], ALL)["a"][0], "none")


class Library(unittest.TestCase):
    def test_capabilities_of_this_build(self):
        caps = gpu.capabilities()
        if gpu.library() is None:
            self.skipTest("libbytecomp_gpu not built")
        self.assertGreaterEqual(caps.devices, 0)
        if caps.built:
            self.assertTrue(caps.supported("efsignsgd"))
            self.assertFalse(caps.supported("nosuch"))

    def test_compressor_without_a_device_says_why(self):
        caps = gpu.capabilities()
        if gpu.library() is None:
            self.skipTest("libbytecomp_gpu not built")
        if caps.built and caps.devices > 0:
            return  # a GPU is present: test_gpu_roundtrip runs instead (no skip: gpu-check
            # reads any skip on a GPU machine as a GPU case that did not run)
        with self.assertRaises(_lib.UnsupportedError) as e:
            gpu.GpuCompressor("efsignsgd", 1000)
        self.assertIn("efsignsgd", str(e.exception))
        with self.assertRaises(_lib.InvalidArgumentError):
            gpu.GpuCompressor("nosuch", 1000)

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device: run scripts/gpu-check")
    def test_gpu_roundtrip(self):
        x = torch.randn(100003, device="cuda")
        c = gpu.GpuCompressor("fp16", x.numel())
        buf = torch.empty(c.max_bytes, dtype=torch.uint8, device="cuda")
        n = c.compress(x.data_ptr(), buf.data_ptr(), c.max_bytes, 1, 7)
        y = torch.empty_like(x)
        c.decompress(buf.data_ptr(), n, y.data_ptr(), False, 1, 7)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(y, x.half().float()))
        c.close()


class FakeCompressor:
    def __init__(self, spec, n, header=8):
        self.spec, self.n, self.max_bytes = spec, n, header + n  # one byte per element
        self.calls = []
        self.closed = False

    def compress(self, in_ptr, out_ptr, cap, iteration, seed, stream):
        self.calls.append((in_ptr, out_ptr, cap, iteration, seed, stream))
        return self.max_bytes

    def close(self):
        self.closed = True


class FakeOps:
    def __init__(self):
        self.copies = []
        self.n = 0

    def scratch(self, nbytes):
        self.n += 1

        class S:
            ptr = 0x1000 * self.n
        return S()

    def raw(self, stream):
        return "raw:%s" % stream

    def copy(self, host_bytes, offset, scratch, n, stream):
        self.copies.append((offset, scratch.ptr, n, stream))

    def copy_dense(self, host_bytes, offset, src, stream):
        self.copies.append((offset, "dense", src.numel(), stream))


class Codec(unittest.TestCase):
    def test_one_compressor_per_daemon_partition_payloads_at_partition_offsets(self):
        made, ops = [], FakeOps()

        def make(spec, n):
            made.append(FakeCompressor(spec, n))
            return made[-1]
        c = gpu.PartitionCodec("efsignsgd", 40000, 65536, "job.opt0", 3, make, ops)
        self.assertEqual([m.n for m in made], [16384, 16384, 7232])
        self.assertEqual(c.encode(0x10000, "hostbytes", 7, "side"),
                         [16392, 16392, 7240])
        self.assertEqual([x[0] for x in ops.copies], [0, 65536, 131072])
        self.assertEqual({x[3] for x in ops.copies}, {"side"})
        for i, m in enumerate(made):
            in_ptr, _, cap, it, seed, stream = m.calls[0]
            self.assertEqual(in_ptr, 0x10000 + i * 65536)
            self.assertEqual((cap, it, stream), (m.max_bytes, 7, "raw:side"))
        c.close()
        self.assertTrue(all(m.closed for m in made))

    def test_a_payload_larger_than_its_partition_is_refused(self):
        made = []

        def make(spec, n):
            made.append(FakeCompressor(spec, n, header=4 * n))
            return made[-1]
        with self.assertRaises(_lib.UnsupportedError) as e:
            gpu.PartitionCodec("efsignsgd", 7, 65536, "j", 0, make, FakeOps())
        self.assertIn("more than the partition", str(e.exception))
        self.assertTrue(all(m.closed for m in made))

    def test_host_stand_in_round_trips_through_the_abi(self):
        lib = gpu.library()
        if lib is None or not hasattr(lib, "bytecomp_gpu_compressor_create_host"):
            self.skipTest("libbytecomp_gpu with the host stand-in not built")
        g = torch.linspace(-1, 1, 1000)
        c = gpu.GpuCompressor("fp16", 1000, host=True)
        out = torch.zeros(c.max_bytes, dtype=torch.uint8)
        n = c.compress(g.data_ptr(), out.data_ptr(), c.max_bytes, 0, 0)
        back = torch.zeros(1000)
        c.decompress(out.data_ptr(), n, back.data_ptr(), False, 0, 0)
        self.assertTrue(torch.equal(back, g.half().float()))
        c.close()


class CpuShare(unittest.TestCase):
    """The strategy's cpu_share as the runtime executes it: the leading
    llround(share * partitions) partitions dense for the daemon's CPU pool
    (the daemon computes the same, daemon/client_payload.h), the rest
    compressed here."""

    def test_rounding_matches_llround(self):
        self.assertEqual(gpu.dense_partitions(0.5, 3), 2)  # 1.5: half away from zero
        self.assertEqual(gpu.dense_partitions(0.5, 4), 2)
        self.assertEqual(gpu.dense_partitions(0.203125, 16), 3)  # 3.25
        self.assertEqual(gpu.dense_partitions(0.0, 5), 0)
        self.assertEqual(gpu.dense_partitions(0.99, 1), 1)
        for bad in (-0.1, 1.0, 1.5, float("nan")):
            with self.assertRaises(ValueError):
                gpu.dense_partitions(bad, 4)

    def test_leading_partitions_are_copied_dense_the_rest_compressed(self):
        made, ops = [], FakeOps()

        def make(spec, n):
            made.append(FakeCompressor(spec, n))
            return made[-1]
        c = gpu.PartitionCodec("efsignsgd", 40000, 65536, "job.opt0", 3, make, ops,
                               cpu_share=0.5)
        self.assertEqual(c.dense, 2)
        self.assertEqual([m.n for m in made], [7232])  # only the third partition
        grad = torch.zeros(40000)
        self.assertEqual(c.encode(0x10000, "hostbytes", 7, "side", grad), [7240])
        self.assertEqual(ops.copies[:2], [(0, "dense", 16384, "side"),
                                          (65536, "dense", 16384, "side")])
        self.assertEqual(ops.copies[2][0], 131072)
        self.assertEqual(made[0].calls[0][0], 0x10000 + 131072)
        with self.assertRaises(ValueError):
            c.encode(0x10000, "hostbytes", 8, "side")  # the dense part needs the gradient
        # A share that rounds to every partition leaves nothing to compress.
        with self.assertRaises(_lib.UnsupportedError) as e:
            gpu.PartitionCodec("efsignsgd", 1000, 65536, "j", 0, make, FakeOps(), cpu_share=0.6)
        self.assertIn("every partition on the daemon's CPU pool", str(e.exception))


class Caps:
    def __init__(self, built=True, devices=1, kernels=("fp16", "efsignsgd")):
        self.built, self.devices, self.kernels = built, devices, kernels

    def supported(self, name):
        return self.built and name in self.kernels


class AutoGpuProfile(unittest.TestCase):
    """Which CUDA compressors mode: auto measures, or why none."""

    def test_candidates_are_the_strategys_and_fp16(self):
        self.assertEqual(gpu_profile.candidates({"compressors": ["topk:0.01"]}),
                         ["topk:0.01", "fp16"])
        self.assertEqual(gpu_profile.candidates({"compressors": ["fp16"]}), ["fp16"])
        self.assertEqual(gpu_profile.candidates({}), ["fp16"])

    def test_selection_and_its_reasons(self):
        specs = ["efsignsgd", "dgc:0.01", "fp16"]
        self.assertEqual(gpu_profile.select(specs, Caps()),
                         (["efsignsgd", "fp16"], "no CUDA kernels for dgc:0.01"))
        self.assertEqual(gpu_profile.select(["fp16"], Caps()), (["fp16"], ""))
        got, note = gpu_profile.select(specs, Caps(built=False))
        self.assertEqual(got, [])
        self.assertTrue(note.startswith("skipped: libbytecomp_gpu has no CUDA kernels"), note)
        self.assertEqual(gpu_profile.select(specs, Caps(devices=0)),
                         ([], "skipped: no CUDA device is visible"))
        self.assertEqual(gpu_profile.select(["dgc"], Caps()),
                         ([], "skipped: no CUDA kernels for dgc"))
        note, measured = gpu_profile.profile({"compressors": ["efsignsgd"]}, None, Caps())
        self.assertEqual((note, measured),
                         ("skipped: the job's parameters are not on a CUDA device", {}))

    def test_a_failed_measurement_is_a_note_not_an_error(self):
        def bench(spec, n):
            raise RuntimeError("CUDA error: out of memory")
        note, measured = gpu_profile.profile({"compressors": ["efsignsgd"]}, "cuda:0", Caps(),
                                             bench=bench)
        self.assertEqual(measured, {})
        self.assertEqual(note, "skipped: measuring on cuda:0 failed: RuntimeError: "
                               "CUDA error: out of memory")

    def test_measure_takes_medians_per_size_after_a_warm_up(self):
        calls = []

        def bench(spec, n):
            calls.append((spec, n))
            k = len(calls)
            # The warm-up (first call per size) is slow and must not count.
            first = k in (1, 7)
            return (1e6 if first else n / 1000.0 + k % 3, 2.0 + k % 2, n // 8 + 16)
        got = gpu_profile.measure(["fp16"], bench, sizes=(1000, 2000), reps=5)
        self.assertEqual(len(calls), 12)
        pts = got["fp16"]
        self.assertEqual([p["n"] for p in pts], [1000, 2000])
        self.assertEqual(pts[0]["compress_us"], 2.0)  # calls 2..6: 1 + {2,0,1,2,0}
        self.assertEqual(pts[0]["bytes"], 141)
        self.assertLess(pts[1]["compress_us"], 1e5)
        text = gpu_profile.report_text("measured on fake", got)
        self.assertIn("version: 1", text)
        self.assertIn("compress_us", text)

    def test_the_benchs_calls_through_the_abi_on_the_host_stand_in(self):
        """TorchCudaBench's compress/decompress calls (argument order,
        buffers, iterations) on the CPU library behind the same ABI: fp16
        comes back as the input's fp16 rounding, the payload sizes fit."""
        lib = gpu.library()
        if lib is None or not hasattr(lib, "bytecomp_gpu_compressor_create_host"):
            self.skipTest("libbytecomp_gpu with the host stand-in not built")
        bench = gpu_profile.TorchCudaBench(None, host=True)
        got = gpu_profile.measure(["fp16", "efsignsgd"], bench, sizes=(4096, 65536), reps=3)
        x, out = bench.last  # efsignsgd's last call: signs times one scale
        self.assertEqual(torch.unique(out.abs()).numel(), 1, out)
        self.assertGreater(float(out.abs()[0]), 0.0)
        bench("fp16", 4096)
        x, out = bench.last
        self.assertTrue(torch.equal(out, x.half().float()))
        fp16 = {p["n"]: p["bytes"] for p in got["fp16"]}
        self.assertGreaterEqual(fp16[65536], 2 * 65536)
        self.assertLess(fp16[65536], 2 * 65536 + 256)
        self.assertLess(got["efsignsgd"][1]["bytes"], 65536 // 8 + 256)
        self.assertTrue(all(p["compress_us"] > 0 for p in got["efsignsgd"]))
        bench.close()


class Shards(unittest.TestCase):
    def test_shard_layout_pads_to_a_multiple_of_the_local_ranks(self):
        self.assertEqual(gpu.shard_layout(10, 4), (12, 3))
        self.assertEqual(gpu.shard_layout(12, 4), (12, 3))
        self.assertEqual(gpu.shard_layout(7, 1), (7, 7))
        self.assertEqual(gpu.shard_layout(0, 2), (0, 0))
        with self.assertRaises(ValueError):
            gpu.shard_layout(5, 0)
        self.assertEqual(gpu.shard_job("run.opt0", 3), "run.opt0.l3")


if __name__ == "__main__":
    unittest.main()
