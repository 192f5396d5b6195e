"""Compression strategies on the Python side.

A strategy is a YAML file in the planner's format (docs/strategy-format.md,
planner/strategy.h). The node daemons validate and execute it: today each
bytecompd runs the one strategy of its configuration (`strategy.file` in
daemon.yaml) for every job; bytecomp-run writes it there from --strategy and
exports the same path as BYTECOMP_STRATEGY. This module reads a strategy
early, so a wrong path or a file that is not a version-1 strategy fails in
the training script naming the file, and hands it to the daemons as the
job's own strategy (`apply`: bytecomp_set_strategy, libbytecomp ABI 1.1).

`strategy="auto"` (see `auto()`) lets the runtime choose per tensor: the
daemons profile the job, the coordinator plans, every node applies the
result (docs/auto.md); the user names the compressors they accept.

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

    def is_auto(self):
        return self.doc.get("mode") == "auto"

    def compresses_anything(self):
        """False only when every option in the file is `compressor: none`."""
        if self.is_auto():
            return True  # possibly: the runtime decides
        options = []
        if isinstance(self.doc.get("default"), dict):
            options.append(self.doc["default"])
        for key in ("rules", "entries"):
            for item in self.doc.get(key) or []:
                if isinstance(item, dict) and isinstance(item.get("option"), dict):
                    options.append(item["option"])
        return any(str(o.get("compressor", "none")) != "none" for o in options)


_AUTO_KEYS = ("min_compress_bytes", "min_gain", "warmup_iterations", "skip_iterations", "plan_timeout_ms",
              "colocated_servers", "replan", "guard", "loss_guard")


def auto(compressors=None, exclude=None, **settings):
    """The automatic strategy: the runtime profiles the job and chooses per
    tensor one of `compressors` (specs such as "efsignsgd", "topk:0.01";
    None or []: fp16 only), fp16 or nothing; tensors matching an `exclude`
    glob stay uncompressed. Other keys of docs/auto.md (warmup_iterations,
    replan={...}, ...) as keyword arguments. The daemon checks every value
    when the job starts and names what is wrong."""
    def str_list(what, v):
        if v is None:
            return []
        if isinstance(v, str) or not all(isinstance(x, str) and x for x in v):
            raise ValueError("strategy='auto': %s=%r must be a list of non-empty strings" %
                             (what, v))
        return list(v)
    doc = {"version": 1, "mode": "auto",
           "compressors": str_list("compressors", compressors),
           "exclude": str_list("exclude", exclude)}
    for k, v in settings.items():
        if k not in _AUTO_KEYS:
            raise ValueError("strategy='auto': unknown setting %r (accepted: %s)" %
                             (k, ", ".join(_AUTO_KEYS)))
        doc[k] = v
    return Strategy("<auto>", yaml.safe_dump(doc, sort_keys=False), doc)


def load(path):
    """Reads a strategy file; None stays None (uncompressed); "auto" is the
    automatic strategy with fp16 only (auto() takes compressors)."""
    if path is None:
        return None
    if isinstance(path, Strategy):
        return path
    if path == "auto":
        return auto()
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
    if strategy.is_auto():
        return
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
    if strategy.is_auto():
        raise _lib.UnsupportedError(
            "BYTECOMP_ERR_UNSUPPORTED",
            "strategy='auto': this libbytecomp (%s) cannot give a job its own strategy (no "
            "bytecomp_set_strategy, ABI 1.1); configure the daemons with strategy: {mode: auto} "
            "instead" % _lib.version_string())
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
