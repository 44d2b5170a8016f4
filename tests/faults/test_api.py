"""The API going away (fault 6), against the API stand-in in the node namespace.

One `netproxy run --kubeconfig` lives through, in order: the API down (every request cut unanswered,
watches dropped) for NETPROXY_API_DOWN_SECONDS (8 s in ``make test``, 60 s in ``make test-all``), the watches
closed, ``410 Gone`` in the watch streams, and slow answers.  Throughout: the last good state stays
programmed (traffic to the service is sampled, and periodic full syncs keep running at a short
``--sync-period``), /healthz stays 200 (no change is pending: kube-proxy's rule), the source retries
with backoff (the stand-in counts the attempts it refused) and recovers by itself: a change made
through the API after each fault reaches the kernel.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import pytest

from netproxy_lab.apiserver_process import StandInProcess
from netproxy_lab.cleanup import stop_netproxy
from netproxy_lab.combos import Combo
from netproxy_lab.manifests import api_object, port, service
from netproxy_lab.proxy import Proxy
from netproxy_lab.tier import knob
from netproxy_lab.topology import NODE_NAME, Pod, Sandbox
from tests.faults.figures import figure
from tests.faults.storm import netproxy_pid, wait_until
from tests.kernel.test_kube_source import kubeconfig as _kubeconfig
from tests.kernel.test_kube_source import web_slice

# The quick tier runs this fault on the two default node kinds (nftables, iptables-legacy); the
# full tier on every combination (lab/netproxy_lab/tier.py).
pytestmark = [pytest.mark.kernel, pytest.mark.quick_combos("nftables", "iptables-legacy/restore")]

HERE = os.path.dirname(os.path.abspath(__file__))

DOWN = knob("NETPROXY_API_DOWN_SECONDS", quick=8, full=60)
WEB_IP = "10.96.0.10"
SYNC_PERIOD = 3.0  # healthz timeout 2 x 3 s: a false 503 during a 15 s outage would show
HEALTHZ = "127.0.0.1:10356"
RECOVERY_LIMIT = 75.0
"""The reflectors' backoff is capped at 30 s with up to 2x jitter (client-go's): a retry is at most ~60 s
after the API comes back."""

SAMPLER = """
import sys, time, urllib.request, urllib.error
url, out = sys.argv[1], sys.argv[2]
with open(out, "a", buffering=1) as f:
    while True:
        try:
            code = urllib.request.urlopen(url, timeout=2).status
        except urllib.error.HTTPError as err:
            code = err.code
        except Exception:
            code = 0
        f.write(f"{time.time():.3f} {code}\\n")
        time.sleep(0.25)
"""

CLIENT = """
import json, sys, urllib.request
url, verb, body = sys.argv[1], sys.argv[2], sys.argv[3]
if verb == "fault":
    print(urllib.request.urlopen(urllib.request.Request(url + body, method="POST"), timeout=10).read().decode())
else:
    from kubernetes import client
    cfg = client.Configuration(); cfg.host = url
    obj = json.loads(body)
    client.DiscoveryV1Api(client.ApiClient(cfg)).replace_namespaced_endpoint_slice(obj["metadata"]["name"],
                                                                                   "default", obj)
    print("replaced")
