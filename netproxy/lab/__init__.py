"""The test lab: throwaway network namespaces, pods and traffic for the demo, the kernel tests, the
fault suite and the benchmark.  Nothing here is part of the proxy; nothing here touches the
namespace it runs in.

- :mod:`~netproxy.lab.topology` — the client / node / ext / pods namespaces and their wiring;
- :mod:`~netproxy.lab.pods`, :mod:`~netproxy.lab.client` — the programs run inside them (plain
  files, stdlib only); :mod:`~netproxy.lab.traffic` reads what the client saw;
- :mod:`~netproxy.lab.cleanup` — stopping processes by PID and deleting namespaces by name;
  :mod:`~netproxy.lab.netns` — the benchmark's scratch namespaces, removed even on a signal;
- :mod:`~netproxy.lab.combos` — the backend/writer combinations and which of them can run here;
- :mod:`~netproxy.lab.manifests`, :mod:`~netproxy.lab.proxy`, :mod:`~netproxy.lab.checks` — what
  tests write, how they run netproxy, what they wait for and assert;
- :mod:`~netproxy.lab.demo` — ``make demo``; :mod:`~netproxy.lab.kubeproxy_layout` — kube-proxy's own
  rulesets (iptables and nftables modes) for the demo's takeover, migration tests and the bench;
- :mod:`~netproxy.lab.pytest_plugin` — the fixtures, loaded by the root ``conftest.py``.
"""
