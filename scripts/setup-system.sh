#!/bin/sh
# Install the Debian packages netproxy needs, only when missing, so that `make` targets are
# idempotent and cheap on a machine that already has them.  Extra package names may be passed
# as arguments (the VM runner adds qemu, debootstrap and cpio).
set -eu
PKGS="iptables nftables libnftables1 conntrack iproute2 tmux $*"  # tmux: netproxy top's live-view test
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ]; then
    echo "setup: missing Debian packages:$missing (run as root, or install them)" >&2
    exit 1
fi
echo "setup: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing >/dev/null
