"""deploy/: the manifests parse, RBAC grants exactly what the API source uses, the DaemonSet mounts
and runs what the backends need, and the container entrypoint picks the host's iptables flavour.

The RBAC test does not trust a list written here: it runs the real source against the API stand-in
and reads which collections it actually requested.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import subprocess
from typing import Any, Dict, Iterator, List, Set, Tuple

import pytest
import yaml

from netproxy.cli import build_parser
from netproxy.source.kube import KubeSource
from netproxy_lab.apiserver import ApiServer
from tests.unit.kube.kube_helpers import FAST, RecordingTracker, make_client, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")


Grant = Tuple[str, str, str]  # (apiGroup, resource, verb)


def docs(name: str) -> List[Dict[str, Any]]:
    with open(os.path.join(DEPLOY, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def by_kind(name: str, kind: str) -> List[Dict[str, Any]]:
    return [d for d in docs(name) if d["kind"] == kind]


def daemonset() -> Dict[str, Any]:
    (ds,) = by_kind("daemonset.yaml", "DaemonSet")
    return ds


def container() -> Dict[str, Any]:
    (c,) = daemonset()["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(DEPLOY) if n.endswith(".yaml")))
def test_manifests_parse_and_name_themselves(name: str) -> None:
    found = docs(name)
    assert found
    for d in found:
        assert d["apiVersion"] and d["kind"] and d["metadata"]["name"]
        if d["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert d["metadata"]["namespace"] == "kube-system"


def grants(*files: str) -> Set[Grant]:
    out: Set[Grant] = set()
    for f in files:
        for role in by_kind(f, "ClusterRole"):
            for rule in role["rules"]:
                assert "resourceNames" not in rule and "nonResourceURLs" not in rule
                out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def used_by_source(use_endpoints: bool) -> Set[Grant]:
    """Run the real source against the stand-in; every collection it requested, as read grants."""
    with ApiServer() as api:
        api_client = make_client(api.url)
        tracker = RecordingTracker()
        source = KubeSource(api_client, "node-a", use_endpoints=use_endpoints, settings=FAST)
        source.start(tracker)
        try:
            wait_for(lambda: tracker.ready and all(r.watches for r in source.reflectors), what="lists and watches")
        finally:
            source.stop()
            api_client.close()
        out: Set[Grant] = set()
        for method, path, query in api.requests:
            assert method == "GET", f"the source wrote: {method} {path}"
            # Collections only (no name after the resource): a single-object get would need "get".
            m = re.fullmatch(r"/api/v1/(\w+)|/apis/([\w.]+)/v1/(\w+)", path)
            assert m, path
            group, resource = ("", m.group(1)) if m.group(1) else (m.group(2), m.group(3))
            out.add((group, resource, "watch" if query.get("watch") in ("true", "1") else "list"))
        return out


def test_rbac_grants_exactly_what_the_source_uses() -> None:
    assert grants("rbac.yaml") == used_by_source(use_endpoints=False)


def test_legacy_endpoints_role_adds_exactly_endpoints() -> None:
    assert grants("rbac.yaml", "rbac-endpoints.yaml") >= used_by_source(use_endpoints=True)
    assert grants("rbac-endpoints.yaml") == {("", "endpoints", v) for v in ("list", "watch")}


def test_bindings_bind_the_daemonsets_service_account() -> None:
    (sa,) = by_kind("rbac.yaml", "ServiceAccount")
    spec = daemonset()["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == sa["metadata"]["name"]
    roles = {r["metadata"]["name"] for f in ("rbac.yaml", "rbac-endpoints.yaml") for r in by_kind(f, "ClusterRole")}
    for f in ("rbac.yaml", "rbac-endpoints.yaml"):
        (binding,) = by_kind(f, "ClusterRoleBinding")
        assert binding["roleRef"]["name"] in roles
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                        "namespace": sa["metadata"]["namespace"]}]


def test_daemonset_runs_on_every_node_in_the_host_network() -> None:
    spec = daemonset()["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert {"operator": "Exists"} in spec["tolerations"]  # no key: tolerates every taint
    assert spec["priorityClassName"] == "system-node-critical"
    # Cluster DNS is a Service: resolving the API server through it would need the proxy first.
    assert spec["dnsPolicy"] == "Default"


def test_daemonset_has_what_the_backends_need() -> None:
    c = container()
    sec = c["securityContext"]
    assert sec.get("privileged") is False
    assert set(sec["capabilities"]["add"]) == {"NET_ADMIN", "NET_RAW"}
    volumes = {v["name"]: v for v in daemonset()["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    # iptables-restore --wait locks /run/xtables.lock: it must be the host's file, not a container copy.
    lock = volumes[mounts["/run/xtables.lock"]["name"]]
    assert lock["hostPath"] == {"path": "/run/xtables.lock", "type": "FileOrCreate"}
    assert not mounts["/run/xtables.lock"].get("readOnly")


@pytest.mark.parametrize("name", ["daemonset.yaml", "daemonset-kubeadm.yaml"])
def test_the_privileged_set_up_is_an_init_container_with_init_only(name: str) -> None:
    """kube-proxy's split layout: ``run --init-only`` privileged in an init container (sysctls,
    modules), the proxy itself with NET_ADMIN and NET_RAW only; both the same image and node."""
    (ds,) = by_kind(name, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    (proxy,) = spec["containers"]
    assert init["image"] == proxy["image"] and init["command"] == proxy["command"]
    args = cli_args(init["args"])
    assert (args.command, args.init_only, args.hostname_override) == ("run", True, "node-1")
    assert init["securityContext"] == {"privileged": True}
    assert proxy["securityContext"]["privileged"] is False and not cli_args(proxy["args"]).init_only
    # What the proxy reads its settings from, the init container reads too (kubeadm: --config).
    assert [a for a in init["args"] if a.startswith("--config")] == [a for a in proxy["args"]
                                                                     if a.startswith("--config")]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert volumes[mounts["/lib/modules"]["name"]]["hostPath"]["path"] == "/lib/modules"


def cli_args(args: List[str]) -> Any:
    return build_parser().parse_args([a.replace("$(NODE_NAME)", "node-1") for a in args])


def test_daemonset_arguments_are_real_flags_and_probe_the_health_port() -> None:
    c = container()
    args = cli_args(c["args"])
    assert args.command == "run" and args.hostname_override == "node-1"
    assert args.kubeconfig is None and args.source is None  # in-cluster config
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The API server's address comes from the ConfigMap, under keys that exist there.
    (cm,) = by_kind("config.yaml", "ConfigMap")
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        ref = env[var]["valueFrom"]["configMapKeyRef"]
        assert ref["name"] == cm["metadata"]["name"] and ref["key"] in cm["data"]
    probe = c["livenessProbe"]["httpGet"]
    assert probe["path"] == "/livez"  # /healthz answers 503 while the node drains: no restarts then
    assert str(probe["port"]) == args.healthz_bind_address.rpartition(":")[2]
    assert args.healthz_bind_address.startswith("0.0.0.0:")  # the kubelet probes the node's address


def containerfile() -> List[Tuple[str, str]]:
    with open(os.path.join(DEPLOY, "Containerfile")) as f:
        text = f.read().replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_containerfile_installs_both_iptables_flavours_and_libnftables() -> None:
    steps = containerfile()
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    # With its defaults (a registry), the base is Python's slim Debian image; make image passes its own.
    args = dict(arg.split("=", 1) for op, arg in steps if op == "ARG" and "=" in arg)
    assert final[0] == ("FROM", "${BASE}")
    assert re.match(r"docker\.io/library/python:3\.\d+-slim", args["BASE"])
    assert ("FROM", "wheels-${WHEELS:-source} AS wheels") in steps
    # The packages it installs with apt unless the base has them.
    installs = re.findall(r"[\w.+-]+", " ".join(arg for op, arg in final if op == "RUN" and "dpkg-query" in arg))
    assert {"iptables", "nftables", "libnftables1", "apt-get"} <= set(installs)
    # Every file copied from the build context exists in the repository, but for the wheels/ of make
    # image's own context (scripts/build-image writes it).
    for op, arg in steps:
        if op == "COPY" and not arg.startswith("--from") and arg != "wheels /wheels":
            for src in arg.split()[:-1]:
                assert os.path.exists(os.path.join(ROOT, src)), src
    copies = [arg.split() for op, arg in final if op == "COPY" and not arg.startswith("--from")]
    (entry,) = [arg for op, arg in final if op == "ENTRYPOINT"]
    assert yaml.safe_load(entry) == container()["command"]
    assert ["deploy/netproxy-entrypoint.sh", container()["command"][0]] in copies


def test_systemd_unit() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(os.path.join(DEPLOY, "netproxy.service"))
    service = unit["Service"]
    assert unit["Unit"]["Conflicts"] == "kube-proxy.service"
    assert service["Restart"] == "always"
    assert set(service["CapabilityBoundingSet"].split()) == {"CAP_NET_ADMIN", "CAP_NET_RAW"}
    assert "/run" in service["ReadWritePaths"].split()  # /run/xtables.lock
    argv = shlex.split(service["ExecStart"].replace("${NETPROXY_KUBECONFIG}", "/etc/netproxy/kubeconfig")
                       .replace("$NETPROXY_ARGS", "--cluster-cidr=10.244.0.0/16"))
    assert argv[0].endswith("/netproxy")
    args = cli_args(argv[1:])
    assert args.command == "run" and args.kubeconfig == "/etc/netproxy/kubeconfig"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


# -- the entrypoint, with stand-in iptables binaries (nothing here reads or writes netfilter) ----

SAVE_STUB = """#!/bin/sh
# a stand-in for {name}: prints what the test put in its file
case " $* " in *" -t mangle "*) cat "{dir}/{name}.mangle" 2>/dev/null;; *) cat "{dir}/{name}.all" 2>/dev/null;; esac
exit 0
"""


@pytest.fixture
def stubs(tmp_path: Any) -> Iterator[Tuple[str, Dict[str, str]]]:
    """A PATH with only stand-in iptables binaries, a stand-in netproxy and the shell tools needed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "grep", "timeout", "ln", "mkdir", "cat", "readlink"):
        real = shutil.which(tool)
        assert real, tool
        os.symlink(real, bin_dir / tool)
    for flavour in ("legacy", "nft"):
        for base in ("iptables", "ip6tables"):
            for suffix in ("", "-save", "-restore"):
                name = f"{base}-{flavour}{suffix}"
                body = SAVE_STUB.format(name=name, dir=tmp_path) if suffix == "-save" else "#!/bin/sh\nexit 0\n"
                (bin_dir / name).write_text(body)
                (bin_dir / name).chmod(0o755)
    (bin_dir / "netproxy").write_text('#!/bin/sh\necho "iptables=$(readlink "$(command -v iptables)")" "args=$*"\n')
    (bin_dir / "netproxy").chmod(0o755)
    env = {"PATH": str(bin_dir), "NETPROXY_IPTABLES_BIN": str(tmp_path / "chosen")}
    yield str(tmp_path), env


