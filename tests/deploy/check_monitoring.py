#!/usr/bin/env python3
"""Checks the Grafana dashboard and the Prometheus alert rules against the daemon's metrics.

Both files must parse and be well formed (panels with queries and unique ids; rules with an
expression, a severity and a summary), and every bagualu_* metric they query must be one the
daemon registers in governor/service/metrics.cc (histograms may add _bucket, _sum, _count).
A missing metrics.cc is a failure: without it nothing is cross-checked.

usage: check_monitoring.py [--mutations] DASHBOARD_JSON ALERTS_YAML METRICS_CC
  --mutations: check the checker: broken variants of the three files must each be rejected
"""
import copy as copy_module
import json
import re
import sys

import yaml

METRIC = re.compile(r"\bbagualu_[a-z0-9_]+")
NAME = re.compile(r'\.Name\(\s*"(bagualu_[a-z0-9_]+)"')


def registered_metrics(metrics_text):
    """Names passed to .Name("bagualu_...") in the daemon's metrics source."""
    names = set(NAME.findall(metrics_text))
    known = set(names)
    for name in names:
        known |= {name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names, known


def dashboard_exprs(dash, problems):
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


def alert_exprs(doc, problems):
    exprs, names = [], set()
    for group in (doc or {}).get("groups", []):
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


def check(dash, alerts, metrics_text, notes=None):
    """Problems of the parsed dashboard, alert rules and metrics source (None: file missing)."""
    problems = []
    exprs = dashboard_exprs(dash, problems) + alert_exprs(alerts, problems)
    used = {m for e in exprs for m in METRIC.findall(e)}
    if not used:
        problems.append("no bagualu_ metric is queried")
    if metrics_text is None:
        problems.append("the daemon's metrics source is missing: metric names not cross-checked")
        return problems
    names, known = registered_metrics(metrics_text)
    if not names:
        problems.append("the metrics source registers no bagualu_ metric")
    for metric in sorted(used - known):
        problems.append(f"{metric} is queried but the daemon does not register it")
    if notes is not None:
        for metric in sorted(names - {re.sub(r"_(bucket|sum|count)$", "", u) for u in used}):
            notes.append(f"{metric} is registered but neither charted nor alerted on")
    return problems


def first_query(dash):
    return next(t for p in dash["panels"] for t in p.get("targets") or [] if t.get("expr"))


def first_panel(dash):
    return next(p for p in dash["panels"] if p.get("type") != "row")


def first_rule(alerts):
    return alerts["groups"][0]["rules"][0]


def rename_queried_metric(dash, alerts, text):
    """The daemon stops registering a metric the dashboard queries."""
    metric = METRIC.findall(first_query(dash)["expr"])[0]
    metric = re.sub(r"_(bucket|sum|count)$", "", metric)
    return dash, alerts, text.replace(f'"{metric}"', f'"{metric}_renamed"')


# Each edit breaks one requirement; the checker must notice every one of them. A mutation
# takes (dashboard, alerts, metrics source) and returns the broken triple.
MUTATIONS = {
    "no dashboard title": lambda d, a, m: (d.pop("title") and d, a, m),
    "duplicate panel id": lambda d, a, m: (
        d["panels"].append(copy_module.deepcopy(first_panel(d))) or d, a, m),
    "panel without gridPos": lambda d, a, m: (first_panel(d).pop("gridPos") and d, a, m),
    "panel without queries": lambda d, a, m: (first_panel(d).update(targets=[]) or d, a, m),
    "empty query": lambda d, a, m: (first_query(d).update(expr="") or d, a, m),
    "query of an unregistered metric": lambda d, a, m: (
        first_query(d).update(expr="rate(bagualu_no_such_metric_total[5m])") or d, a, m),
    "alert on an unregistered metric": lambda d, a, m: (
        d, first_rule(a).update(expr="bagualu_no_such_gauge > 1") or a, m),
    "metric dropped from metrics.cc": rename_queried_metric,
    "metrics.cc missing": lambda d, a, m: (d, a, None),
    "metrics.cc registers nothing": lambda d, a, m: (d, a, NAME.sub('.Name("x")', m)),
    "alert without a name": lambda d, a, m: (d, first_rule(a).pop("alert") and a, m),
    "duplicate alert": lambda d, a, m: (
        d, a["groups"][0]["rules"].append(copy_module.deepcopy(first_rule(a))) or a, m),
    "alert without expr": lambda d, a, m: (d, first_rule(a).pop("expr") and a, m),
    "alert severity unknown": lambda d, a, m: (
        d, first_rule(a)["labels"].update(severity="page") or a, m),
    "alert without summary": lambda d, a, m: (
        d, first_rule(a)["annotations"].pop("summary") and a, m),
    "no alert rules": lambda d, a, m: (d, {"groups": []}, m),
    "no bagualu metric queried": lambda d, a, m: (
        [t.update(expr="up") for p in d["panels"] for t in p.get("targets") or []] and d,
        [r.update(expr="up == 0") for g in a["groups"] for r in g["rules"]] and a, m),
}


def mutation_test(dash, alerts, metrics_text):
    """Returns the names of mutations the checker failed to flag (the originals must pass)."""
    if check(dash, alerts, metrics_text):
        return ["(none: the unmodified files already fail)"]
    missed = []
    for name, mutate in MUTATIONS.items():
        d, a, m = mutate(copy_module.deepcopy(dash), copy_module.deepcopy(alerts), metrics_text)
        assert (d, a, m) != (dash, alerts, metrics_text), f"mutation {name!r} did not apply"
        if not check(d, a, m):
            missed.append(name)
    return missed


def main():
    args = [a for a in sys.argv[1:] if a != "--mutations"]
    if len(args) != 3:
        print(__doc__)
        return 2
    dashboard, alerts_path, metrics_cc = args
    with open(dashboard, encoding="utf-8") as f:
        dash = json.load(f)
    with open(alerts_path, encoding="utf-8") as f:
        alerts = yaml.safe_load(f)
    try:
        with open(metrics_cc, encoding="utf-8") as f:
            metrics_text = f.read()
    except FileNotFoundError:
        metrics_text = None
    if "--mutations" in sys.argv:
        missed = mutation_test(dash, alerts, metrics_text)
        for name in missed:
            print("FAIL: the checker accepts monitoring files with", name)
        if not missed:
            print(f"ok: all {len(MUTATIONS)} broken variants are rejected")
        return 1 if missed else 0
    notes = []
    problems = check(dash, alerts, metrics_text, notes)
    for n in notes:
        print("note:", n)
    for p in problems:
        print("FAIL:", p)
    if problems:
        return 1
    exprs = dashboard_exprs(dash, []) + alert_exprs(alerts, [])
    used = {m for e in exprs for m in METRIC.findall(e)}
    print(f"ok: dashboard and alerts are well formed; {len(used)} metrics, all registered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
