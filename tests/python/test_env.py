"""bytecomp.env: every missing or inconsistent variable raises an error that
names the variable, the value found and the value expected."""

import os
import tempfile
import unittest

import helpers  # noqa: F401  (sys.path)
from bytecomp.env import EnvironmentConfigError, Settings

GOOD = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "BYTECOMP_JOB_ID": "job-1"}


def env(**kw):
    e = dict(GOOD)
    for k, v in kw.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return e


class EnvTest(unittest.TestCase):
    def fails(self, variable, fragment, **kw):
        with self.assertRaises(EnvironmentConfigError) as cm:
            Settings.from_environ(env(**kw))
        self.assertEqual(cm.exception.variable, variable)
        self.assertIn(variable, str(cm.exception))
        self.assertIn(fragment, str(cm.exception))
        return str(cm.exception)

    def test_good(self):
        s = Settings.from_environ(env())
        self.assertEqual((s.rank, s.size, s.local_rank, s.local_size, s.node_rank, s.num_nodes),
                         (3, 4, 1, 2, 1, 2))
        self.assertEqual(s.job_id, "job-1")
        self.assertEqual(s.timeout_ms, 30000)
        self.assertIsNone(s.socket_path)

    def test_torchrun_names(self):
        s = Settings.from_environ(env(BYTECOMP_JOB_ID=None, TORCHELASTIC_RUN_ID="rdzv7",
                                      GROUP_RANK="1"))
        self.assertEqual((s.job_id, s.node_rank), ("rdzv7", 1))

    def test_missing(self):
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            msg = self.fails(var, "is not set", **{var: None})
            self.assertIn("bytecomp-run", msg)

    def test_not_integers_or_out_of_range(self):
        self.fails("RANK", "0..3", RANK="x")
        self.fails("RANK", "0..3", RANK="4")
        self.fails("WORLD_SIZE", ">= 1", WORLD_SIZE="0")
        self.fails("LOCAL_RANK", "0..1", LOCAL_RANK="2")
        self.fails("LOCAL_WORLD_SIZE", "divisor of WORLD_SIZE=4", LOCAL_WORLD_SIZE="3")
        self.fails("BYTECOMP_TIMEOUT_MS", "milliseconds", BYTECOMP_TIMEOUT_MS="-5")

    def test_inconsistent_rank(self):
        msg = self.fails("RANK", "expected 3 = node rank 1", RANK="2")
        self.assertIn("LOCAL_RANK 1", msg)
        self.fails("GROUP_RANK", "0..1", GROUP_RANK="2")
        self.fails("RANK", "expected 1 = node rank 0 (GROUP_RANK)", GROUP_RANK="0")

    def test_job_id(self):
        msg = self.fails("BYTECOMP_JOB_ID", "is not set", BYTECOMP_JOB_ID=None)
        self.assertIn("--rdzv_id", msg)
        # torchrun's default run id "none" is no job name.
        self.fails("BYTECOMP_JOB_ID", "is not set", BYTECOMP_JOB_ID=None,
                   TORCHELASTIC_RUN_ID="none")
        self.fails("BYTECOMP_JOB_ID", "[A-Za-z0-9._-]", BYTECOMP_JOB_ID="a b")
        self.fails("TORCHELASTIC_RUN_ID", "[A-Za-z0-9._-]", BYTECOMP_JOB_ID=None,
                   TORCHELASTIC_RUN_ID="x/y")

    def test_socket_and_strategy(self):
        self.fails("BYTECOMP_SOCKET", "at most 107 bytes", BYTECOMP_SOCKET="/" + "s" * 120)
        self.fails("BYTECOMP_STRATEGY", "strategy file", BYTECOMP_STRATEGY="/nonexistent.yaml")
        with tempfile.NamedTemporaryFile(suffix=".yaml") as f:
            self.assertEqual(Settings.from_environ(env(BYTECOMP_STRATEGY=f.name)).strategy,
                             f.name)

    def test_from_os_environ(self):
        saved = dict(os.environ)
        try:
            for k in GOOD:
                os.environ.pop(k, None)
            with self.assertRaises(EnvironmentConfigError):
                Settings.from_environ()
        finally:
            os.environ.clear()
            os.environ.update(saved)


if __name__ == "__main__":
    unittest.main()
