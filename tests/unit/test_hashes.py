"""netproxy.core.hashes: hashlib's digests without OpenSSL, and a ``netproxy sync`` kept off it
(``_hashlib`` is 3.6 MiB of a one-shot sync's resident set: docs/performance.md, the seventh pass)."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys

from netproxy.core import hashes


def test_the_digests_are_hashlibs() -> None:
    rng = random.Random(7)
    for n in (0, 1, 63, 64, 65, 1000, 100_000):
        data = rng.randbytes(n)
        assert hashes.sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()
        assert hashes.sha256(data).digest() == hashlib.sha256(data).digest()
        for size in (6, 8, 16, 32, 64):
            assert hashes.blake2b(data, digest_size=size).digest() == hashlib.blake2b(data, digest_size=size).digest()
        h = hashes.blake2b(digest_size=8)
        h.update(data)
        h.update(b"\0")
        assert h.hexdigest() == hashlib.blake2b(data + b"\0", digest_size=8).hexdigest()


def test_a_sync_does_not_load_openssl() -> None:
    """What an nftables or iptables ``netproxy sync`` imports, the leftovers' survey of the other
    dataplane included, and the hashing they do."""
    code = ("import sys\n"
            "from netproxy import cli\n"
            "from netproxy.cli import oneshot\n"
            "from netproxy.source import files, itemmemo\n"
            "from netproxy.migration import migrate\n"
            "import netproxy.backends.nftables, netproxy.backends.iptables\n"
            "from netproxy.backends.nftables import stamp, names\n"
            "from netproxy.backends.iptables import names as ipt_names\n"
            "from netproxy.backends.nftables.kernel import netlink\n"
            "names.identifier('x' * 300); stamp.stamp_key(stamp.ServicePortName('ns', 'svc', 'p'))\n"
            "itemmemo.digest(b'x'); ipt_names.service_chain(stamp.ServicePortName('ns', 'svc', 'p'), 'tcp')\n"
            "print(sorted(m for m in ('_hashlib', '_ssl') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
