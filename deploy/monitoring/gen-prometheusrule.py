#!/usr/bin/env python3
"""Writes netproxy-prometheusrule.yaml (a prometheus-operator PrometheusRule) from
netproxy-alerts.rules.yaml (a plain Prometheus rules file): one source for the two.

    python3 deploy/monitoring/gen-prometheusrule.py           # rewrite the PrometheusRule
    python3 deploy/monitoring/gen-prometheusrule.py --check   # exit 1 if it is not what this writes

The rules file's ``groups:`` and everything after it become the object's ``spec`` line for line,
indented, so that the comments beside each rule stay with it.  Standard library only: it runs
before the project's virtualenv exists.  tests/unit/test_monitoring.py runs ``--check``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "netproxy-alerts.rules.yaml"
TARGET = HERE / "netproxy-prometheusrule.yaml"

HEADER = """\
# GENERATED from netproxy-alerts.rules.yaml by gen-prometheusrule.py: do not edit.  Edit the rules
# file, then run `python3 deploy/monitoring/gen-prometheusrule.py`.
#
# The labels below are the object's own; a Prometheus run by prometheus-operator loads it only if its
# ruleSelector (and ruleNamespaceSelector) match: kube-prometheus-stack, for one, wants
# `release: <its release name>` (docs/operating.md, "Alerts and a dashboard").
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: netproxy
  namespace: kube-system
  labels:
    app.kubernetes.io/name: netproxy
    app.kubernetes.io/component: alerting-rules
spec:
"""


def render(rules_text: str) -> str:
    """The PrometheusRule for ``rules_text`` (a rules file whose top-level key is ``groups``)."""
    lines = rules_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("groups:")), None)
    if start is None:
        raise ValueError(f"{SOURCE.name}: no top-level 'groups:' line")
    # Blank lines stay empty (no trailing spaces); block scalars keep their meaning under a uniform indent.
    body = "".join(("  " + line if line.strip() else "") + "\n" for line in lines[start:])
    return HEADER + body


def main(argv: list[str]) -> int:
    wanted = render(SOURCE.read_text())
    if argv[1:] == ["--check"]:
        if TARGET.exists() and TARGET.read_text() == wanted:
            return 0
        print(f"{TARGET.name} is not generated from {SOURCE.name}: run python3 {Path(__file__).name}",
              file=sys.stderr)
        return 1
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    TARGET.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
