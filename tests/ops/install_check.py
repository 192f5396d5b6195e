#!/usr/bin/env python3
"""`meson install --destdir` into a temporary directory holds every file that
docs/operations.md lists under "Installed files", the units pass
`systemd-analyze verify`, and a second install keeps an edited
/etc/bytecomp file (configs are installed only where absent).

Run by meson test (suite ops) with BYTECOMP_BUILD_ROOT, BYTECOMP_SOURCE_ROOT
and the install directories in the environment.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

BUILD = os.environ["BYTECOMP_BUILD_ROOT"]
SOURCE = os.environ["BYTECOMP_SOURCE_ROOT"]
DIRS = {k: os.environ["BYTECOMP_INSTALL_" + k.upper()]
        for k in ("prefix", "bindir", "libdir", "includedir", "datadir", "unitdir",
                  "pythondir")}


def documented_files():
    """The paths in the fenced block after the 'Installed files' heading."""
    with open(os.path.join(SOURCE, "docs", "operations.md"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^## Installed files\n(.*?)^```\n(.*?)^```", text, re.S | re.M)
    if not m:
        raise AssertionError("docs/operations.md has no 'Installed files' section with a "
                             "fenced list")
    out = []
    for line in m.group(2).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        path = re.sub(r"<(\w+)>", lambda g: DIRS[g.group(1)] if g.group(1) in DIRS
                      else g.group(0), line)
        if "<" in path:
            raise AssertionError(f"unknown placeholder in docs/operations.md: {line}")
        out.append(path)
    return out


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def meson_install(destdir):
    r = subprocess.run(["meson", "install", "-C", BUILD, "--no-rebuild", "--destdir", destdir],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise AssertionError(f"meson install failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


class InstallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="bc-install-")
        cls.dest = os.path.join(cls.tmp, "root")
        cls.log = meson_install(cls.dest)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def under(self, path):
        return os.path.join(self.dest, path.lstrip("/"))

    def test_every_documented_file_is_installed(self):
        files = documented_files()
        self.assertGreater(len(files), 15, "the documented list looks truncated")
        missing = [f for f in files if not os.path.exists(self.under(f))]
        self.assertEqual(missing, [], "documented but not installed")

    def test_binaries_are_executable(self):
        for b in ("bytecompd", "bytecomp-server", "bytecompctl", "bytecomp-plan",
                  "bytecomp-run"):
            p = self.under(os.path.join(DIRS["bindir"], b))
            self.assertTrue(os.access(p, os.X_OK), p)

    def test_python_package_is_the_client_only(self):
        """The installed `bytecomp` holds the client (no module of the
        development harness, scripts/harness/bytecomp_harness), nothing
        installed imports the harness, and the harness itself is not installed."""
        harness = sorted(f[:-3] for f in os.listdir(os.path.join(
            SOURCE, "scripts", "harness", "bytecomp_harness")) if f.endswith(".py"))
        self.assertIn("bench_cluster", harness)
        pkg = self.under(os.path.join(DIRS["pythondir"], "bytecomp"))
        installed = []
        for root, _dirs, files in os.walk(pkg):
            installed += [os.path.join(root, f) for f in files if f.endswith(".py")]
        self.assertIn(os.path.join(pkg, "torch", "__init__.py"), installed)
        self.assertEqual([f for f in installed if os.path.dirname(f) == pkg
                          and os.path.basename(f)[:-3] in harness
                          and os.path.basename(f) != "__init__.py"], [])
        modules = "|".join(m for m in harness if m != "__init__")
        imports = re.compile(r"bytecomp_harness|bytecomp\.(%s)\b|from bytecomp import (%s)\b"
                             % (modules, modules))
        self.assertEqual([f for f in installed if imports.search(read(f))], [])
        stray = [os.path.join(root, d) for root, dirs, _ in os.walk(self.dest) for d in dirs
                 if d == "bytecomp_harness" or d == "harness"]
        self.assertEqual(stray, [])

    def test_units_point_at_the_installed_binaries(self):
        unit = read(self.under(os.path.join(DIRS["unitdir"], "bytecompd.service")))
        self.assertIn(f"ExecStart={DIRS['bindir']}/bytecompd ", unit)
        self.assertIn("Type=notify", unit)
        self.assertIn("WatchdogSec=", unit)
        self.assertNotIn("@", unit.replace("bytecomp-server@", ""))

    def test_pkg_config_file(self):
        pc = self.under(os.path.join(DIRS["libdir"], "pkgconfig", "bytecomp.pc"))
        text = read(pc)
        self.assertIn("-lbytecomp", text)
        self.assertIn(f"prefix={DIRS['prefix']}", text)

    def test_configs_are_kept_when_present(self):
        daemon_yaml = self.under("/etc/bytecomp/daemon.yaml")
        with open(daemon_yaml, "a") as f:
            f.write("# edited by the operator\n")
        edited = read(daemon_yaml)
        meson_install(self.dest)
        self.assertEqual(read(daemon_yaml), edited)
        # and an absent one is installed again
        os.remove(self.under("/etc/bytecomp/server.yaml"))
        meson_install(self.dest)
        self.assertTrue(os.path.exists(self.under("/etc/bytecomp/server.yaml")))
        self.assertTrue(os.path.isdir(self.under("/etc/bytecomp/daemon.yaml.d")))

    def test_systemd_analyze_verify(self):
        analyze = shutil.which("systemd-analyze")
        if analyze is None:
            self.skipTest("systemd-analyze not installed (Debian package systemd)")
        # verify resolves ExecStart= on the host: point the units at the
        # installed binaries under the destdir.
        work = os.path.join(self.tmp, "units")
        os.makedirs(work, exist_ok=True)
        bindir = DIRS["bindir"]
        paths = []
        for u in ("bytecompd.service", "bytecomp-server.service", "bytecomp-server@.service"):
            text = read(self.under(os.path.join(DIRS["unitdir"], u)))
            text = text.replace(f"={bindir}/", f"={self.under(bindir)}/")
            p = os.path.join(work, u)
            with open(p, "w") as f:
                f.write(text)
            paths.append(p)
        # A template is verified through an instance name.
        paths[-1] = os.path.join(work, "bytecomp-server@a.service")
        os.symlink("bytecomp-server@.service", paths[-1])
        r = subprocess.run([analyze, "verify", "--man=no", *paths], capture_output=True,
                           text=True, timeout=120)
        # Without a running systemd (containers) verify still checks the
        # units' syntax; it may complain about the host, never about ours.
        ours = [l for l in (r.stdout + r.stderr).splitlines()
                if any(u.split(".")[0] in l for u in ("bytecompd", "bytecomp-server"))]
        self.assertEqual(ours, [], r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
