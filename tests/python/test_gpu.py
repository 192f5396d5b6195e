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
TWO_GPUS = HAVE_CUDA and torch.cuda.device_count() >= 2
NEED_TWO = "NCCL needs one device per rank: fewer than 2 CUDA devices"
SHAPES = [(1000, 64), (64,), (4096, 3), (7,)]  # gpu_worker.py's
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
# The strategy's cpu_share executed (docs/gpu.md §4): of each GPU-placed
# tensor's partitions, the leading half (rounded) stays dense for the daemons'
# CPU pools.
EFSIGN_SPLIT = EFSIGN_GPU.replace("inter: alltoall_allgather}",
                                  "inter: alltoall_allgather, cpu_share: 0.5}")
assert EFSIGN_SPLIT != EFSIGN_GPU
# The strategy's pieces executed with it: every tensor's partitions are the
# job's cut in two, and cpu_share rounds over those.
EFSIGN_SPLIT_PIECES = EFSIGN_SPLIT.replace("cpu_share: 0.5}", "cpu_share: 0.5, pieces: 2}")
assert EFSIGN_SPLIT_PIECES != EFSIGN_SPLIT


class GpuTraining(unittest.TestCase):
    def run_worker(self, mode, device, steps=6, strategy=None, nproc=2, nodes=1, env=None,
                   extra=()):
        run_id = "gp" + uuid.uuid4().hex[:8]
        args = ["--nodes", str(nodes), "--nproc-per-node", str(nproc), "--job-id", run_id, "--timeout-ms", "5000",
                "--start-timeout", "20", "--time-limit", "120"] + list(extra)
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

    def digests(self, device, strategy=EFSIGN, env=None, placed=0, extra=(), split=None):
        # 2 emulated nodes x 1 process: the gradients cross the parameter
        # server compressed (on one node the daemon sums them exactly).
        rc, out = self.run_worker("digest", device, steps=5, strategy=strategy, nproc=1, nodes=2,
                                  env=env, extra=extra)
        self.assertEqual(rc, 0, out)
        if split is not None:  # "name dense/partitions" of each placed tensor, both ranks
            self.assertEqual(sorted(re.findall(r"SPLIT (\S+ \d+/\d+)", out)), sorted(split * 2),
                             out)
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

    def test_cpu_share_host_stand_in_equals_cpu_placement(self):
        """cpu_share 0.5 executed: with 64 KiB partitions layer0 (4 of
        them) has its first 2 compressed by the daemons' CPU pools and the
        last 2 in the training process (bytecomp_push_pull_split); the
        aggregates equal the all-daemon run's bit for bit. The others (one
        partition each) round to all-CPU and are pushed dense."""
        env = helpers.child_env(BYTECOMP_CLIENT_COMPRESS="host")
        pb = ["--partition-bytes", "64KiB"]
        self.assertEqual(self.digests("cpu", EFSIGN_SPLIT, env, placed=1, extra=pb,
                                      split=["layer0 2/4"]),
                         self.digests("cpu", EFSIGN_SPLIT, extra=pb))

    def test_pieces_with_cpu_share_host_stand_in_equals_cpu_placement(self):
        """pieces 2 executed, with cpu_share 0.5: the 64 KiB partitions cut
        into 32 KiB ones, layer0 has 8 (the first 4 dense for the daemons'
        CPU pools) and layer2 2 (1 dense), as the daemon publishes them per
        tensor (bytecomp_tensor_partitions); the training process lays its
        payloads out by them, and the aggregates equal the all-daemon run's
        bit for bit. Without pieces the aggregates differ (efsignsgd scales
        per partition), so the slices are really run."""
        env = helpers.child_env(BYTECOMP_CLIENT_COMPRESS="host")
        pb = ["--partition-bytes", "64KiB"]
        daemons = self.digests("cpu", EFSIGN_SPLIT_PIECES, extra=pb)
        self.assertEqual(self.digests("cpu", EFSIGN_SPLIT_PIECES, env, placed=2, extra=pb,
                                      split=["layer0 4/8", "layer2 1/2"]),
                         daemons)
        self.assertNotEqual(daemons, self.digests("cpu", EFSIGN_SPLIT, extra=pb))

    @unittest.skipUnless(HAVE_CUDA, NEED_CUDA)
    def test_gpu_cpu_share_aggregates_equal_cpu_placement(self):
        """The same split with the CUDA kernels compressing the GPU part."""
        pb = ["--partition-bytes", "64KiB"]
        self.assertEqual(self.digests("cuda", EFSIGN_SPLIT, placed=1, extra=pb,
                                      split=["layer0 2/4"]),
                         self.digests("cpu", EFSIGN_SPLIT, extra=pb))

    @unittest.skipUnless(HAVE_CUDA, NEED_CUDA)
    def test_gpu_pieces_cpu_share_aggregates_equal_cpu_placement(self):
        """The same pieces and split with the CUDA kernels compressing each
        32 KiB slice of the GPU part."""
        pb = ["--partition-bytes", "64KiB"]
        self.assertEqual(self.digests("cuda", EFSIGN_SPLIT_PIECES, placed=2, extra=pb,
                                      split=["layer0 4/8", "layer2 1/2"]),
                         self.digests("cpu", EFSIGN_SPLIT_PIECES, extra=pb))

    @unittest.skipUnless(HAVE_CUDA, NEED_CUDA)
    def test_gpu_placement_aggregates_equal_cpu_placement(self):
        """efsignsgd compressed by the CUDA kernels in the training process,
        pushed compressed: the same aggregates, bit for bit, as the daemons'
        CPU compression of the same gradients."""
        self.assertEqual(self.digests("cuda", EFSIGN_GPU, placed=3), self.digests("cpu"))


