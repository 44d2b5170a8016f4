"""Moving a node between dataplanes: what service-proxy rules the node holds now (netproxy's or
kube-proxy's, iptables or nftables) and ``netproxy migrate``'s order of writing and removing."""
