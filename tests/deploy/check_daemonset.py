#!/usr/bin/env python3
"""Checks deploy/kubernetes/daemonset.yaml without an API server (kubectl --dry-run needs one).

Parses every document with python3-yaml and asserts what the deployment relies on: the socket
directory as a DirectoryOrCreate hostPath, the nvidia.com/gpu toleration, system-node-critical,
hostPID (pids must match the training processes'), no service-account token, a locked-down
container (drop ALL, no privilege escalation, read-only root), exec probes through
`bglctl health`, and resource requests and limits.

usage: check_daemonset.py [--mutations] [SAMPLE_CONFIG] DAEMONSET_YAML
  SAMPLE_CONFIG: the ConfigMap may only use the keys deploy/config/governord.yaml documents
  --mutations: check the checker: broken variants of the file must each be rejected
"""
import copy as copy_module
import re
import sys

import yaml


class Checker:
    def __init__(self):
        self.problems = []

    def expect(self, condition, message):
        if not condition:
            self.problems.append(message)
        return condition


def get(obj, *path):
    for key in path:
        if isinstance(obj, dict):
            obj = obj.get(key)
        elif isinstance(obj, list) and isinstance(key, int) and key < len(obj):
            obj = obj[key]
        else:
            return None
    return obj


def check_probe(c, container, name):
    probe = container.get(name)
    if not c.expect(isinstance(probe, dict), f"container has no {name}"):
        return
    command = get(probe, "exec", "command")
    if not c.expect(isinstance(command, list), f"{name} is not an exec probe"):
        return
    c.expect(command[0].endswith("bglctl") and "health" in command,
             f"{name} runs {command!r}, want `bglctl ... health`")
    c.expect(isinstance(probe.get("timeoutSeconds"), int) and probe["timeoutSeconds"] >= 1,
             f"{name} needs a timeoutSeconds")


def check(docs):
    c = Checker()
    daemonsets = [d for d in docs if isinstance(d, dict) and d.get("kind") == "DaemonSet"]
    if not c.expect(len(daemonsets) == 1, f"want one DaemonSet, found {len(daemonsets)}"):
        return c.problems
    ds = daemonsets[0]
    c.expect(ds.get("apiVersion") == "apps/v1", "DaemonSet apiVersion must be apps/v1")
    selector = get(ds, "spec", "selector", "matchLabels") or {}
    labels = get(ds, "spec", "template", "metadata", "labels") or {}
    c.expect(selector and all(labels.get(k) == v for k, v in selector.items()),
             "spec.selector.matchLabels must match the pod template's labels")

    pod = get(ds, "spec", "template", "spec") or {}
    c.expect(pod.get("priorityClassName") == "system-node-critical",
             "priorityClassName must be system-node-critical")
    c.expect(pod.get("hostPID") is True, "hostPID must be true (pids must match the trainers')")
    c.expect(pod.get("hostIPC") in (None, False), "hostIPC must stay off")
    c.expect(pod.get("automountServiceAccountToken") is False,
             "automountServiceAccountToken must be false")
    c.expect(any(t.get("key") == "nvidia.com/gpu" and t.get("operator") == "Exists"
                 and t.get("effect") in (None, "NoSchedule")
                 for t in pod.get("tolerations") or []),
             "needs a toleration nvidia.com/gpu Exists NoSchedule")

    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    socket_volumes = [n for n, v in volumes.items()
                      if get(v, "hostPath", "path") == "/run/bagualu"]
    if c.expect(len(socket_volumes) == 1, "needs one hostPath volume for /run/bagualu"):
        c.expect(get(volumes[socket_volumes[0]], "hostPath", "type") == "DirectoryOrCreate",
                 "the /run/bagualu hostPath must be type DirectoryOrCreate")
    for name, volume in volumes.items():
        if "hostPath" in volume and name not in socket_volumes:
            c.problems.append(f"unexpected hostPath volume {name!r}")

    containers = pod.get("containers") or []
    if not c.expect(len(containers) >= 1, "no containers"):
        return c.problems
    for container in containers:
        name = container.get("name")
        sc = container.get("securityContext") or {}
        c.expect(sc.get("allowPrivilegeEscalation") is False,
                 f"{name}: allowPrivilegeEscalation must be false")
        c.expect(sc.get("readOnlyRootFilesystem") is True,
                 f"{name}: readOnlyRootFilesystem must be true")
        c.expect(sc.get("privileged") in (None, False), f"{name}: must not be privileged")
        c.expect(get(sc, "capabilities", "drop") == ["ALL"],
                 f"{name}: capabilities.drop must be [ALL]")
        c.expect(not get(sc, "capabilities", "add"), f"{name}: must not add capabilities")
        for kind in ("requests", "limits"):
            res = get(container, "resources", kind) or {}
            c.expect("cpu" in res and "memory" in res, f"{name}: resources.{kind} needs cpu and memory")
        mounts = {m.get("name"): m for m in container.get("volumeMounts") or []}
        for vol in socket_volumes:
            c.expect(get(mounts, vol, "mountPath") == "/run/bagualu",
                     f"{name}: must mount the socket directory at /run/bagualu")
    daemon = containers[0]
    check_probe(c, daemon, "livenessProbe")
    check_probe(c, daemon, "readinessProbe")
    env = {e.get("name"): e.get("value") for e in daemon.get("env") or []}
    args = " ".join(daemon.get("args") or [])
    c.expect(env.get("BGL_GOVERNOR", "unix:///run/bagualu/governor.sock")
             == "unix:///run/bagualu/governor.sock" and "--listen" not in args,
             "the probes and the daemon must agree on unix:///run/bagualu/governor.sock")
    return c.problems