class IntraNode(unittest.TestCase):
    """The intra-node shard flow in DistributedOptimizer (BYTECOMP_INTRA_NODE,
    docs/gpu.md §3): 2 emulated nodes x 2 processes; the local ranks sum
    among themselves first (NCCL, or the node's daemon standing in on the
    host), each rank sends only its shard (half of each tensor, padded)
    through its own shard job across the nodes."""

    run_worker = GpuTraining.run_worker

    def shard_flow(self, device, mode, kill=False):
        env = helpers.child_env(BYTECOMP_INTRA_NODE=mode)
        rc, out = self.run_worker("kill" if kill else "exact", device, steps=50 if kill else 6,
                                  nproc=2, nodes=2, env=env)
        if kill:
            self.assertNotEqual(rc, 0, out)
            raised = re.findall(r"RAISED (\w+): (.*)", out)
            self.assertEqual(len(raised), 3, out)  # every survivor, none hangs
            for cls, _ in raised:
                self.assertIn(cls, ("JobAbortedError", "PeerLostError", "BytecompTimeout"), out)
            return
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count("OK exact %s" % device), 4, out)
        shard = sum(-(-torch.Size(s).numel() // 2) for s in SHAPES)
        self.assertEqual(out.count("DAEMON_ELEMENTS %d %s" % (shard, mode)), 4, out)

    def test_host_stand_in_exact_sums(self):
        self.shard_flow("cpu", "host")

    def test_host_stand_in_rank_killed(self):
        self.shard_flow("cpu", "host", kill=True)

    def sharded_digests(self, env):
        rc, out = self.run_worker("digest", "cpu", steps=4, strategy=EFSIGN_GPU, nproc=2,
                                  nodes=2, env=env)
        self.assertEqual(rc, 0, out)
        d = sorted(re.findall(r"DIGEST (\d+) ([0-9a-f]+)", out))
        self.assertEqual(len(d), 16, out)
        by_step = {}
        for step, h in d:
            by_step.setdefault(step, set()).add(h)
        self.assertTrue(all(len(v) == 1 for v in by_step.values()), out)  # all 4 ranks agree
        return {k: v.pop() for k, v in by_step.items()}, re.findall(r"PLACED (\d+)", out)

    def test_shards_compressed_in_the_process_equal_the_daemons(self):
        """The shard flow with the GPU placement: each rank's shard job has
        one local rank per node, so the shards may be pushed compressed
        (here by the host stand-in of the CUDA kernels). The aggregates equal
        the same sharded run compressed by the daemons, bit for bit."""
        env = helpers.child_env(BYTECOMP_INTRA_NODE="host")
        daemon, placed = self.sharded_digests(env)
        self.assertEqual(placed, ["0"] * 4)
        env["BYTECOMP_CLIENT_COMPRESS"] = "host"
        client, placed = self.sharded_digests(env)
        self.assertEqual(len(set(placed)), 1, placed)
        self.assertGreater(int(placed[0]), 0, placed)
        self.assertEqual(client, daemon)

    def test_refusals(self):
        env = helpers.child_env(BYTECOMP_INTRA_NODE="nccl")
        rc, out = self.run_worker("exact", "cpu", steps=1, nproc=2, nodes=1, env=env)
        self.assertNotEqual(rc, 0, out)
        self.assertIn("BYTECOMP_INTRA_NODE=nccl: parameter 'layer0' is on cpu", out)
        env["BYTECOMP_INTRA_NODE"] = "ring"
        rc, out = self.run_worker("exact", "cpu", steps=1, nproc=2, nodes=1, env=env)
        self.assertNotEqual(rc, 0, out)
        self.assertIn("BYTECOMP_INTRA_NODE='ring': expected one of daemon, nccl, host", out)

    @unittest.skipUnless(TWO_GPUS, NEED_TWO)
    def test_nccl_exact_sums_cuda(self):
        self.shard_flow("cuda", "nccl")

    @unittest.skipUnless(TWO_GPUS, NEED_TWO)
    def test_nccl_rank_killed_cuda(self):
        self.shard_flow("cuda", "nccl", kill=True)


class AutoGpuProfile(unittest.TestCase):
    """mode: auto profiles the CUDA compressors where the parameters are on
    a GPU (bytecomp/gpu_profile.py): local rank 0 of each node measures them
    through libbytecomp_gpu and its daemon takes the report into the node's
    profile (`gpu_profile`); elsewhere the report says it skipped, and why."""

    run_worker = GpuTraining.run_worker

    def test_cpu_parameters_report_that_they_skipped(self):
        rc, out = self.run_worker("auto", "cpu", steps=12, nproc=1, nodes=2)
        self.assertEqual(rc, 0, out)
        note = "skipped: the job's parameters are not on a CUDA device"
        self.assertEqual(out.count("GPU_PROFILE %s |  | ok" % note), 2, out)
        # ... and each node's profile (after the warm-up) carries it.
        self.assertEqual(out.count("PROFILE_GPU %s | \n" % note), 2, out)

    @unittest.skipUnless(HAVE_CUDA, NEED_CUDA)
    def test_cuda_parameters_are_measured(self):
        rc, out = self.run_worker("auto", "cuda", steps=12, nproc=1, nodes=2)
        self.assertEqual(rc, 0, out)
        got = re.findall(r"GPU_PROFILE measured on (.+) \| (\S*) \| (\S+)", out)
        self.assertEqual(len(got), 2, out)
        for _, specs, answer in got:
            self.assertEqual(specs, "efsignsgd,fp16", out)
            self.assertEqual(answer, "ok", out)
        prof = re.findall(r"PROFILE_GPU measured on .+ \| (\S+)", out)
        self.assertEqual(prof, ["efsignsgd,fp16"] * 2, out)


if __name__ == "__main__":
    unittest.main()
