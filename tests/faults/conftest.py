"""Fault suite: netproxy under crashes, flushes, lock fights, hostile input, storms and API
outages. Kernel faults run inside the lab (``netproxy_lab``: the same fixtures and backend/writer
parametrisation as ``tests/kernel``, loaded as a plugin by the root ``conftest.py``); each test
prints the figure its fault is judged by (tests/faults/README.md) with ``figure()`` (the root
conftest.py registers tests/faults/figures.py, which prints them)."""
