"""The API path: ``netproxy run --kubeconfig`` against the lab's API stand-in (and a real
kube-apiserver beside it), at N services.

What a real node does at start and under churn, measured from outside the process:

- ``serve``: the stand-in's own share — every page of services and slices (``limit=500``, the
  proxy's label selector) fetched by a bare HTTP client in the node namespace and not decoded, so
  the figures below can be read with what the server costs set apart;
- ``start``: ``netproxy run --kubeconfig`` started → the *last* service answering a connection from
  the client namespace (the poller of ``bench/latency.py``), with the process's peak RSS (VmHWM);
- ``burst``: once quiet, 2,000 EndpointSlice replacements PUT as fast as the stand-in takes them;
  the last one gives service N-2 (whose endpoints answered nothing) the sandbox's real pods, so
  "converged" is that service answering, timed from the moment the last PUT was answered; the RSS
  (VmRSS) before the burst and 3 s after convergence;
- ``real``: ``start`` against a real etcd and kube-apiserver holding the same objects
  (:func:`measure_real`);
- ``source``: ``netproxy run --source`` of the same objects in a file, started → the last service
  answering: the same proxy without the API, for the ratio;
- ``sync``: ``netproxy sync`` of that file into the emptied node, a new process (``bench.rss``): what
  ``run --source`` is held to (≤ 1.1×, ``bench.api.SOURCE_SYNC_TARGET``).

Every process runs in the sandbox's namespaces and is stopped by its PID; the stand-in holds the
cluster in memory (``netproxy_lab.apiserver``).

    python -m bench.apipath fetch URL           # the serve measure (run in the node namespace)
    python -m bench.apipath burst URL FILE      # PUT each slice of FILE (JSON list); print the last's time
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import quote, urlsplit

from bench import gen, rss
from bench.latency import _poll, _started, _tail, _wait_poll, proc_status_kib, vm_hwm_kib
from netproxy.source.convert import PROXY_LABEL_SELECTOR
from netproxy_lab import netns
from netproxy_lab.apiserver_process import StandInProcess, write_kubeconfig
from netproxy_lab.topology import netproxy_command

BURST = 2000
SETTLE = 3.0
"""Seconds after convergence before the RSS is read again: the allocator's chance to give back."""
_CONTINUE = re.compile(rb'"continue"\s*:\s*"([^"]*)"')
_PATHS = ("/api/v1/services", "/apis/discovery.k8s.io/v1/endpointslices")


def vm_rss_kib(pid: int) -> Optional[int]:
    return proc_status_kib(pid, "VmRSS")


# -- the helpers that run inside the node namespace ---------------------------------------------------


