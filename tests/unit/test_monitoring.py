"""deploy/monitoring/: the alerting rules load in promtool and pass their ``promtool test rules`` unit
tests (each of which fails when its alert is made never to fire), the PrometheusRule carries exactly
the plain rules file's groups, and the dashboard's queries are valid PromQL on netproxy's names.
(tests/kernel/test_monitoring_names.py checks those names against a real ``netproxy run``.)

promtool comes from Debian's prometheus package (scripts/install-promtool, run by ``make setup``);
without it these tests skip, or fail under ``CI=true``."""

from __future__ import annotations

import copy
import glob
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Dict, Iterator, List, Set

import pytest
import yaml

from tests.monitoring_queries import (
    MONITORING,
    PROMETHEUS_RULE,
    ROOT,
    RULE_TESTS,
    RULES,
    alert_expressions,
    dashboard_expressions,
    load_dashboard,
    load_rules,
    metric_names,
    panels,
)

TEST_FILES = sorted(glob.glob(os.path.join(RULE_TESTS, "*.yaml")))
PREFIXES = ("kubeproxy_", "netproxy_", "process_")
"""kube-proxy's names, netproxy's own, and the process collector's (kube-proxy's Go client has them too)."""


def _promtool() -> str:
    for candidate in (os.environ.get("PROMTOOL", ""), os.path.join(ROOT, ".venv", "bin", "promtool"),
                      shutil.which("promtool") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    reason = "promtool not found (make setup installs it: scripts/install-promtool)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def promtool() -> Iterator[str]:
    yield _promtool()


def _run(argv: List[str], cwd: str = ROOT) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


# ---- the rules --------------------------------------------------------------------------------


def test_promtool_check_rules_loads_every_alert(promtool: str) -> None:
    proc = _run([promtool, "check", "rules", RULES])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_expressions())} rules found" in proc.stdout, proc.stdout


def test_promtool_test_rules_passes_for_every_alert(promtool: str) -> None:
    assert TEST_FILES
    proc = _run([promtool, "test", "rules", *TEST_FILES])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(TEST_FILES), proc.stdout


def _rule_tests() -> Dict[str, Dict[str, Any]]:
    out = {}
    for path in TEST_FILES:
        with open(path) as f:
            out[path] = yaml.safe_load(f)
    return out


def _instance(series: str) -> str:
    found = re.search(r'instance="([^"]*)"', series)
    assert found, f"a test series without an instance label: {series}"
    return found.group(1)


def test_every_alert_has_series_that_fire_and_series_that_do_not() -> None:
    """Per alert: some input series of its tests make it fire, and others (other instances) never do."""
    firing: Dict[str, Set[str]] = {name: set() for name in alert_expressions()}
    quiet: Dict[str, Set[str]] = {name: set() for name in alert_expressions()}
    for path, spec in _rule_tests().items():
        assert spec["rule_files"] == ["../netproxy-alerts.rules.yaml"], path
        for case in spec["tests"]:
            names = {check["alertname"] for check in case.get("alert_rule_test", [])}
            assert names and names <= set(firing), f"{path}: tests unknown alerts {names - set(firing)}"
            instances = {_instance(s["series"]) for s in case["input_series"]}
            fired = {alert["exp_labels"]["instance"] for check in case["alert_rule_test"]
                     for alert in check.get("exp_alerts") or []}
            for name in names:
                firing[name] |= fired
                quiet[name] |= instances - fired
    assert not [n for n, s in firing.items() if not s], f"alerts no test makes fire: {firing}"
    assert not [n for n, s in quiet.items() if not s], f"alerts without a series that must not fire: {quiet}"


def test_each_alerts_test_fails_when_the_alert_never_fires(promtool: str, tmp_path: Any) -> None:
    """The unit tests depend on the rules they test: with one alert's expression replaced by one that is
    never true, that alert's test files fail (and a test file passing regardless would be caught here)."""
    shutil.copytree(RULE_TESTS, tmp_path / "tests")
    by_alert: Dict[str, List[str]] = {}
    for path, spec in _rule_tests().items():
        for case in spec["tests"]:
            for check in case.get("alert_rule_test", []):
                by_alert.setdefault(check["alertname"], []).append(str(tmp_path / "tests" / os.path.basename(path)))
    for alert in alert_expressions():
        rules = copy.deepcopy(load_rules())
        for group in rules["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") == alert:
                    rule["expr"] = "vector(0) > 1"
        (tmp_path / "netproxy-alerts.rules.yaml").write_text(yaml.safe_dump(rules))
        proc = _run([promtool, "test", "rules", *sorted(set(by_alert[alert]))])
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0 and f"alertname: {alert}," in output, f"{alert}'s tests pass without it\n{output}"


