"""Compression strategies on the Python side.

A strategy is a YAML file in the planner's format (docs/strategy-format.md,
planner/strategy.h). The daemon validates and executes it; this module only
reads it early so that a wrong path or a file that is not a version-1
strategy fails in the training script with the file's name, and hands it to
the daemon for the job.
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


def apply(client, strategy):
    """Hands the strategy to the daemon for the client's job (before start)."""
    lib = _lib.library()
    setter = getattr(lib, "bytecomp_set_strategy", None)
    if setter is None:
        if strategy.compresses_anything():
            raise _lib.UnsupportedError(
                "BYTECOMP_ERR_UNSUPPORTED",
                "strategy %s compresses tensors, but this libbytecomp (%s) cannot hand a "
                "strategy to the daemon (no bytecomp_set_strategy): run uncompressed "
                "(strategy=None) or install a newer release" %
                (strategy.path, _lib.version_string()))
        return
    client.set_strategy(strategy.text, strategy.path)
