"""Elastic restarts (issue 28 part 1, docs/reliability.md "Elastic restarts"):
torchrun --max_restarts with its c10d rendezvous on 2 namespaced nodes (a
bytecompd each) and 2 servers in namespaces of their own
(bytecomp_harness.faultnet), training bytecomp.examples.elastic_digits with
a checkpoint every 10 steps. A rank, then server 1, then the coordinator,
then a node's daemon are SIGKILLed; a supervisor restarts the services
(systemd's Restart=always), torchrun restarts the workers, and each time
training must resume from a checkpoint and go on. The final parameters
must equal, bit for bit, those of an uninterrupted run of the same script
(uncompressed sums of 2 operands per step on every path: exact and
order-free). Nothing may be left: processes, segments, namespaces.
Skipped (with the reason) where namespaces cannot be created."""

import os
import shutil
import tempfile
import time
import unittest

import torch

import helpers

from bytecomp_harness import netns
from bytecomp_harness.elastic import ElasticLaunch, Supervisor, kill
from bytecomp_harness.faultnet import FaultNet

_WHY = netns.check_permission()
STEPS = 400
EVERY = 10
# Every wait below is bounded; these cover a restart on the loaded 2-core
# machine: fault detection (peer_timeout 1.5 s), torchrun's monitor and
# rendezvous, a new interpreter importing torch, the job's admission.
RESUME_S = 90
RUN_S = 240

RESUMED = r"restart (\d+): resumed from the checkpoint of step (\d+)"
STEP = r"step (\d+) loss"


def _script_args(ckpt, out):
    return ["--checkpoint-dir", ckpt, "--checkpoint-every", str(EVERY), "--steps", str(STEPS),
            "--log-every", "5", "--step-sleep", "0.03", "--out", out]