def test_every_alert_has_a_severity_a_for_and_what_to_tell_a_person() -> None:
    for group in load_rules()["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert re.fullmatch(r"[0-9]+[smh]", rule["for"]), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


# ---- one source for the two rule files ---------------------------------------------------------


def test_the_prometheusrule_is_generated_from_the_rules_file() -> None:
    script = os.path.join(MONITORING, "gen-prometheusrule.py")
    proc = _run([sys.executable, script, "--check"])
    assert proc.returncode == 0, proc.stderr
    with open(PROMETHEUS_RULE) as f:
        rule = yaml.safe_load(f)
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"] == load_rules()


def test_the_generator_check_fails_on_a_hand_edited_prometheusrule(tmp_path: Any) -> None:
    """Control for the test above: --check compares, it does not just exit 0."""
    for name in ("gen-prometheusrule.py", "netproxy-alerts.rules.yaml", "netproxy-prometheusrule.yaml"):
        shutil.copy(os.path.join(MONITORING, name), tmp_path / name)
    edited = (tmp_path / "netproxy-prometheusrule.yaml").read_text().replace("for: 15m", "for: 20m", 1)
    (tmp_path / "netproxy-prometheusrule.yaml").write_text(edited)
    proc = _run([sys.executable, str(tmp_path / "gen-prometheusrule.py"), "--check"])
    assert proc.returncode == 1, proc.stderr


# ---- the dashboard ------------------------------------------------------------------------------


def test_metric_names_are_the_series_a_query_selects() -> None:
    expr = ('histogram_quantile(0.99, sum by (instance, le) (rate(kubeproxy_a_bucket{job=~"$job", code="503"}'
            '[$__rate_interval]))) > on (instance) group_left kubeproxy_b offset 5m and time() - up{x="y"} > 1e3 '
            'or label_replace(netproxy_c_total, "dst", "$1", "src", "(.*)")')
    assert metric_names(expr) == {"kubeproxy_a_bucket", "kubeproxy_b", "up", "netproxy_c_total"}
    assert metric_names("label_values(kubeproxy_d{job=~\"$job\"}, instance)") == {"kubeproxy_d"}


def test_every_query_reads_netproxys_names_only() -> None:
    for where, expr in {**alert_expressions(), **dashboard_expressions()}.items():
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert all(n.startswith(PREFIXES) for n in names), f"{where}: {sorted(names)}"


def test_the_dashboard_panels_are_valid_promql(promtool: str, tmp_path: Any) -> None:
    """Each panel's query, Grafana's variables given values, as a recording rule that promtool parses."""
    rules = []
    for i, (where, expr) in enumerate(sorted(dashboard_expressions().items())):
        if where.startswith("variable "):
            continue  # label_values() is Grafana's, not PromQL; its selector is checked by the name tests
        promql = expr.replace("$__rate_interval", "5m").replace("$job", ".*").replace("$instance", ".*")
        assert "$" not in promql, f"{where}: an unknown Grafana variable in {expr!r}"
        rules.append({"record": f"dashboard:query_{i}", "expr": promql})
    path = tmp_path / "dashboard.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = _run([promtool, "check", "rules", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_dashboard_imports_cleanly() -> None:
    """What Grafana's import needs: no fixed id, unique panel ids, every query on the chosen data source
    and filtered by the job/instance variables, panels that do not overlap."""
    dashboard = load_dashboard()
    assert dashboard["id"] is None and dashboard["uid"] == "netproxy"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    all_panels = panels(dashboard)
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    cells: Set[Any] = set()
    for panel in all_panels:
        grid = panel["gridPos"]
        xs, ys = range(grid["x"], grid["x"] + grid["w"]), range(grid["y"], grid["y"] + grid["h"])
        mine = {(x, y) for x in xs for y in ys}
        assert grid["x"] + grid["w"] <= 24 and not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert 'job=~"$job", instance=~"$instance"' in target["expr"], f"{panel['title']}: {target['expr']}"