"""


class Api:
    """Drives the stand-in from inside the node namespace (it listens on the node's loopback)."""

    def __init__(self, sandbox: Sandbox, url: str) -> None:
        self.sandbox, self.url = sandbox, url

    def _run(self, verb: str, body: str) -> str:
        out = self.sandbox.exec(self.sandbox.node, [sys.executable, "-c", CLIENT, self.url, verb, body], timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    def fault(self, what: str) -> Dict[str, Any]:
        result: Dict[str, Any] = json.loads(self._run("fault", f"/_fault/{what}"))
        return result

    def set_endpoints(self, pods: Sequence[Pod]) -> None:
        self._run("replace", json.dumps(web_slice(pods)))


ANSWER_TIMEOUT = 3.0
"""Seconds per connection: answers take milliseconds, but on a loaded machine a one-thread pod can take
far longer, and "the last good state was kept during the outage" must not fail on a slow answer.  A
connection the rules do not serve is refused at once or fails the batch whatever this is."""


def answered_by(sandbox: Sandbox, pods: Sequence[Pod]) -> Optional[str]:
    res = sandbox.connect(WEB_IP, 80, count=20, timeout=ANSWER_TIMEOUT)
    want = sorted(p.name for p in pods)
    return None if sorted(res.counts) == want and not res.errors else f"answered by {res.counts}, {res.errors}"


def healthz_codes(path: str, since: float, until: float) -> List[int]:
    with open(path) as f:
        rows = [line.split() for line in f if line.strip()]
    return [int(code) for t, code in rows if since <= float(t) <= until]


def test_the_api_going_away(proxy: Proxy, sandbox: Sandbox, combo: Combo, tmp_path: Any) -> None:
    a, b, c = sandbox.pods[:1], sandbox.pods[1:2], sandbox.pods[2:3]
    objects = {"services": [api_object(service("web", WEB_IP, [port(80, 8080, name="http")]))],
               "endpointslices": [web_slice(a)], "nodes": [{"metadata": {"name": NODE_NAME}}]}
    samples = str(tmp_path / "healthz")
    with StandInProcess(objects, prefix=["ip", "netns", "exec", sandbox.node]) as url:
        api = Api(sandbox, url)
        log_path = str(tmp_path / "run.log")
        proxy.run_log = log_path
        run = sandbox.start_netproxy(["run", "--kubeconfig", _kubeconfig(str(tmp_path / "kc"), url),
                                      "--hostname-override", NODE_NAME, "--metrics-bind-address", "",
                                      "--healthz-bind-address", HEALTHZ, "--sync-period", f"{SYNC_PERIOD:g}s",
                                      *combo.flags], flavour=combo.path_flavour, log_path=log_path)
        sampler = sandbox.popen(sandbox.node, [sys.executable, "-c", SAMPLER, f"http://{HEALTHZ}/healthz", samples],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: answered_by(sandbox, a), timeout=60)
            pid = netproxy_pid(run.pid)
            assert pid

            # 1. Down: every request cut unanswered for DOWN seconds.
            down_at = time.time()
            api.fault(f"down?seconds={DOWN:g}")
            kept: List[Optional[str]] = []
            while time.time() - down_at < DOWN:
                kept.append(answered_by(sandbox, a))
                time.sleep(0.5)
            assert not [k for k in kept if k], f"the last good state was not kept during the outage: {kept}"
            full_syncs = len(re.findall(r"synced full", proxy.run_output()[-200000:]))
            api.set_endpoints(b)
            recovery = wait_until(lambda: answered_by(sandbox, b), timeout=RECOVERY_LIMIT, step=0.5)
            refused = int(api.fault("drop")["refused"])  # also 2: the watches closed
            api.set_endpoints(c)
            after_drop = wait_until(lambda: answered_by(sandbox, c), timeout=20, step=0.3)

            # 3. 410 Gone in every watch stream: relist.
            api.fault("expire")
            api.set_endpoints(a)
            after_gone = wait_until(lambda: answered_by(sandbox, a), timeout=20, step=0.3)

            # 4. Slow: every answer 2 s late for 12 s, with the watches cut so that they must come back slowly.
            api.fault("slow?seconds=12&delay=2")
            api.fault("drop")
            api.set_endpoints(b)
            after_slow = wait_until(lambda: answered_by(sandbox, b), timeout=40, step=0.3)
            assert answered_by(sandbox, b) is None
            end = time.time()
            assert run.poll() is None, proxy.run_output()[-3000:]
        finally:
            sampler.kill()
            sampler.wait()
            stop_netproxy(run, timeout=15)
    log = proxy.run_output()
    codes = healthz_codes(samples, down_at, end)
    bad = [code for code in codes if code != 200]
    delays = [float(d) for d in re.findall(r"failed \(.*?\); retrying in ([0-9.]+)s", log)]
    # Three reflectors doubling their delay from 0.8 s; each of their attempts is up to 4 requests, as
    # urllib3 (under the kubernetes client) retries a dropped connection 3 times by itself.
    attempts_bound = 4 * 3 * (int(DOWN / 0.8).bit_length() + 3)
    span = f"{min(delays or [0]):.1f}..{max(delays or [0]):.1f}"
    figure(f"API down {DOWN:g} s, {combo.name}",
           f"last state kept ({len(kept)} traffic samples, {full_syncs} full syncs by then), healthz 200 in "
           f"{len(codes) - len(bad)}/{len(codes)} samples, {refused} requests refused, {len(delays)} retries "
           f"(backoff delays {span} s), change applied {recovery:.1f} s after the API came back; watch closed "
           f"{after_drop:.1f} s, 410 Gone {after_gone:.1f} s, slow answers {after_slow:.1f} s",
           "last state kept; healthz false only after the timeout; recovery automatic")
    assert not bad, f"/healthz answered {sorted(set(bad))} while no change was pending ({len(bad)} of {len(codes)})"
    assert codes, "no healthz samples"
    assert 0 < refused <= attempts_bound, f"{refused} reconnect attempts in {DOWN:g}s: no backoff?"
    assert "Traceback" not in log, log[-3000:]
