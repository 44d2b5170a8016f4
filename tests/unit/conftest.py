"""Unit tests never reach the kernel: the iptables backend's ipsets are an in-memory fake here
(a backend built with a fake writer would otherwise create sets in the host's namespace), and it
opens no watch on the host's tables (tests that need one set ``backend._watch`` to a fake)."""

from __future__ import annotations

from typing import Iterator

import pytest

import netproxy.backends.iptables as iptables_backend
from netproxy.backends.iptables.ipset import FakeIpsets


@pytest.fixture(autouse=True)
def _fake_ipsets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(iptables_backend, "KernelIpsets", FakeIpsets)
    monkeypatch.setattr(iptables_backend.IptablesBackend, "_open_watch", lambda self: None)
    yield