def entrypoint(env: Dict[str, str], **extra: str) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return subprocess.run(["/bin/sh", os.path.join(DEPLOY, "netproxy-entrypoint.sh"), "run", "--x"],
                          env={**env, **extra}, capture_output=True, text=True, timeout=30)


def put(tmp: str, name: str, kind: str, text: str) -> None:
    with open(os.path.join(tmp, f"{name}.{kind}"), "w") as f:
        f.write(text)


RULES = "*nat\n:PREROUTING ACCEPT [0:0]\n" + "".join(f"-A PREROUTING -d 10.0.0.{i}/32 -j ACCEPT\n"
                                                      for i in range(12)) + "COMMIT\n"


@pytest.mark.parametrize("where, expected", [
    ("iptables-nft-save.mangle", "nft"),
    ("ip6tables-nft-save.mangle", "nft"),
    ("iptables-legacy-save.mangle", "legacy"),
])
def test_entrypoint_follows_kubelets_hint(stubs: Tuple[str, Dict[str, str]], where: str, expected: str) -> None:
    tmp, env = stubs
    name, kind = where.rsplit(".", 1)
    put(tmp, name, kind, "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n")
    # More legacy rules than nft ones would say legacy: the hint wins over counting.
    put(tmp, "iptables-legacy-save", "all", RULES)
    out = entrypoint(env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"iptables={os.path.join(tmp, 'bin', 'iptables-' + expected)}", "args=run", "--x"]
    assert f"host iptables flavour: {expected}" in out.stderr


