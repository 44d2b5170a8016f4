"""The two-service cluster the restart-by-adoption tests of both backends start from (web over TCP,
dns over UDP, on the sandbox's pods)."""

from __future__ import annotations

from typing import List, Sequence

from netproxy_lab.manifests import Manifest, endpoint_slice, port, service
from netproxy_lab.topology import Pod

WEB_IP = "10.96.0.10"
DNS_IP = "10.96.0.53"


def cluster(web: Sequence[Pod], dns: Sequence[Pod]) -> List[Manifest]:
    return [service("web", WEB_IP, [port(80, 8080, name="http")]),
            endpoint_slice("web", web, [port(8080, name="http")]),
            service("dns", DNS_IP, [port(53, 8080, name="dns", protocol="UDP")]),
            endpoint_slice("dns", dns, [port(8080, name="dns", protocol="UDP")])]
