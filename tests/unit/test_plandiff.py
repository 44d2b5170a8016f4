"""plan --diff's pure parts: the listings' normalisation and the grouping by service."""

from __future__ import annotations

import ipaddress

from netproxy.backends.iptables.listing import _ours, split_plan
from netproxy.backends.nftables.listing import normalise
from netproxy.cli import plandiff
from netproxy.core.model import NodeInfo, ServicePort, ServicePortName, Snapshot

WEB = ServicePortName("default", "web", "http")


def _snapshot() -> Snapshot:
    svc = ServicePort(WEB, "TCP", 80, 8080, cluster_ips=(ipaddress.ip_address("10.96.0.10"),))
    return Snapshot({WEB: svc}, {WEB: ()}, NodeInfo("n"))


NFT = """table ip netproxy {
	map service-ips {
		type ipv4_addr . inet_proto . inet_service : verdict
		elements = { 10.96.0.53 . udp . 53 comment "kube-system/dns:dns" : goto cluster-udp-pick-2,
				10.96.0.10 . tcp . 80 comment "default/web:http" : goto cluster-tcp-pick-3 }
	}
	map affinity-tcp {
		type ipv4_addr . ipv4_addr . inet_service : ipv4_addr . inet_service
		flags dynamic,timeout
		elements = { 10.0.0.1 . 10.96.0.10 . 80 timeout 3h expires 2h59m : 10.244.1.11 . 8080 }
	}
	chain services {
		ip daddr . meta l4proto . th dport vmap @service-ips
	}
}
"""


def test_nft_listing_is_one_line_per_object_sorted_without_affinity_entries() -> None:
    lines = normalise(NFT)
    elements = [x for x in lines if " element " in x]
    assert elements == sorted(elements) and len(elements) == 2, "elements sorted, the expiring one dropped"
    assert "table ip netproxy chain services ip daddr . meta l4proto . th dport vmap @service-ips" in lines
    assert normalise(NFT.replace("10.96.0.53 . udp", "10.96.0.99 . udp")) != lines


SAVE = """*nat
:PREROUTING ACCEPT [5:300]
:KUBE-SERVICES - [0:0]
:DOCKER - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -j DOCKER
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-X
COMMIT
"""


def test_iptables_listing_keeps_only_ours_without_counters() -> None:
    assert _ours(SAVE, 4) == [
        "ipv4 nat :KUBE-SERVICES",
        "ipv4 nat -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-X",
        'ipv4 nat -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
    ]
    assert sorted(split_plan("# IPv4 (x)\n*nat\nCOMMIT\n# IPv6 (y)\n*nat\nCOMMIT\n")) == [4, 6]


def test_diff_groups_by_service_and_is_empty_when_equal() -> None:
    snap = _snapshot()
    kernel = ['ipv4 nat -A KUBE-SVC-X -m comment --comment "default/web:http" -j DNAT --to-destination 10.244.1.11:80',
              "ipv4 nat -A KUBE-HAIRPIN -s 10.244.1.11/32 -d 10.244.1.11/32 -j KUBE-MARK-MASQ"]
    assert plandiff.diff(kernel, list(kernel), snap) == {}
    rendered = [kernel[0].replace("1.11:80", "1.12:80"),
                "table ip netproxy map m element 10.96.0.10 . 80 . 0 : 10.244.1.12 . 8080"]
    changes = plandiff.diff(kernel, rendered, snap)
    assert set(changes) == {"default/web:http", plandiff.SHARED}
    assert changes["default/web:http"] == (rendered, [kernel[0]]), "by comment, and by address . port"
    assert changes[plandiff.SHARED] == ([], [kernel[1]])
    text = plandiff.render(changes)
    assert text.index("default/web:http: +2 -1") < text.index(plandiff.SHARED)
    assert plandiff.diff(kernel, kernel[::-1], snap) != {}, "a reordering is a change"


def test_status_kernel_reads_service_ports_from_both_listings() -> None:
    from netproxy.backends.iptables.listing import programmed as ipt_programmed
    from netproxy.backends.nftables.listing import programmed as nft_programmed

    nft = NFT.replace("\tchain services {", """\tmap cluster-tcp-endpoints-1 {
		type ipv4_addr . inet_service . integer : ipv4_addr . inet_service
		elements = { 10.96.0.10 . 80 . 0 : 10.244.1.11 . 8080 }
	}
	chain cluster-tcp-pick-3 {
		dnat ip to ip daddr . tcp dport . numgen random mod 1 map @cluster-tcp-endpoints-1
	}
	chain services {""")
    assert ("default/web:http", "10.96.0.10:80/tcp", ("10.244.1.11:8080",)) in nft_programmed(normalise(nft))
    # A service stamp after the name (backends/nftables/stamp.py) is not part of it; the table
    # stamp is not listed (no plan has it).
    stamped = nft.replace('"default/web:http"', '"default/web:http d:0123456789abcdef"').replace(
        "\tchain services {", '\tset stamp {\n\t\ttype inet_service\n\t\telements = { 1 comment "netproxy 1 '
        'config:0123456789abcdef gen:7" }\n\t}\n\tchain services {')
    assert "table ip netproxy set stamp type inet_service" in normalise(stamped)
    assert not [line for line in normalise(stamped) if "config:" in line]
    assert ("default/web:http", "10.96.0.10:80/tcp", ("10.244.1.11:8080",)) in nft_programmed(normalise(stamped))
    save = SAVE.replace("COMMIT", '-A KUBE-SVC-X -m comment --comment "default/web:http" -j DNAT '
                                  '--to-destination 10.244.1.11:8080\nCOMMIT').replace(
        "-d 10.96.0.10/32 -p tcp", '-d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http"')
    assert ipt_programmed(_ours(save, 4)) == [("default/web:http", "10.96.0.10:80/tcp", ("10.244.1.11:8080",))]
