"""GPU training through bytecompd (issue 27): CUDA parameters staged through
pinned shared memory, 2 processes under bytecomp-run sharing the GPU. The
cuda cases skip without a CUDA device (run them with scripts/gpu-check); the
cpu cases run everywhere and check the same worker and the same claims on
CPU tensors, so the GPU run only adds the staging."""

import os
import re
import tempfile
import unittest
import uuid

import torch

import helpers

WORKER = os.path.join(helpers.TESTS_DIR, "workers", "gpu_worker.py")
HAVE_CUDA = torch.cuda.is_available()
NEED_CUDA = "no CUDA device (torch.cuda.is_available() is False): run scripts/gpu-check on a GPU"

EFSIGN = """version: 1
rules:
  - match: "bytecomp.*"
    option: {compressor: none}
default: {compressor: efsignsgd, comp_device: cpu, decomp_device: cpu,
          inter: alltoall_allgather}
"""


# The same, compressed in the training process where the tensor allows
# (comp_device: gpu): on the GPU, or with BYTECOMP_CLIENT_COMPRESS=host by the
# CPU library behind libbytecomp_gpu's ABI (the stand-in).
EFSIGN_GPU = EFSIGN.replace("efsignsgd, comp_device: cpu", "efsignsgd, comp_device: gpu")
assert EFSIGN_GPU != EFSIGN and "decomp_device: cpu" in EFSIGN_GPU


class GpuTraining(unittest.TestCase):
    def run_worker(self, mode, device, steps=6, strategy=None, nproc=2, nodes=1, env=None):
        run_id = "gp" + uuid.uuid4().hex[:8]
        args = ["--nodes", str(nodes), "--nproc-per-node", str(nproc), "--job-id", run_id, "--timeout-ms", "5000",
                "--start-timeout", "20", "--time-limit", "120"]
        if strategy is not None:
            f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
            f.write(strategy)
            f.close()
            self.addCleanup(os.unlink, f.name)
            args += ["--strategy", f.name]
        rc, out, pid = helpers.launch(args + [WORKER, mode, device, str(steps)], timeout=180,
                                      env=env)
        self.assertEqual(helpers.run_leftovers(run_id, pid), ([], []), out)
        return rc, out

    def exact(self, device):
        rc, out = self.run_worker("exact", device)
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count("OK exact %s" % device), 2, out)

    def digests(self, device, strategy=EFSIGN, env=None, placed=0):
        # 2 emulated nodes x 1 process: the gradients cross the parameter
        # server compressed (on one node the daemon sums them exactly).
        rc, out = self.run_worker("digest", device, steps=5, strategy=strategy, nproc=1, nodes=2,
                                  env=env)
        self.assertEqual(rc, 0, out)
        # How many tensors the training process compressed itself.
        self.assertEqual(sorted(re.findall(r"PLACED (\d+)", out)), [str(placed)] * 2, out)
        d = sorted(re.findall(r"DIGEST (\d+) ([0-9a-f]+)", out))
        self.assertEqual(len(d), 10, out)
        by_step = {}
        for step, h in d:
            by_step.setdefault(step, set()).add(h)
        self.assertTrue(all(len(v) == 1 for v in by_step.values()), out)  # ranks agree
        return {k: v.pop() for k, v in by_step.items()}

    def killed(self, device):
        rc, out = self.run_worker("kill", device, steps=50)
        self.assertNotEqual(rc, 0, out)
        m = re.search(r"RAISED (\w+): (.*)", out)
        self.assertIsNotNone(m, out)
        self.assertIn(m.group(1), ("JobAbortedError", "PeerLostError"), out)
        leak = re.search(r"DEVICE_BYTES_AFTER_FAILURE (-?\d+)", out)
        self.assertIsNotNone(leak, out)
        self.assertLessEqual(int(leak.group(1)), 0, out)

    def test_exact_sums_cpu(self):
        self.exact("cpu")

    @unittest.skipUnless(HAVE_CUDA, NEED_CUDA)
    def test_exact_sums_cuda(self):
        self.exact("cuda")

    def test_rank_killed_mid_iteration_cpu(self):
        self.killed("cpu")

    @unittest.skipUnless(HAVE_CUDA, NEED_CUDA)
    def test_rank_killed_mid_iteration_cuda(self):
        self.killed("cuda")

    def test_compressed_digests_cpu(self):
        self.assertEqual(len(self.digests("cpu")), 5)

    @unittest.skipUnless(HAVE_CUDA, NEED_CUDA)
    def test_compressed_cuda_aggregates_equal_cpu(self):
        """efsignsgd in the daemons: CUDA-staged gradients give the same
        aggregates, bit for bit, as the same gradients from CPU tensors."""
        self.assertEqual(self.digests("cuda"), self.digests("cpu"))

    def test_client_compressed_host_stand_in_equals_cpu_placement(self):
        """The GPU placement's runtime path on the host: the optimizer
        compresses in-process (the CPU library behind libbytecomp_gpu's ABI
        standing in for the CUDA kernels), pushes compressed
        (bytecomp_push_pull_compressed), the daemons forward the payloads to
        the server; the aggregates equal the daemon-compressed run's bit for
        bit. layer3 (7 elements) stays daemon-compressed: its payload would
        not fit its partition."""
        env = helpers.child_env()
        env["BYTECOMP_CLIENT_COMPRESS"] = "host"
        self.assertEqual(self.digests("cpu", EFSIGN_GPU, env, placed=3), self.digests("cpu"))

    @unittest.skipUnless(HAVE_CUDA, NEED_CUDA)
    def test_gpu_placement_aggregates_equal_cpu_placement(self):
        """efsignsgd compressed by the CUDA kernels in the training process,
        pushed compressed: the same aggregates, bit for bit, as the daemons'
        CPU compression of the same gradients."""
        self.assertEqual(self.digests("cuda", EFSIGN_GPU, placed=3), self.digests("cpu"))


if __name__ == "__main__":
    unittest.main()
