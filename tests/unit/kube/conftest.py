"""Fixtures for the Kubernetes source tests: the API stand-in and a real client pointed at it."""

from __future__ import annotations

from typing import Iterator

import pytest
from kubernetes import client

from netproxy_lab.apiserver import ApiServer
from tests.unit.kube.kube_helpers import make_client


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        yield server


@pytest.fixture
def api_client(api: ApiServer) -> Iterator[client.ApiClient]:
    c = make_client(api.url)
    yield c
    c.close()
