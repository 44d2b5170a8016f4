"""deploy/'s manifests against Kubernetes' own API schemas (kubernetes-validate, offline: the schemas
ship in its wheel), strictly (an unknown field is an error), for every minor version netproxy's
parity covers that the schemas exist for.  A misspelled field in a DaemonSet is caught (control).
deploy/monitoring/'s PrometheusRule, a custom resource those schemas do not know, is checked against
prometheus-operator's CRD instead (below)."""

from __future__ import annotations

import copy
import glob
import os
from typing import Any, Dict, List

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERSIONS = ["1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0"]
"""kube-proxy parity runs to 1.38; kubernetes-validate 1.37.0 carries schemas to 1.37."""


def _documents() -> List[Dict[str, Any]]:
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "deploy", "*.yaml"))):
        with open(path) as f:
            out += [d for d in yaml.safe_load_all(f) if d]
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_every_deploy_manifest_is_valid_for_the_kubernetes_version(version: str) -> None:
    docs = _documents()
    kinds = {"DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap"}
    assert {d["kind"] for d in docs} >= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_misspelled_field_is_refused() -> None:
    daemonset = next(d for d in _documents() if d["kind"] == "DaemonSet")
    bad = copy.deepcopy(daemonset)
    bad["spec"]["template"]["spec"]["hostNetwrk"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


# ---- deploy/monitoring/'s PrometheusRule --------------------------------------------------------
# kubernetes-validate carries Kubernetes' own schemas only (a PrometheusRule is SchemaNotFoundError), so
# the object is checked here against prometheus-operator's CRD (monitoring.coreos.com/v1, as of
# operator 0.82): its required fields (spec; a group's name; a rule's expr), its field types and
# duration pattern, one of alert/record per rule, unique group names (a list-map keyed by name).  Unknown
# fields are refused, which the API server would not do: it prunes them silently, and a misspelled
# `for` would silently make an alert fire at once.  The metadata is checked by kubernetes-validate as
# what it is, an ObjectMeta (inside a ConfigMap, which has no other required field).

DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
PROMETHEUS_RULE_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"groups": {"type": "array", "items": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string", "pattern": DURATION},
                    "query_offset": {"type": "string", "pattern": DURATION},
                    "limit": {"type": "integer"},
                    "labels": STRING_MAP,
                    "partial_response_strategy": {"type": "string"},
                    "rules": {"type": "array", "items": {
                        "type": "object",
                        "required": ["expr"],
                        "additionalProperties": False,
                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                        "properties": {
                            "alert": {"type": "string"},
                            "record": {"type": "string"},
                            "expr": {"type": ["string", "integer"]},
                            "for": {"type": "string", "pattern": DURATION},
                            "keep_firing_for": {"type": "string", "minLength": 1, "pattern": DURATION},
                            "labels": STRING_MAP,
                            "annotations": STRING_MAP,
                        },
                    }},
                },
            }}},
        },
    },
}


def _prometheus_rule() -> Dict[str, Any]:
    with open(os.path.join(ROOT, "deploy", "monitoring", "netproxy-prometheusrule.yaml")) as f:
        rule: Dict[str, Any] = yaml.safe_load(f)
    return rule


def _prometheus_rule_errors(rule: Dict[str, Any]) -> List[str]:
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(PROMETHEUS_RULE_SCHEMA).iter_errors(rule)]
    names = [g.get("name") for g in rule.get("spec", {}).get("groups", [])]
    if len(names) != len(set(names)):
        errors.append(f"spec.groups: duplicate names {names}")
    return errors


def test_kubernetes_validate_cannot_check_a_prometheusrule() -> None:
    """Why the test below exists: if kubernetes-validate ever learns CRDs, use it instead."""
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(_prometheus_rule(), VERSIONS[-1], strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_prometheusrule_has_the_operators_shape(version: str) -> None:
    rule = _prometheus_rule()
    assert _prometheus_rule_errors(rule) == []
    assert rule["spec"]["groups"] and all(g["rules"] for g in rule["spec"]["groups"])
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": rule["metadata"]}, version,
                                 strict=True)


@pytest.mark.parametrize("damage", ["misspelled for", "no expr", "bad duration", "alert and record"])
def test_a_damaged_prometheusrule_is_refused(damage: str) -> None:
    rule = _prometheus_rule()
    first = rule["spec"]["groups"][0]["rules"][0]
    if damage == "misspelled for":
        first["fro"] = first.pop("for")
    elif damage == "no expr":
        del first["expr"]
    elif damage == "bad duration":
        first["for"] = "15 minutes"
    else:
        first["record"] = "netproxy:x"
    assert _prometheus_rule_errors(rule)
