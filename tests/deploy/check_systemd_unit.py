#!/usr/bin/env python3
"""Checks deploy/systemd/bgl-governord.service.

`systemd-analyze verify` exits 0 on unknown keys and unparsable values, so the unit is verified
from a temporary copy (ExecStart pointed at a binary that exists here) and any output on stderr
fails the test. The hardening and lifecycle settings the deployment relies on are then asserted
key by key.

usage: check_systemd_unit.py [--mutations] UNIT_FILE
  --mutations: check the checker: broken variants must each be rejected
"""
import os
import shutil
import subprocess
import sys
import tempfile

REQUIRED = {
    ("Service", "Type"): "notify",
    ("Service", "ExecStart"): "/usr/bin/bgl-governord --config /etc/bagualu/governord.yaml",
    ("Service", "ExecReload"): "/bin/kill -HUP $MAINPID",
    ("Service", "Restart"): "on-failure",
    ("Service", "RuntimeDirectory"): "bagualu",
    ("Service", "ProtectSystem"): "strict",
    ("Service", "ProtectHome"): "yes",
    ("Service", "PrivateTmp"): "yes",
    ("Service", "NoNewPrivileges"): "yes",
    ("Service", "CapabilityBoundingSet"): "",
    ("Service", "RestrictAddressFamilies"): "AF_UNIX AF_INET AF_INET6",
    ("Service", "SystemCallFilter"): "@system-service",
    ("Install", "WantedBy"): "multi-user.target",
}
PRESENT = [("Service", "WatchdogSec"), ("Service", "RuntimeDirectoryMode"),
           ("Service", "User"), ("Service", "Group")]
# Settings that would break the daemon: it must see other users' processes to reap sessions.
FORBIDDEN = [("Service", "ProtectProc", "invisible"), ("Service", "PrivateUsers", "yes")]


def parse(text):
    """Returns {(section, key): [values]} of a unit file (no continuation lines in ours)."""
    entries, section = {}, None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if not sep or section is None:
            raise AssertionError(f"unparsable line: {raw!r}")
        entries.setdefault((section, key.strip()), []).append(value.strip())
    return entries


def verify(unit_path):
    """Runs systemd-analyze verify on a temp copy; returns a list of problems."""
    if shutil.which("systemd-analyze") is None:
        return ["systemd-analyze is not installed (apt-get install systemd)"]
    text = open(unit_path, encoding="utf-8").read()
    exe = shutil.which("true") or "/bin/true"
    text = text.replace("/usr/bin/bgl-governord", exe)
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, os.path.basename(unit_path))
        with open(copy, "w", encoding="utf-8") as f:
            f.write(text)
        proc = subprocess.run(["systemd-analyze", "verify", copy], cwd=tmp,
                              capture_output=True, text=True, timeout=120)
    problems = []
    if proc.returncode != 0:
        problems.append(f"systemd-analyze verify exited {proc.returncode}")
    for line in (proc.stderr + proc.stdout).splitlines():
        if line.strip():
            problems.append(f"systemd-analyze: {line.strip()}")
    return problems


def check(unit_path):
    problems = verify(unit_path)
    entries = parse(open(unit_path, encoding="utf-8").read())
    for (section, key), want in REQUIRED.items():
        got = entries.get((section, key))
        if got is None:
            problems.append(f"[{section}] {key}= is missing (want {want!r})")
        elif want not in got:
            problems.append(f"[{section}] {key}= is {got!r}, want {want!r}")
    for section, key in PRESENT:
        if (section, key) not in entries:
            problems.append(f"[{section}] {key}= is missing")
    for section, key, bad in FORBIDDEN:
        if bad in entries.get((section, key), []):
            problems.append(f"[{section}] {key}={bad} would hide the training processes")
    mode = entries.get(("Service", "RuntimeDirectoryMode"), ["0"])[-1]
    if int(mode, 8) & 0o007:
        problems.append(f"RuntimeDirectoryMode={mode} lets every user reach the socket directory")
    return problems


# Each edit breaks the unit in a way `systemd-analyze verify` alone reports with exit status 0,
# or removes a required setting; the checker must notice every one of them.
MUTATIONS = {
    "unknown key": lambda t: t.replace("[Install]", "ProtectEverything=yes\n\n[Install]"),
    "bad Type": lambda t: t.replace("Type=notify", "Type=notifyy"),
    "bad boolean": lambda t: t.replace("PrivateTmp=yes", "PrivateTmp=perhaps"),
    "no watchdog": lambda t: t.replace("WatchdogSec=", "#WatchdogSec="),
    "world-readable socket dir": lambda t: t.replace("RuntimeDirectoryMode=0750",
                                                     "RuntimeDirectoryMode=0755"),
}


def mutation_test(unit_path):
    text = open(unit_path, encoding="utf-8").read()
    missed = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, mutate in MUTATIONS.items():
            broken = mutate(text)
            assert broken != text, f"mutation {name!r} did not apply"
            copy = os.path.join(tmp, os.path.basename(unit_path))
            with open(copy, "w", encoding="utf-8") as f:
                f.write(broken)
            if not check(copy):
                missed.append(name)
    return missed


def main():
    unit_path = sys.argv[-1]
    if "--mutations" in sys.argv:
        missed = mutation_test(unit_path)
        for name in missed:
            print("FAIL: the checker accepts a unit with", name)
        if not missed:
            print(f"ok: all {len(MUTATIONS)} broken variants are rejected")
        return 1 if missed else 0
    problems = check(unit_path)
    for p in problems:
        print("FAIL:", p)
    if problems:
        return 1
    print(f"ok: {unit_path} verifies cleanly and has the required settings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
