#!/usr/bin/env python3
"""configs/k8s/ without a cluster: every manifest parses, has a known
kind/apiVersion, lives in a namespace the set defines, and references only
objects the set defines (ConfigMaps and their keys, Services, label
selectors, named ports); the YAML inside the ConfigMap is versioned config.
Run by meson test (suite ops) with BYTECOMP_SOURCE_ROOT set."""
import glob
import os
import re
import unittest

import yaml

K8S = os.path.join(os.environ["BYTECOMP_SOURCE_ROOT"], "configs", "k8s")
API = {"Namespace": "v1", "ConfigMap": "v1", "Service": "v1", "DaemonSet": "apps/v1",
       "StatefulSet": "apps/v1", "Deployment": "apps/v1"}
WORKLOADS = ("DaemonSet", "StatefulSet", "Deployment")


def load():
    docs = []
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        with open(path) as f:
            for d in yaml.safe_load_all(f):
                if d is not None:
                    docs.append((os.path.basename(path), d))
    return docs


def problems(docs):
    """Every inconsistency found, in words (empty: the set is consistent)."""
    out = []
    by_kind = {}
    for f, d in docs:
        where = f"{f}: {d.get('kind')}/{d.get('metadata', {}).get('name')}"
        if d.get("kind") not in API:
            out.append(f"{where}: unknown kind (accepted: {', '.join(API)})")
            continue
        if d.get("apiVersion") != API[d["kind"]]:
            out.append(f"{where}: apiVersion {d.get('apiVersion')}, expected {API[d['kind']]}")
        if not d.get("metadata", {}).get("name"):
            out.append(f"{where}: no metadata.name")
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = (where, d)
    namespaces = set(by_kind.get("Namespace", {}))
    for kind, objs in by_kind.items():
        if kind == "Namespace":
            continue
        for where, d in objs.values():
            ns = d["metadata"].get("namespace")
            if ns not in namespaces:
                out.append(f"{where}: namespace {ns!r} is not defined in the set")
    configmaps = by_kind.get("ConfigMap", {})
    services = by_kind.get("Service", {})
    pod_labels = []
    for kind in WORKLOADS:
        for where, d in by_kind.get(kind, {}).values():
            spec = d["spec"]
            tmpl = spec["template"]
            labels = tmpl.get("metadata", {}).get("labels", {})
            pod_labels.append(labels)
            sel = spec.get("selector", {}).get("matchLabels", {})
            if not sel or any(labels.get(k) != v for k, v in sel.items()):
                out.append(f"{where}: selector {sel} does not match its pod labels {labels}")
            if kind == "StatefulSet":
                svc = services.get(spec.get("serviceName"))
                if svc is None:
                    out.append(f"{where}: serviceName {spec.get('serviceName')!r} is not "
                               "a Service of the set")
                elif svc[1]["spec"].get("clusterIP") != "None":
                    out.append(f"{where}: its Service {spec['serviceName']} is not headless")
            volumes = {v["name"]: v for v in tmpl["spec"].get("volumes", [])}
            for v in volumes.values():
                cm = v.get("configMap")
                if cm and cm["name"] not in configmaps:
                    out.append(f"{where}: volume {v['name']} uses ConfigMap {cm['name']!r}, "
                               "not defined in the set")
            for c in tmpl["spec"]["containers"]:
                ports = {p.get("name") for p in c.get("ports", [])}
                for probe in ("readinessProbe", "livenessProbe"):
                    port = c.get(probe, {}).get("tcpSocket", {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        out.append(f"{where}: {probe} names port {port!r}, not a container "
                                   "port")
                mounts = {}
                for m in c.get("volumeMounts", []):
                    if m["name"] not in volumes:
                        out.append(f"{where}: mount of undefined volume {m['name']!r}")
                    mounts[m["mountPath"]] = volumes.get(m["name"], {})
                # Every config file the command names comes from a mounted
                # ConfigMap that has that key.
                cmdline = " ".join(c.get("command", []) + c.get("args", []))
                for path in re.findall(r"/etc/bytecomp/[\w.-]+\.yaml", cmdline):
                    vol = mounts.get(os.path.dirname(path), {})
                    cm = configmaps.get(vol.get("configMap", {}).get("name"))
                    if cm is None or os.path.basename(path) not in cm[1].get("data", {}):
                        out.append(f"{where}: {path} is not a key of a ConfigMap mounted at "
                                   f"{os.path.dirname(path)}")
    for where, d in services.values():
        sel = d["spec"].get("selector", {})
        if not any(all(l.get(k) == v for k, v in sel.items()) for l in pod_labels):
            out.append(f"{where}: selector {sel} matches no pod template of the set")
    for where, d in configmaps.values():
        for key, text in d.get("data", {}).items():
            if key.endswith(".yaml"):
                try:
                    doc = yaml.safe_load(text)
                except yaml.YAMLError as e:
                    out.append(f"{where}: key {key}: {e}")
                    continue
                if not isinstance(doc, dict) or doc.get("version") != 1:
                    out.append(f"{where}: key {key} does not start with version: 1")
    return out


class K8sManifests(unittest.TestCase):
    def test_set_is_complete_and_consistent(self):
        docs = load()
        kinds = {d["kind"] for _, d in docs}
        for k in ("Namespace", "ConfigMap", "Service", "DaemonSet", "StatefulSet"):
            self.assertIn(k, kinds)
        self.assertEqual(problems(docs), [])

    def test_daemonset_shares_the_hosts_shm_and_run_dir(self):
        ds = [d for _, d in load() if d["kind"] == "DaemonSet"][0]
        vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
        host = {v["hostPath"]["path"] for v in vols.values() if "hostPath" in v}
        self.assertIn("/dev/shm", host)
        self.assertIn("/run/bytecomp", host)

    def test_the_checker_finds_broken_references(self):
        # The check itself can fail: break each kind of reference once.
        docs = load()
        for f, d in docs:
            if d["kind"] == "StatefulSet":
                d["spec"]["serviceName"] = "nope"
            if d["kind"] == "DaemonSet":
                d["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] = "gone"
            if d["kind"] == "Service":
                d["spec"]["selector"] = {"app": "nothing"}
        found = "\n".join(problems(docs))
        self.assertIn("serviceName 'nope'", found)
        self.assertIn("ConfigMap 'gone'", found)
        self.assertIn("matches no pod template", found)


if __name__ == "__main__":
    unittest.main(verbosity=2)
