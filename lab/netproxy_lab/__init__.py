"""The test lab: throwaway network namespaces, pods and traffic for the demo, the kernel tests, the
fault suite and the benchmark.  Nothing here is part of the proxy; nothing here touches the
namespace it runs in.

- :mod:`~netproxy_lab.topology` — the client / node / ext / pods namespaces and their wiring;
- :mod:`~netproxy_lab.pods`, :mod:`~netproxy_lab.client` — the programs run inside them (plain
  files, stdlib only); :mod:`~netproxy_lab.traffic` reads what the client saw;
- :mod:`~netproxy_lab.cleanup` — stopping processes by PID and deleting namespaces by name;
  :mod:`~netproxy_lab.netns` — the benchmark's scratch namespaces, removed even on a signal;
- :mod:`~netproxy_lab.combos` — the backend/writer combinations and which of them can run here;
- :mod:`~netproxy_lab.manifests`, :mod:`~netproxy_lab.proxy`, :mod:`~netproxy_lab.checks` — what
  tests write, how they run netproxy, what they wait for and assert;
- :mod:`~netproxy_lab.demo` — ``make demo``; :mod:`~netproxy_lab.kubeproxy_layout` — kube-proxy's own
  rulesets (iptables and nftables modes) for the demo's takeover, migration tests and the bench;
- :mod:`~netproxy_lab.pytest_plugin` — the fixtures, loaded by the root ``conftest.py``.
"""
