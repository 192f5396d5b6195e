"""Placement of each tensor's compression, GPU (in the training process,
libbytecomp_gpu) or CPU (the daemon's pool), from the strategy (issue 27),
and libbytecomp_gpu through ctypes on this machine."""

import unittest

import torch

from bytecomp import _lib, gpu

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


if __name__ == "__main__":
    unittest.main()
