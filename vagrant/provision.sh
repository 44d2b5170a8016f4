#!/bin/sh
# Provision a Vagrant box as one node kind of vagrant/nodes.json: its Debian packages, its
# iptables alternative, its kernel arguments, and a venv with netproxy and its dependencies.
# Usage (as root, from the Vagrantfile): provision.sh NODE [SRC]   SRC = the checkout (/netproxy).
# Vagrant boxes have internet: the dependencies come from Debian and PyPI here, whereas the
# local QEMU runner (vagrant/local/) builds the same node offline from a wheelhouse.
set -eu
node=${1:?usage: provision.sh NODE [SRC]}
src=${2:-/netproxy}
venv=/opt/netproxy-venv
export DEBIAN_FRONTEND=noninteractive

apt-get update -qq
apt-get install -y -qq --no-install-recommends python3 >/dev/null

# Read this node kind's fields from the one list (python3 is on every Debian box).
field() {
    python3 - "$src/vagrant/nodes.json" "$node" "$1" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
node = next((n for n in data["nodes"] if n["name"] == sys.argv[2]), None)
if node is None:
    sys.exit(f"provision: no node kind {sys.argv[2]!r} in nodes.json")
key = sys.argv[3]
value = data["common_packages"] + node["packages"] if key == "all_packages" else node.get(key, "")
print(" ".join(value) if isinstance(value, list) else value)
PY
}
packages=$(field all_packages)
remove=$(field remove_packages)
flavour=$(field iptables)
kargs=$(field kernel_args)

echo "provision: node $node: packages $packages"
# python-iptables is published as an sdist only: building it needs a compiler here.
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $packages build-essential python3-dev >/dev/null
if [ -n "$remove" ]; then
    echo "provision: removing $remove"
    # shellcheck disable=SC2086
    apt-get purge -y -qq $remove >/dev/null || true
fi

update-alternatives --set iptables "/usr/sbin/iptables-$flavour"
update-alternatives --set ip6tables "/usr/sbin/ip6tables-$flavour"

if [ -n "$kargs" ]; then
    # Kernel arguments through a grub drop-in; the Vagrantfile reboots after this script.
    mkdir -p /etc/default/grub.d
    printf 'GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT %s"\n' "$kargs" \
        >/etc/default/grub.d/90-netproxy.cfg
    update-grub
fi

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
# Install from a copy: an in-tree build would write build/ into the synced checkout.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -C "$src" --exclude=.git --exclude=.venv -cf - . | tar -C "$tmp" -xf -
"$venv/bin/pip" install -q "$tmp" "pytest>=7"
echo "provision: node $node ready ($("$venv/bin/python" -V), $(iptables --version))"