def fetch(url: str) -> Dict[str, float]:
    """Every page of services and slices, read and not decoded (the continue token found by a regex)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=120)
    out: Dict[str, float] = {}
    for path in _PATHS:
        t0 = time.monotonic()
        cont = ""
        size = 0
        while True:
            query = f"limit=500&labelSelector={quote(PROXY_LABEL_SELECTOR)}"
            if cont:
                query += f"&continue={quote(cont)}"
            conn.request("GET", f"{path}?{query}")
            body = conn.getresponse().read()
            size += len(body)
            m = _CONTINUE.search(body[:4096])
            cont = m.group(1).decode() if m else ""
            if not cont:
                break
        out[path.rsplit("/", 1)[1] + "_seconds"] = time.monotonic() - t0
        out[path.rsplit("/", 1)[1] + "_mb"] = size / 1e6
    return out


def burst(url: str, path: str) -> Dict[str, float]:
    """PUT every slice of ``path`` in order over one connection; the monotonic time of the last answer."""
    with open(path, encoding="utf-8") as fh:
        slices: List[Dict[str, Any]] = json.load(fh)
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=60)
    t0 = time.monotonic()
    for obj in slices:
        meta = obj["metadata"]
        conn.request("PUT", f"/apis/discovery.k8s.io/v1/namespaces/{meta['namespace']}/endpointslices/{meta['name']}",
                     body=json.dumps(obj), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise SystemExit(f"PUT {meta['name']}: HTTP {resp.status}")
    last = time.monotonic()
    return {"first": t0, "last": last}


# -- the measure, from the bench process --------------------------------------------------------------


def _objects(n: int, pods: Sequence[gen.PodAddr], node_ip: str) -> Dict[str, List[gen.Obj]]:
    objects = gen.cluster(n, "uniform", pods)
    return {"services": objects[0::2], "endpointslices": objects[1::2],
            "nodes": [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": gen.LOCAL_NODE, "labels": {}},
                       "status": {"addresses": [{"type": "InternalIP", "address": node_ip}]}}]}


def burst_slices(n: int, pods: Sequence[gen.PodAddr], count: int = BURST) -> List[gen.Obj]:
    """``count`` slice replacements spread over services 0..N-3, the last one giving service N-2 the pods."""
    objects = gen.cluster(n, "uniform", pods)
    out = [gen.replaced_endpoint(objects, (k * 7919) % max(1, n - 2), 1 + k // max(1, n - 2))
           for k in range(count - 1)]
    out.append(gen.endpoint_slice(gen.service_name(n - 2), pods))
    return out


def _start_run(sandbox: Any, combo: Any, args: Sequence[str], log_path: str) -> subprocess.Popen:  # type: ignore[type-arg]
    env = dict(os.environ)
    env["PATH"] = sandbox.iptables_bindir(combo.flavour) + os.pathsep + env.get("PATH", "/usr/sbin:/usr/bin")
    with open(log_path, "wb") as log:
        return netns.spawn(sandbox.node, [*netproxy_command(), "run", *args, *combo.flags,
                                          "--hostname-override", gen.LOCAL_NODE, "--metrics-bind-address", "",
                                          "--healthz-bind-address", "", "--log-level", "info"],
                           stdout=log, stderr=subprocess.STDOUT, env=env)


def _until_answers(sandbox: Any, client: Sequence[str], proc: subprocess.Popen, n: int,  # type: ignore[type-arg]
                   t0: float, timeout: float, log_path: str) -> Dict[str, Any]:
    poller = _poll(sandbox, client, gen.cluster_ip(n - 1), gen.PORT, timeout)
    if not _started(poller, proc, timeout + 5):
        netns.stop(poller)
        why = f"exited {proc.returncode}: {_tail(log_path)}" if proc.poll() is not None else \
            f"did not program the last service within {timeout:.0f} s"
        return {"error": f"netproxy run {why} (log {log_path})"}
    return {"seconds": time.monotonic() - t0}


def _python_in(sandbox: Any, args: Sequence[str], timeout: float) -> Dict[str, Any]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    try:
        proc = netns.run_in_timeout(sandbox.node, [sys.executable, "-m", "bench.apipath", *args], timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout}
    if proc.returncode != 0:
        return {"error": (proc.stderr or b"").decode(errors="replace")[-300:]}
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


def measure(sandbox: Any, combo: Any, n: int, client: Sequence[str], workdir: str,
            timeout: float = 120.0, burst_count: int = BURST, real: bool = True) -> Dict[str, Any]:
    """The five measures above for ``combo`` at ``n`` services; a failed step says so in its cell."""
    pods = [(p.ip, 8080) for p in sandbox.pods]
    tag = f"{combo.name.replace('/', '-')}-{n}"
    objects = _objects(n, pods, sandbox.node_ips[0])
    source = os.path.join(workdir, f"api-source-{tag}.json")
    gen.write_json(source, [o for pair in zip(objects["services"], objects["endpointslices"]) for o in pair])
    slices = os.path.join(workdir, f"api-burst-{tag}.json")
    with open(slices, "w", encoding="utf-8") as fh:
        json.dump(burst_slices(n, pods, burst_count), fh)
    out: Dict[str, Any] = {}
    with StandInProcess(objects, prefix=netns.exec_args(sandbox.node, [])) as url:
        kubeconfig = write_kubeconfig(os.path.join(workdir, f"api-kubeconfig-{tag}"), url)
        out["serve"] = _python_in(sandbox, ["fetch", url], timeout)

        def burst(proc: subprocess.Popen) -> Dict[str, Any]:  # type: ignore[type-arg]
            return _burst(sandbox, client, proc, n, url, slices, timeout)

        out["start"], out["burst"] = _timed_run(sandbox, combo, client, n, ["--kubeconfig", kubeconfig],
                                                os.path.join(workdir, f"netproxy-run-api-{tag}.log"), timeout, burst)
    out["real"] = measure_real(sandbox, combo, n, client, workdir, objects, timeout) if real else \
        {"skipped": "--no-real"}
    out["source"], _ = _timed_run(sandbox, combo, client, n, ["--source", source],
                                  os.path.join(workdir, f"netproxy-run-source-{tag}.log"), timeout)
    # The node is empty again (_timed_run resets it): `netproxy sync` of the same file, a new process.
    out["sync"] = rss.measure_sync(sandbox, combo, source, timeout, os.path.join(workdir, f"netproxy-sync-{tag}.log"),
                                   node_name=gen.LOCAL_NODE)
    sandbox.reset_netfilter()
    return out


def measure_real(sandbox: Any, combo: Any, n: int, client: Sequence[str], workdir: str,
                 objects: Dict[str, List[gen.Obj]], timeout: float) -> Dict[str, Any]:
    """``start`` again, against a real etcd and kube-apiserver (``make control-plane``) in the node
    namespace holding the same objects, created through it (the slices written directly, as
    another controller would: the controller manager is off).  Its figure sits beside the
    stand-in's in the same run; ``load_seconds`` is the creation through the API, not netproxy's."""
    from netproxy_lab.controlplane import BuildFailed, ControlPlane, Unavailable

    try:
        cp = ControlPlane(sandbox.node, controllers=False, workdir=workdir)
    except (Unavailable, BuildFailed) as err:
        return {"error": f"no real control plane: {err}"}
    with cp:
        items = []
        for svc in objects["services"]:
            svc = json.loads(json.dumps(svc))
            if svc["spec"]["clusterIP"] == "10.96.0.1":
                # The `kubernetes` Service holds the range's first address: let the server pick.
                del svc["spec"]["clusterIP"], svc["spec"]["clusterIPs"]
            items.append((f"/api/v1/namespaces/{gen.NAMESPACE}/services", svc))
        items += [(f"/apis/discovery.k8s.io/v1/namespaces/{gen.NAMESPACE}/endpointslices", sl)
                  for sl in objects["endpointslices"]]
        t0 = time.monotonic()
        cp.ensure_namespace(gen.NAMESPACE, wait_for_account=False)
        cp.admin.create_many([("/api/v1/nodes", node) for node in objects["nodes"]] + items)
        load = time.monotonic() - t0
        start, _ = _timed_run(sandbox, combo, client, n, ["--kubeconfig", cp.admin_kubeconfig],
                              os.path.join(workdir, f"netproxy-run-real-{combo.name.replace('/', '-')}-{n}.log"),
                              timeout)
    start["load_seconds"] = load
    start["server"] = ", ".join(f"{k} {v}" for k, v in sorted(cp.bins.versions.items()))
    return start


def _timed_run(sandbox: Any, combo: Any, client: Sequence[str], n: int, args: Sequence[str], log_path: str,
               timeout: float, then: Optional[Callable[[Any], Dict[str, Any]]] = None
               ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``netproxy run ARGS`` from start to the last service answering, with its peak RSS; then
    ``then(process)`` while it still runs; stopped, and the node's tables reset, after."""
    t0 = time.monotonic()
    proc = _start_run(sandbox, combo, args, log_path)
    after: Dict[str, Any] = {"skipped": "the start failed"}
    try:
        start = _until_answers(sandbox, client, proc, n, t0, timeout, log_path)
        start["maxrss_mib"] = (vm_hwm_kib(proc.pid) or 0) / 1024
        if then is not None and "seconds" in start:
            after = then(proc)
    finally:
        netns.stop(proc)
        sandbox.reset_netfilter()
    return start, after