@unittest.skipIf(_WHY, "network namespaces not permitted here: %s" % _WHY)
class ElasticRestarts(unittest.TestCase):
    def final_digests(self, launch, since):
        d = {}
        for _t, _lb, line in launch.lines(since):
            i = line.find("final parameters sha256 ")
            if i >= 0:
                rank = int(line[:i].rsplit("rank ", 1)[1])
                d[rank] = line[i + len("final parameters sha256 "):].strip()
        return d

    def run_to_end(self, launch, what):
        codes = launch.wait(RUN_S)
        self.assertEqual(codes, [0, 0], "%s: torchrun exit statuses %s; last lines:\n%s" % (
            what, codes, "\n".join("[%s] %s" % (lb, ln) for _t, lb, ln in launch.lines()[-60:])))

    def test_training_resumes_after_rank_server_coordinator_and_daemon_loss(self):
        tmp = tempfile.mkdtemp(prefix="bc-test-elastic-")
        t_start = time.monotonic()
        # BYTECOMP_TEST_ECHO=1: every process's lines on stdout as they come.
        echo = ((lambda line: print("%7.2f %s" % (time.monotonic() - t_start, line),
                                    flush=True))
                if os.environ.get("BYTECOMP_TEST_ECHO") else None)
        net = FaultNet(heartbeat_ms=500, peer_timeout_ms=1500, request_ms=4000,
                       admission_ms=30000, build_root=helpers.BUILD_ROOT, echo=echo,
                       log_level=os.environ.get("BYTECOMP_TEST_LOG", "info"))
        tag = net.net.tag
        sup = None
        launches = []
        try:
            net.start()
            sup = Supervisor(net, restart_sec=0.5).start()

            # The uninterrupted run.
            ref = ElasticLaunch(net, tag + "ref", _script_args(os.path.join(tmp, "ref"),
                                                               os.path.join(tmp, "ref.pt")),
                                max_restarts=0, echo=echo)
            launches.append(ref)
            ref.start()
            self.run_to_end(ref, "uninterrupted run")
            ref_digests = self.final_digests(ref, 0.0)
            self.assertEqual(sorted(ref_digests), [0, 1, 2, 3])
            self.assertEqual(len(set(ref_digests.values())), 1, ref_digests)

            # The same run with four faults.
            el = ElasticLaunch(net, tag + "el", _script_args(os.path.join(tmp, "el"),
                                                             os.path.join(tmp, "el.pt")),
                               max_restarts=8, echo=echo)
            launches.append(el)
            el.start()
            t, _ = el.wait_for(r"no checkpoint, starting at step 0", 0.0, RESUME_S, "first start")
            resumed = []
            def kill_rank(r):
                pid = el.worker_pid(r)
                return pid is not None and kill(pid)
            faults = [("rank 3", lambda: kill_rank(3)),
                      ("server 1", lambda: net.servers[1].signal(9) or True),
                      ("coordinator", lambda: net.servers[0].signal(9) or True),
                      ("daemon of node 1", lambda: net.daemons[1].signal(9) or True)]
            last_resume = 0
            for what, inject in faults:
                # Fault k once training got 15 steps past where it (re)started.
                target = last_resume + 15
                t, m = el.wait_for(STEP, t, RESUME_S, "training before killing the %s" % what)
                while int(m.group(1)) < target:
                    t, m = el.wait_for(STEP, t + 1e-6, RESUME_S,
                                       "training to step %d before killing the %s" %
                                       (target, what))
                at = int(m.group(1))
                self.assertLess(at, STEPS - 3 * EVERY,
                                "training got too far before the %s was killed" % what)
                t_fault = time.monotonic()
                self.assertTrue(inject(), "the %s was not running" % what)
                t, m = el.wait_for(RESUMED, t_fault, RESUME_S,
                                   "training resuming after the %s was killed" % what)
                step = int(m.group(2))
                # The last checkpoint before the fault (rank 0 writes it
                # before printing the step), never one from the future.
                self.assertGreaterEqual(step, at - at % EVERY, what)
                self.assertGreaterEqual(step, last_resume, what)
                resumed.append((what, int(m.group(1)), step, round(t - t_fault, 2)))
                last_resume = step
            self.run_to_end(el, "run with faults")
            el_digests = self.final_digests(el, t)
            self.assertEqual(sorted(el_digests), [0, 1, 2, 3])
            print("elastic: faults (what, restart count, resumed at step, seconds): %s" % resumed)
            print("elastic: supervisor restarts: %s" % [lb for _t, lb in sup.restarts])
            self.assertEqual(sup.failures, [])
            self.assertEqual(sorted(lb for _t, lb in sup.restarts),
                             ["daemon 1", "server 0", "server 1"])
            # Bit for bit: every rank of both runs, and the saved tensors.
            self.assertEqual(set(el_digests.values()), set(ref_digests.values()))
            a = torch.load(os.path.join(tmp, "ref.pt"))
            b = torch.load(os.path.join(tmp, "el.pt"))
            self.assertEqual(sorted(a), sorted(b))
            for k in a:
                self.assertTrue(torch.equal(a[k], b[k]), k)
        except BaseException:
            # What the services said last (their lines stay in memory): the
            # agents' lines are in the error already.
            for p in net.services():
                print("---- %s (%s), last lines:\n%s" % (p.label, "running" if p.alive() else
                                                       "exited %s" % p.returncode,
                                                       "\n".join(p.tail(40))))
            raise
        finally:
            if sup:
                sup.stop()
            for launch in launches:
                launch.stop()
            left = helpers.processes_with_env("BYTECOMP_RUN_ID", tag)
            services = {p.pid for p in net.services()}
            workers = [p for p in left if p not in services]
            net.stop()
            shutil.rmtree(tmp, ignore_errors=True)
        self.assertEqual(workers, [], "processes left after the launches ended")
        self.assertEqual(helpers.processes_with_env("BYTECOMP_RUN_ID", tag), [])
        self.assertEqual(helpers.shm_entries("bytecomp.%s" % tag), [])
        self.assertEqual([n for n in netns.list_namespaces() if n.startswith(tag)], [])


if __name__ == "__main__":
    unittest.main()
