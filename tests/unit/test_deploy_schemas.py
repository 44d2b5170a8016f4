"""deploy/'s manifests against Kubernetes' own API schemas (kubernetes-validate, offline: the schemas
ship in its wheel), strictly (an unknown field is an error), for every minor version netproxy's
parity covers that the schemas exist for.  A misspelled field in a DaemonSet is caught (control)."""

from __future__ import annotations

import copy
import glob
import os
from typing import Any, Dict, List

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
