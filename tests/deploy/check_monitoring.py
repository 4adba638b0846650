#!/usr/bin/env python3
"""Checks the Grafana dashboard and the Prometheus alert rules against the daemon's metrics.

Both files must parse and be well formed (panels with queries and unique ids; rules with an
expression, a severity and a summary), and every bagualu_* metric they query must be one the
daemon registers in governor/service/metrics.cc (histograms may add _bucket, _sum, _count).

usage: check_monitoring.py DASHBOARD_JSON ALERTS_YAML METRICS_CC
"""
import json
import os
import re
import sys

import yaml

METRIC = re.compile(r"\bbagualu_[a-z0-9_]+")


def registered_metrics(metrics_cc):
    """Names passed to .Name("bagualu_...") in the daemon's metrics source."""
    text = open(metrics_cc, encoding="utf-8").read()
    names = set(re.findall(r'\.Name\(\s*"(bagualu_[a-z0-9_]+)"', text))
    known = set(names)
    for name in names:
        known |= {name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names, known


def dashboard_exprs(path, problems):
    dash = json.load(open(path, encoding="utf-8"))
    for key in ("title", "uid", "panels", "schemaVersion"):
        if key not in dash:
            problems.append(f"dashboard: missing {key}")
    exprs, ids = [], set()
    for panel in dash.get("panels", []):
        pid = panel.get("id")
        if pid in ids:
            problems.append(f"dashboard: duplicate panel id {pid}")
        ids.add(pid)
        if "gridPos" not in panel:
            problems.append(f"dashboard: panel {pid} has no gridPos")
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"dashboard: panel {panel.get('title')!r} has no queries")
        for target in targets:
            expr = target.get("expr", "")
            if not expr:
                problems.append(f"dashboard: panel {panel.get('title')!r} has an empty query")
            exprs.append(expr)
    return exprs


def alert_exprs(path, problems):
    doc = yaml.safe_load(open(path, encoding="utf-8"))
    exprs, names = [], set()
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            name = rule.get("alert")
            if not name:
                problems.append(f"alerts: a rule in {group.get('name')} has no alert name")
            if name in names:
                problems.append(f"alerts: duplicate alert {name}")
            names.add(name)
            if not rule.get("expr"):
                problems.append(f"alerts: {name} has no expr")
            if (rule.get("labels") or {}).get("severity") not in ("info", "warning", "critical"):
                problems.append(f"alerts: {name} needs severity info, warning or critical")
            if not (rule.get("annotations") or {}).get("summary"):
                problems.append(f"alerts: {name} needs a summary annotation")
            exprs.append(str(rule.get("expr", "")))
    if not names:
        problems.append("alerts: no rules")
    return exprs


def main():
    dashboard, alerts, metrics_cc = sys.argv[1:4]
    problems = []
    exprs = dashboard_exprs(dashboard, problems) + alert_exprs(alerts, problems)
    used = {m for e in exprs for m in METRIC.findall(e)}
    if not used:
        problems.append("no bagualu_ metric is queried")
    if os.path.exists(metrics_cc):
        names, known = registered_metrics(metrics_cc)
        for metric in sorted(used - known):
            problems.append(f"{metric} is queried but the daemon does not register it")
        for metric in sorted(names - {re.sub(r"_(bucket|sum|count)$", "", u) for u in used}):
            print(f"note: {metric} is registered but neither charted nor alerted on")
    else:
        print(f"note: {metrics_cc} not found; metric names not cross-checked")
    for p in problems:
        print("FAIL:", p)
    if problems:
        return 1
    print(f"ok: dashboard and alerts are well formed; {len(used)} metrics, all registered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
