"""Compression strategies on the Python side.

A strategy is a YAML file in the planner's format (docs/strategy-format.md,
planner/strategy.h). The node daemons validate and execute it: today each
bytecompd runs the one strategy of its configuration (`strategy.file` in
daemon.yaml) for every job; bytecomp-run writes it there from --strategy and
exports the same path as BYTECOMP_STRATEGY. This module reads a strategy
early, so a wrong path or a file that is not a version-1 strategy fails in
the training script naming the file, and hands it to the daemons as the
job's own strategy (`apply`: bytecomp_set_strategy, libbytecomp ABI 1.1).

Tensor names starting with "bytecomp." belong to bytecomp.torch's control
job (a scratch tensor for broadcasts: float64 on one node, float32 across
nodes): a strategy must leave them uncompressed (the daemon refuses to
compress float64; across nodes init()'s exactness check fails).
"""

import os

import yaml

from bytecomp import _lib


class Strategy:
    """A loaded strategy file: its path, text and parsed top level."""

    def __init__(self, path, text, doc):
        self.path = path
        self.text = text
        self.doc = doc

    def __repr__(self):
        return "Strategy(%r)" % self.path

    def compresses_anything(self):
        """False only when every option in the file is `compressor: none`."""
        options = []
        if isinstance(self.doc.get("default"), dict):
            options.append(self.doc["default"])
        for key in ("rules", "entries"):
            for item in self.doc.get(key) or []:
                if isinstance(item, dict) and isinstance(item.get("option"), dict):
                    options.append(item["option"])
        return any(str(o.get("compressor", "none")) != "none" for o in options)


def load(path):
    """Reads a strategy file; None stays None (uncompressed)."""
    if path is None:
        return None
    if isinstance(path, Strategy):
        return path
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError("strategy file %s cannot be read: %s" % (path, e.strerror)) from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError("strategy file %s is not valid YAML: %s" % (path, e)) from None
    if not isinstance(doc, dict):
        raise ValueError("strategy file %s: expected a mapping with 'version: 1' at the top "
                         "(docs/strategy-format.md)" % path)
    if doc.get("version") != 1:
        raise ValueError("strategy file %s: key 'version' is %r: expected 1 "
                         "(docs/strategy-format.md)" % (path, doc.get("version")))
    return Strategy(path, text, doc)


def check(strategy, declared):
    """Fails when an exact entry names a tensor the job does not declare
    (the same rule as planner::Strategy::check). declared: [(name, bytes)]."""
    names = {n for n, _ in declared}
    unknown = [e.get("tensor") for e in strategy.doc.get("entries") or []
               if isinstance(e, dict) and e.get("tensor") not in names]
    if unknown:
        raise ValueError("strategy file %s has entries for tensors the job does not declare: %s"
                         " (declared: %s)" % (strategy.path, ", ".join(map(repr, unknown)),
                                              ", ".join(sorted(names))))


def _same_file(a, b):
    try:
        if os.path.samefile(a, b):
            return True
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


def apply(strategy, client, daemon_strategy):
    """Makes the job `client` (not started yet) run `strategy`: with
    libbytecomp ABI 1.1 as the job's own strategy (bytecomp_set_strategy;
    the daemon validates it at start, naming the file). An older library
    cannot hand a job its own strategy: then the daemons' configured one
    (daemon_strategy: $BYTECOMP_STRATEGY, the path bytecomp-run gave them)
    must be the same file or text, else UnsupportedError rather than a
    silently different run."""
    if _lib.has_set_strategy():
        client.set_strategy(strategy.text, strategy.path)
        return
    if daemon_strategy is not None and _same_file(strategy.path, daemon_strategy):
        return
    raise _lib.UnsupportedError(
        "BYTECOMP_ERR_UNSUPPORTED",
        "strategy=%s: this libbytecomp (%s) cannot give a job its own strategy (no "
        "bytecomp_set_strategy, ABI 1.1), and the node daemons run the strategy of their "
        "configuration (daemon.yaml strategy.file). Start the job with `bytecomp-run "
        "--strategy %s` (it configures the daemons and sets BYTECOMP_STRATEGY), or configure "
        "the daemons with it and export BYTECOMP_STRATEGY=%s; BYTECOMP_STRATEGY is %s" %
        (strategy.path, _lib.version_string(), strategy.path, strategy.path,
         repr(daemon_strategy) if daemon_strategy else "not set"))
