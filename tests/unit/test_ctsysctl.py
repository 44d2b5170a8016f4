"""The conntrack sysctls set at start (netproxy/node/ctsysctl.py), against a dict standing for /proc and
/sys: these tests never touch a real sysctl."""

from __future__ import annotations

import errno
from typing import Dict, List, Optional, Tuple

import pytest

from netproxy import cli
from netproxy.cli import settings as cli_config
from netproxy.node.ctsysctl import ConntrackSettings, SysctlError, apply, conntrack_max, plan

PROC, HASH = "/proc-test", "/hashsize-test"


class Kernel:
    def __init__(self, values: Dict[str, int], read_only: Tuple[str, ...] = ()) -> None:
        self.values = dict(values)
        self.read_only = read_only
        self.writes: List[Tuple[str, int]] = []

    def read(self, path: str) -> Optional[int]:
        return self.values.get(path)

    def write(self, path: str, value: int) -> None:
        if path in self.read_only:
            raise PermissionError(errno.EACCES, "Permission denied")
        self.values[path] = value
        self.writes.append((path, value))


def run(settings: ConntrackSettings, kernel: Kernel, cpus: int = 4) -> int:
    return apply(settings, cpus=cpus, proc=PROC, hashsize=HASH, read=kernel.read, write=kernel.write)


@pytest.mark.parametrize("per_core, minimum, cpus, expected", [
    (32768, 131072, 2, 131072),   # scaled below min: min
    (32768, 131072, 8, 262144),   # scaled above min
    (32768, 0, 64, 1048576),      # capped at 1M
    (0, 131072, 8, 0),            # maxPerCore 0: leave it
    (None, 131072, 8, 0),
])
def test_conntrack_max_as_kube_proxy_computes_it(per_core: Optional[int], minimum: int, cpus: int,
                                                 expected: int) -> None:
    assert conntrack_max(ConntrackSettings(max_per_core=per_core, min=minimum), cpus) == expected


def test_only_what_was_asked_for_is_planned() -> None:
    assert plan(ConntrackSettings(), 4) == []
    assert [n for n, _, _ in plan(ConntrackSettings(udp_timeout=30, tcp_be_liberal=True), 4)] == [
        "nf_conntrack_tcp_be_liberal", "nf_conntrack_udp_timeout"]


def test_values_are_written_unless_already_in_place_and_hashsize_follows_max() -> None:
    kernel = Kernel({f"{PROC}/nf_conntrack_max": 65536, HASH: 16384,
                     f"{PROC}/nf_conntrack_tcp_timeout_established": 86400,
                     f"{PROC}/nf_conntrack_udp_timeout": 30})
    written = run(ConntrackSettings(max_per_core=32768, min=131072, tcp_established_timeout=86400,
                                    udp_timeout=60, udp_stream_timeout=120), kernel)
    assert kernel.writes == [(f"{PROC}/nf_conntrack_max", 131072), (HASH, 32768),
                             (f"{PROC}/nf_conntrack_udp_timeout", 60), (f"{PROC}/nf_conntrack_udp_timeout_stream", 120)]
    assert written == 4


def test_a_read_only_max_in_a_network_namespace_stops_the_start_naming_it() -> None:
    kernel = Kernel({f"{PROC}/nf_conntrack_max": 262144, HASH: 65536}, read_only=(f"{PROC}/nf_conntrack_max",))
    with pytest.raises(SysctlError) as err:
        run(ConntrackSettings(max_per_core=32768, min=131072), kernel)
    assert "nf_conntrack_max" in str(err.value) and "conntrack.maxPerCore" in str(err.value)
    assert kernel.writes == []


def test_a_read_only_max_that_already_has_the_value_is_fine() -> None:
    kernel = Kernel({f"{PROC}/nf_conntrack_max": 131072, HASH: 65536}, read_only=(f"{PROC}/nf_conntrack_max",))
    assert run(ConntrackSettings(max_per_core=32768, min=131072), kernel, cpus=2) == 0


def test_negative_values_are_refused_before_anything_is_written() -> None:
    with pytest.raises(ValueError, match="udp-timeout"):
        ConntrackSettings(udp_timeout=-1)


def test_flags_as_kube_proxy_names_them() -> None:
    args = cli.build_parser().parse_args([
        "run", "--source", "x.yaml", "--conntrack-max-per-core", "0", "--conntrack-min", "131072",
        "--conntrack-tcp-timeout-established", "24h", "--conntrack-tcp-timeout-close-wait", "1h",
        "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout", "30s", "--conntrack-udp-timeout-stream", "2m"])
    assert cli_config.conntrack_settings(args) == ConntrackSettings(
        max_per_core=0, min=131072, tcp_established_timeout=86400, tcp_close_wait_timeout=3600, tcp_be_liberal=True,
        udp_timeout=30, udp_stream_timeout=120)
    defaults = cli.build_parser().parse_args(["sync", "--source", "x"])
    assert cli_config.conntrack_settings(defaults) == ConntrackSettings()
