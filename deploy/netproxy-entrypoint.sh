#!/bin/sh
# Container entrypoint: make `iptables` in this container the same flavour (legacy or nft) as the
# host's, then exec netproxy with the arguments given.
#
# The image ships both iptables-legacy and iptables-nft. A container's default alternative says
# nothing about the host, and writing the other flavour leaves two rulesets in the kernel that both
# apply (what iptables on the host shows is then not what runs). netproxy's version check reads
# `iptables --version`, so putting the host's flavour first in PATH makes every later decision
# (backend, writer, cleanup) follow the host.
#
# How the host's flavour is found (kubernetes-sigs/iptables-wrappers' method, read-only):
#   1. kubelet marks the flavour it uses with a KUBE-IPTABLES-HINT (or KUBE-KUBELET-CANARY) chain in
#      the mangle table: look for it with nft first (reading legacy tables can load the legacy
#      kernel modules on an nft host), then legacy;
#   2. otherwise the flavour holding more rules wins, nft on a tie (the default on current distros).
# NETPROXY_IPTABLES_FLAVOUR=legacy|nft skips the detection.
set -eu

bindir="${NETPROXY_IPTABLES_BIN:-/run/netproxy/iptables-bin}"
flavour="${NETPROXY_IPTABLES_FLAVOUR:-auto}"
hint='^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY) '

have() { command -v "$1" >/dev/null 2>&1; }

has_hint() {  # $1 = legacy|nft
    for tool in "iptables-$1-save" "ip6tables-$1-save"; do
        if have "$tool" && { "$tool" -t mangle 2>/dev/null || true; } | grep -Eq "$hint"; then
            return 0
        fi
    done
    return 1
}

rule_count() {  # $1 = legacy|nft
    n=0
    for tool in "iptables-$1-save" "ip6tables-$1-save"; do
        if have "$tool"; then
            c=$({ timeout 10 "$tool" 2>/dev/null || true; } | grep -c '^-' || true)
            n=$((n + c))
        fi
    done
    echo "$n"
}

if [ "$flavour" = auto ]; then
    if ! have iptables-legacy && ! have iptables-nft; then
        flavour=none
    elif has_hint nft; then
        flavour=nft
    elif has_hint legacy; then
        flavour=legacy
    else
        legacy=$(rule_count legacy)
        nft=$(rule_count nft)
        if [ "$legacy" -gt "$nft" ]; then flavour=legacy; else flavour=nft; fi
    fi
fi

case "$flavour" in
    legacy|nft)
        mkdir -p "$bindir"
        for tool in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
            base=${tool%%-*}
            rest=${tool#"$base"}
            target=$(command -v "$base-$flavour$rest" || true)
            if [ -n "$target" ]; then
                ln -sf "$target" "$bindir/$tool"
            fi
        done
        PATH="$bindir:$PATH"
        export PATH
        echo "netproxy-entrypoint: host iptables flavour: $flavour" >&2
        ;;
    none)
        echo "netproxy-entrypoint: no iptables in the image; leaving PATH as it is" >&2
        ;;
    *)
        echo "netproxy-entrypoint: NETPROXY_IPTABLES_FLAVOUR must be auto, legacy or nft, not '$flavour'" >&2
        exit 1
        ;;
esac

exec netproxy "$@"
