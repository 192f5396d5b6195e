"""Shared pieces of the Python tests: paths, a real bytecompd in a private
directory, running bytecomp-run, and checks that nothing is left behind
(processes found by their BYTECOMP_RUN_ID, segments in /dev/shm)."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

SOURCE_ROOT = os.environ.get("BYTECOMP_SOURCE_ROOT") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_ROOT = os.environ.get("BYTECOMP_BUILD_ROOT") or os.path.join(SOURCE_ROOT, "build")
PYTHON_ROOT = os.path.join(SOURCE_ROOT, "client", "python")
HARNESS_ROOT = os.path.join(SOURCE_ROOT, "scripts", "harness")  # bytecomp_harness
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
LAUNCHER = os.path.join(SOURCE_ROOT, "scripts", "bytecomp-run")
BYTECOMPD = os.path.join(BUILD_ROOT, "daemon", "bytecompd")
PYTHON = sys.executable

for _root in (HARNESS_ROOT, PYTHON_ROOT):
    if _root not in sys.path:
        sys.path.insert(0, _root)

from bytecomp.run import _can_connect  # noqa: E402


def child_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHON_ROOT + os.pathsep + TESTS_DIR
    env["BYTECOMP_BUILD_ROOT"] = BUILD_ROOT
    env.setdefault("BYTECOMP_LOG", "warn")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def shm_entries(prefix):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def processes_with_env(key, value):
    """Pids of this user's processes whose environment has key=value."""
    marker = ("%s=%s" % (key, value)).encode()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % pid, "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if marker in env:
            out.append(int(pid))
    return out


def wait_until(pred, timeout, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


class Daemon:
    """A real bytecompd with its own socket and shm instance, for tests that
    drive the Python API in-process. Stop with stop() (SIGTERM)."""

    def __init__(self, setup_timeout_ms=10000, socket=None):
        self.dir = tempfile.mkdtemp(prefix="bc-pytest-")
        self.socket = socket or os.path.join(self.dir, "ctl.sock")
        self.instance = "py%dx%s" % (os.getpid(), uuid.uuid4().hex[:6])
        cfg = os.path.join(self.dir, "daemon.yaml")
        with open(cfg, "w") as f:
            f.write("version: 1\ncontrol:\n  socket: %s\n  setup_timeout_ms: %d\n"
                    "shm:\n  instance: %s\nscheduler:\n  threads: 1\n"
                    % (self.socket, setup_timeout_ms, self.instance))
        self.log = open(os.path.join(self.dir, "daemon.log"), "wb")
        self.proc = subprocess.Popen([BYTECOMPD, "--config", cfg], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=child_env())

        if not wait_until(lambda: _can_connect(self.socket), 10):
            self.stop()
            raise RuntimeError("bytecompd did not come up: " + self.output())

    def output(self):
        with open(os.path.join(self.dir, "daemon.log"), "rb") as f:
            return f.read().decode(errors="replace")

    def shm_prefix(self):
        return "bytecomp.%s." % self.instance

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        left = shm_entries(self.shm_prefix())
        for n in left:
            os.unlink(os.path.join("/dev/shm", n))
        subprocess.run(["rm", "-rf", self.dir], check=False)
        return left


def launch(args, timeout, env=None):
    """Runs bytecomp-run to completion (bounded); returns (rc, output, pid)."""
    p = subprocess.Popen([PYTHON, LAUNCHER] + args, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=env or child_env())
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=30)
        raise AssertionError("bytecomp-run did not finish within %d s:\n%s" %
                             (timeout, out.decode(errors="replace")))
    return p.returncode, out.decode(errors="replace"), p.pid


def run_leftovers(run_id, launcher_pid):
    """What a finished bytecomp-run left: (pids, shm segments)."""
    pids = processes_with_env("BYTECOMP_RUN_ID", run_id)
    shm = shm_entries("bytecomp.run%dn" % launcher_pid)
    return pids, shm