@pytest.mark.parametrize("legacy_rules, nft_rules, expected", [
    (RULES, "", "legacy"), ("", RULES, "nft"), ("", "", "nft"), (RULES, RULES, "nft")])
def test_entrypoint_counts_rules_without_a_hint(stubs: Tuple[str, Dict[str, str]], legacy_rules: str,
                                                nft_rules: str, expected: str) -> None:
    tmp, env = stubs
    put(tmp, "iptables-legacy-save", "all", legacy_rules)
    put(tmp, "ip6tables-nft-save", "all", nft_rules)
    out = entrypoint(env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"iptables={os.path.join(tmp, 'bin', 'iptables-' + expected)} ")
    chosen = os.path.join(tmp, "chosen")
    assert sorted(os.listdir(chosen)) == sorted(
        f"{b}{s}" for b in ("iptables", "ip6tables") for s in ("", "-save", "-restore"))
    assert os.readlink(os.path.join(chosen, "ip6tables-restore")).endswith(f"ip6tables-{expected}-restore")


def test_entrypoint_forced_and_invalid_flavour(stubs: Tuple[str, Dict[str, str]]) -> None:
    tmp, env = stubs
    put(tmp, "iptables-nft-save", "mangle", "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n")
    out = entrypoint(env, NETPROXY_IPTABLES_FLAVOUR="legacy")
    assert out.stdout.startswith(f"iptables={os.path.join(tmp, 'bin', 'iptables-legacy')} ")
    bad = entrypoint(env, NETPROXY_IPTABLES_FLAVOUR="both")
    assert bad.returncode == 1 and "must be auto, legacy or nft" in bad.stderr and not bad.stdout
