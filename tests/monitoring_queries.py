"""The PromQL that deploy/monitoring/ ships (alert expressions, dashboard panels and variables) and the
metric names each one reads: shared by the unit test (promtool, the two rule files agree) and the
kernel test (every name is in a real ``netproxy run``'s /metrics)."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Set

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MONITORING = os.path.join(ROOT, "deploy", "monitoring")
RULES = os.path.join(MONITORING, "netproxy-alerts.rules.yaml")
PROMETHEUS_RULE = os.path.join(MONITORING, "netproxy-prometheusrule.yaml")
DASHBOARD = os.path.join(MONITORING, "netproxy-dashboard.json")
RULE_TESTS = os.path.join(MONITORING, "tests")

_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
             "bool", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
# Grafana's label_values(METRIC, LABEL): the second argument is a label, not a series.
_LABEL_VALUES = re.compile(r"\blabel_values\s*\(([^,()]*),\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)")
# An identifier not inside a word or a number, not a Grafana variable ($x), not called (a function).
_IDENTIFIER = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()")


def metric_names(expr: str) -> Set[str]:
    """The series names ``expr`` selects (what a scrape must expose), as written: a histogram's
    ``_bucket``/``_count``/``_sum``, a counter's ``_total``."""
    text = _LABEL_VALUES.sub(r"\1", expr)
    text = _STRING.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {name for name in _IDENTIFIER.findall(text) if name not in _KEYWORDS}


def load_rules() -> Dict[str, Any]:
    with open(RULES) as f:
        loaded: Dict[str, Any] = yaml.safe_load(f)
    return loaded


def load_dashboard() -> Dict[str, Any]:
    with open(DASHBOARD) as f:
        loaded: Dict[str, Any] = json.load(f)
    return loaded


def alert_expressions() -> Dict[str, str]:
    """Alert name → its PromQL."""
    return {rule["alert"]: rule["expr"] for group in load_rules()["groups"] for rule in group["rules"]
            if "alert" in rule}


def panels(dashboard: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out: List[Dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out += panel.get("panels", [])
    return out


def dashboard_expressions() -> Dict[str, str]:
    """``panel <title> / <refId>`` or ``variable <name>`` → its query."""
    dashboard = load_dashboard()
    out: Dict[str, str] = {}
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            out[f"panel {panel['title']!r} / {target['refId']}"] = target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            out[f"variable {variable['name']}"] = query["query"] if isinstance(query, dict) else query
    return out
