"""The flows of kube-proxy's tables that the kernel stage also sends as traffic
(``tests/kernel/test_conformance.py``): a few of every table, chosen so that the kinds of answer
vary (endpoints masqueraded or not, only local ones, DROP, REJECT, untouched; IPv4 and IPv6; TCP and
UDP; from a pod, the node, 127.0.0.1, outside, an endpoint to itself; the "endpoints deleted" states).

Keyed by table; each flow by its id less the table (``subtest::state::flow [PROTO]``).  Left out:
SCTP (not every kernel has it) and the flows whose source is the destination itself ("same node to
LB, SNATted to LB": no namespace can send to its own address through the node).
"""

from __future__ import annotations

from typing import Dict, Tuple

SAMPLE: Dict[str, Tuple[str, ...]] = {
    "iptables/TestNoEndpointsReject": (
        "pod to cluster IP with no endpoints [TCP]",
        "external to NodePort with no endpoints [TCP]",
        "external to LoadBalancer IP with no endpoints [TCP]",
    ),
    "iptables/TestClusterIPGeneral": (
        "hairpin to cluster IP [TCP]",
        "clusterIP with TargetPort [TCP]",
        "clusterIP with TCP, UDP, and SCTP on same port (UDP) [UDP]",
        "svc1 does not accept svc2's ports [TCP]",
    ),
    "iptables/TestLoadBalancer": (
        "accepted external to LB1 [TCP]",
        "blocked external to LB1 [TCP]",
        "pod to LB2 (blocked by LoadBalancerSourceRanges) [TCP]",
        "node to LB2 (allowed by LoadBalancerSourceRanges) [TCP]",
    ),
    "iptables/TestNodePorts": (
        "ipv4, localhost-nodeports enabled::localhost to nodePort gets masqueraded [TCP]",
        "ipv4, localhost-nodeports enabled::external to nodePort on secondary IP [TCP]",
        "ipv4, localhost-nodeports disabled, localhost in nodeport-addresses::secondary nodeIP ignores NodePorts [TCP]",
        "ipv6, localhost-nodeports enabled::external to nodePort [TCP]",
        "ipv6, localhost-nodeports enabled::pod to cluster IP [TCP]",
    ),
    "iptables/TestHealthCheckNodePort": (
        "firewall accepts HealthCheckNodePort [TCP]",
        "service deleted::HealthCheckNodePort no longer has any rule [TCP]",
    ),
    "iptables/TestExternalTrafficPolicyLocal": (
        "external to NodePort hits only local endpoint, unmasqueraded [TCP]",
        "pod to LB IP hits only both endpoints, unmasqueraded [TCP]",
        "external to external IP hits only local endpoint, unmasqueraded [TCP]",
    ),
    "iptables/TestExternalTrafficPolicyCluster": (
        "external to LB IP hits both endpoints, masqueraded [TCP]",
        "pod to NodePort hits both endpoints, masqueraded [TCP]",
    ),
    "iptables/TestInternalTrafficPolicy": (
        "internalTrafficPolicy is local and there is one local endpoint::"
        "pod to ClusterIP hits only local endpoint [TCP]",
        "internalTrafficPolicy is local and there is one local endpoint::endpoints deleted::endpoints deleted [TCP]",
        "internalTrafficPolicy is local and there are no local endpoints::no endpoints [TCP]",
    ),
    "iptables/TestTerminatingEndpointsTrafficPolicyLocal": (
        "only terminating endpoints exist::pod to clusterIP [TCP]",
        "only terminating endpoints exist::external to LB [TCP]",
        "terminating endpoints on remote node::external to LB, no locally-usable endpoints [TCP]",
        "no usable endpoints on any node::pod to clusterIP, no usable endpoints [TCP]",
    ),
    "iptables/TestTerminatingEndpointsTrafficPolicyCluster": (
        "only terminating endpoints exist::external to LB [TCP]",
        "only terminating endpoints exist::endpoints deleted::pod to clusterIP after endpoints deleted [TCP]",
    ),
    "iptables/TestInternalExternalMasquerade": (
        "base::pod to NodePort with eTP:Local [TCP]",
        "base::external to LB with eTP:Local [TCP]",
        "base::node to ClusterIP with iTP:Local [TCP]",
        "no LocalTrafficDetector::pod to LB with eTP:Local [TCP]",
        "no LocalTrafficDetector::external to ClusterIP [TCP]",
        "masqueradeAll::pod to ClusterIP [TCP]",
        "masqueradeAll, no LocalTrafficDetector::localhost to NodePort with iTP:Local [TCP]",
    ),
    "iptables/TestTracePacket": (
        "multiple endpoints [TCP]",
        "LOCAL, KUBE-MARK-MASQ [TCP]",
        "DROP [TCP]",
        "REJECT [TCP]",
    ),
    "nftables/TestNoEndpointsReject": (
        "pod to NodePort with no endpoints [TCP]",
        "external to external IP with no endpoints [TCP]",
    ),
    "nftables/TestClusterIPGeneral": (
        "simple clusterIP [TCP]",
        "hairpin to cluster IP [TCP]",
        "TCP-only port does not match UDP traffic [UDP]",
        "packet to unallocated cluster ip [TCP]",
    ),
    "nftables/TestLoadBalancer": (
        "nodePort bypasses LoadBalancerSourceRanges [TCP]",
        "blocked external to LB2 [TCP]",
        "node to LB1 (allowed by LoadBalancerSourceRanges) [TCP]",
    ),
    "nftables/TestNodePorts": (
        "ipv4::secondary nodeIP ignores NodePorts [TCP]",
        "ipv6::node to nodePort [TCP]",
        "ipv6, multiple nodeport-addresses::external to nodePort on secondary IP [TCP]",
    ),
    "nftables/TestExternalTrafficPolicyLocal": (
        "external to LB IP hits only local endpoint, unmasqueraded [TCP]",
        "pod to NodePort hits both endpoints, unmasqueraded [TCP]",
    ),
    "nftables/TestExternalTrafficPolicyCluster": (
        "external to external IP hits both endpoints, masqueraded [TCP]",
        "pod to LB IP hits both endpoints, masqueraded [TCP]",
    ),
    "nftables/TestInternalTrafficPolicy": (
        "internalTrafficPolicy is local and there are multiple local endpoints::"
        "pod to ClusterIP hits all local endpoints [TCP]",
        "internalTrafficPolicy is local and there are multiple local endpoints::"
        "endpoints deleted::endpoints deleted [TCP]",
    ),
    "nftables/TestTerminatingEndpointsTrafficPolicyLocal": (
        "ready endpoints exist::pod to clusterIP [TCP]",
        "ready endpoints exist::external to LB [TCP]",
        "no usable endpoints on any node::external to LB, no usable endpoints [TCP]",
    ),
    "nftables/TestTerminatingEndpointsTrafficPolicyCluster": (
        "terminating endpoints on remote node::pod to clusterIP [TCP]",
        "terminating endpoints on remote node::external to LB [TCP]",
    ),
    "nftables/TestInternalExternalMasquerade": (
        "base::external to NodePort with eTP:Local [TCP]",
        "base::node to LB with iTP:Local [TCP]",
        "no LocalTrafficDetector::pod to NodePort with eTP:Local [TCP]",
        "masqueradeAll::pod to ClusterIP with iTP:Local [TCP]",
    ),
}