# Keys whose value is a list (the daemon's loader takes YAML lists for them).
LIST_KEYS = {"links"}


def documented_keys(sample_config):
    """Keys the sample config documents: set ones and commented-out examples (`# key: ...` at
    the start of a line; the node's keys are commented there because their defaults come
    from the machine)."""
    with open(sample_config, encoding="utf-8") as f:
        text = f.read()
    known = set(yaml.safe_load(text) or {})
    known |= set(re.findall(r"^# ?([a-z][a-z0-9_]*):", text, flags=re.MULTILINE))
    return known


def check_config_map(docs, sample_config):
    """The ConfigMap's governord.yaml may only use keys the sample config documents, with
    scalar values except where the daemon takes a list (links)."""
    known = documented_keys(sample_config)
    problems = []
    for doc in docs:
        if doc.get("kind") != "ConfigMap" or "governord.yaml" not in (doc.get("data") or {}):
            continue
        config = yaml.safe_load(doc["data"]["governord.yaml"]) or {}
        if not isinstance(config, dict):
            problems.append("ConfigMap governord.yaml must be a mapping")
            continue
        for key, value in config.items():
            if key not in known:
                problems.append(f"ConfigMap governord.yaml: unknown key {key!r}")
            if isinstance(value, dict) or (isinstance(value, list) and key not in LIST_KEYS):
                problems.append(f"ConfigMap governord.yaml: {key} must be a scalar")
            if key in LIST_KEYS and not isinstance(value, list):
                problems.append(f"ConfigMap governord.yaml: {key} must be a list")
        if config.get("listen", "unix:///run/bagualu/governor.sock") != \
                "unix:///run/bagualu/governor.sock":
            problems.append("ConfigMap governord.yaml: listen must match the hostPath socket")
    return problems


def config_map_self_test(sample_config):
    """Returns the config edits the ConfigMap check judged wrongly."""
    def one(text):
        return check_config_map([{"kind": "ConfigMap", "data": {"governord.yaml": text}}],
                                sample_config)
    wrong = []
    for text in ("links: [[0, 1, 2, 3], [4, 5, 6, 7]]\nhost_floor_bytes: 256MiB\n",
                 "links:\n  - {gpus: [0, 1], peak_gbps: 25}\nnode_max_sessions: 8\n"):
        if one(text):
            wrong.append(f"rejected {text!r}")
    for text in ("metrics_port: [9478]\n", "no_such_key: 1\n", "links: 0,1\n",
                 "log_level: {a: 1}\n"):
        if not one(text):
            wrong.append(f"accepted {text!r}")
    return wrong


def pod_of(docs):
    return next(d for d in docs if d.get("kind") == "DaemonSet")["spec"]["template"]["spec"]


# Each edit breaks one requirement; the checker must notice every one of them.
MUTATIONS = {
    "hostPID off": lambda p: p.update(hostPID=False),
    "no toleration": lambda p: p.update(tolerations=[]),
    "token mounted": lambda p: p.update(automountServiceAccountToken=True),
    "not node-critical": lambda p: p.pop("priorityClassName"),
    "hostPath Directory": lambda p: [v["hostPath"].update(type="Directory")
                                     for v in p["volumes"] if "hostPath" in v],
    "writable root": lambda p: p["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"),
    "caps kept": lambda p: p["containers"][0]["securityContext"]["capabilities"].update(drop=[]),
    "escalation": lambda p: p["containers"][0]["securityContext"].update(
        allowPrivilegeEscalation=True),
    "http probe": lambda p: p["containers"][0].update(
        livenessProbe={"httpGet": {"path": "/health", "port": 9470}, "timeoutSeconds": 1}),
    "no limits": lambda p: p["containers"][0]["resources"].pop("limits"),
}


def mutation_test(docs):
    """Returns the names of mutations the checker failed to flag."""
    missed = []
    for name, mutate in MUTATIONS.items():
        copy = copy_module.deepcopy(docs)
        mutate(pod_of(copy))
        if not check(copy):
            missed.append(name)
    return missed


def main():
    path = sys.argv[-1]
    with open(path, encoding="utf-8") as f:
        docs = list(yaml.safe_load_all(f))
    if "--mutations" in sys.argv:
        missed = mutation_test(docs)
        for name in missed:
            print("FAIL: the checker accepts a DaemonSet with", name)
        if not missed:
            print(f"ok: all {len(MUTATIONS)} broken variants are rejected")
        if len(sys.argv) > 2 and not sys.argv[-2].startswith("--"):
            wrong = config_map_self_test(sys.argv[-2])
            for w in wrong:
                print("FAIL: the ConfigMap check", w)
            missed += wrong
        return 1 if missed else 0
    for doc in docs:
        if doc is not None and not (isinstance(doc, dict) and "kind" in doc
                                    and "apiVersion" in doc):
            print(f"FAIL: a document without kind/apiVersion: {str(doc)[:80]}")
            return 1
    problems = check(docs)
    if len(sys.argv) > 2 and not sys.argv[-2].startswith("--"):
        problems += check_config_map(docs, sys.argv[-2])
    for p in problems:
        print("FAIL:", p)
    if problems:
        return 1
    print(f"ok: {path} has the required DaemonSet settings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
