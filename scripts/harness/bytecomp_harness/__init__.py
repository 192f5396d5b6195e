"""ByteComp's development harness: emulated clusters, benchmarks, chaos and
soak. Not installed; it runs from the source tree, against the client of the
same tree (client/python, put first on sys.path here).

  bytecomp_harness.netns           network namespaces, veths, a bridge, tc shaping
  bytecomp_harness.cluster         the torchrun cluster of scripts/bench-cluster (docs/cluster.md)
  bytecomp_harness.cluster_worker  its training processes (models, systems, counters)
  bytecomp_harness.bench_cluster   scripts/bench-cluster: ByteComp vs DDP per bandwidth
  bytecomp_harness.bench_auto      scripts/bench-auto: strategy "auto" vs hand strategies
  bytecomp_harness.bench           worker side of scripts/bench-torch
  bytecomp_harness.faultnet        the cluster of scripts/chaos and scripts/soak
  bytecomp_harness.chaos_worker    their ranks (the C ABI through ctypes, no PyTorch)
  bytecomp_harness.chaos           scripts/chaos (docs/reliability.md)
  bytecomp_harness.soak            scripts/soak (docs/reliability.md)
  bytecomp_harness.procs           process plumbing the above share

The installed client (`bytecomp`, `bytecomp.torch`) never imports this package.
"""

import os
import sys

HARNESS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # scripts/harness
SOURCE_ROOT = os.path.dirname(os.path.dirname(HARNESS_ROOT))
CLIENT_ROOT = os.path.join(SOURCE_ROOT, "client", "python")

if CLIENT_ROOT not in sys.path:
    sys.path.insert(0, CLIENT_ROOT)