def _burst(sandbox: Any, client: Sequence[str], proc: subprocess.Popen, n: int,  # type: ignore[type-arg]
           url: str, slices: str, timeout: float) -> Dict[str, Any]:
    time.sleep(2.0)  # the first sync's min-sync-period passes: the burst starts from quiet
    before = vm_rss_kib(proc.pid) or 0
    poller = _poll(sandbox, client, gen.cluster_ip(n - 2), gen.PORT, timeout)
    time.sleep(0.05)
    put = _python_in(sandbox, ["burst", url, slices], timeout)
    if "last" not in put:
        netns.stop(poller)
        return {"error": f"the burst failed: {put}"}
    answered = _wait_poll(poller, timeout + 5)
    if answered is None:
        return {"error": f"service N-2 did not answer within {timeout:.0f} s of the burst"}
    time.sleep(SETTLE)
    after = vm_rss_kib(proc.pid) or 0
    return {"puts_seconds": put["last"] - put["first"], "converged_seconds": max(0.0, answered - put["last"]),
            "rss_before_mib": before / 1024, "rss_after_mib": after / 1024,
            "rss_growth_mib": (after - before) / 1024, "maxrss_mib": (vm_hwm_kib(proc.pid) or 0) / 1024}


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["fetch"] and len(args) == 2:
        print(json.dumps(fetch(args[1])))
    elif args[:1] == ["burst"] and len(args) == 3:
        print(json.dumps(burst(args[1], args[2])))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
