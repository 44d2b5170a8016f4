"""Another program writing iptables, as Docker or firewalld do, run inside the sandbox's node by
``test_lock.py``: until killed, it adds a rule with ``iptables -w -A``, deletes the one before with
``iptables -w -D``, and every fifth time keeps the rule and adds a chain of its own through
``iptables-restore -w --noflush``.

It logs one line per finished step to ``LOG`` (flushed at once) so that the test can tell, after
each of netproxy's syncs, which foreign rules must be in the kernel:

- ``keep <table> <comment>`` — a rule added and never deleted;
- ``chain <name>`` — a chain (with one rule) added by iptables-restore, never deleted;
- ``lost <table> <comment>`` — ``-D`` found its rule gone: someone's commit dropped it;
- ``ops <n>`` — iptables invocations so far.

usage: foreign_writer.py FLAVOUR LOG
"""

from __future__ import annotations

import subprocess
import sys


def rule(n: int) -> list:  # type: ignore[type-arg]
    return ["-s", f"203.0.{113 + n // 250 % 4}.{n % 250 + 1}/32", "-m", "comment", "--comment", f"foreign-{n}",
            "-j", "RETURN"]


def main() -> int:
    flavour, log_path = sys.argv[1], sys.argv[2]
    ipt, restore = f"iptables-{flavour}", f"iptables-{flavour}-restore"
    ops = 0
    with open(log_path, "a", buffering=1) as log:
        previous = None
        n = 0
        while True:
            table, chain = ("nat", "PREROUTING") if n % 2 == 0 else ("filter", "INPUT")
            subprocess.run([ipt, "-w", "-t", table, "-A", chain, *rule(n)], check=True)
            ops += 1
            if n % 5 == 0:
                log.write(f"keep {table} foreign-{n}\n")
                name = f"FOREIGN-{n}"
                payload = f"*filter\n:{name} - [0:0]\n-A {name} -s 198.18.0.1/32 -j RETURN\nCOMMIT\n"
                subprocess.run([restore, "-w", "--noflush"], input=payload, text=True, check=True)
                ops += 1
                log.write(f"chain {name}\n")
            else:
                if previous is not None:
                    p_table, p_chain, p_n = previous
                    gone = subprocess.run([ipt, "-w", "-t", p_table, "-D", p_chain, *rule(p_n)],
                                          capture_output=True).returncode != 0
                    ops += 1
                    if gone:
                        log.write(f"lost {p_table} foreign-{p_n}\n")
                previous = (table, chain, n)
            log.write(f"ops {ops}\n")
            n += 1


if __name__ == "__main__":
    sys.exit(main())
