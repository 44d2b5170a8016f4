"""The start-up version check, fed real `iptables --version` output (no binaries needed).

Test names and ids avoid the words "iptables", "nftables" and "kube" so that the team's quick run
(`-k 'not iptables and not nftables and not kube'`, which skips the backends in progress) keeps them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

import pytest
from packaging.version import Version

from netproxy.node import detect
from netproxy.node.detect import Decision, DetectError, iptables_flavour, parse_iptables_version, run_iptables_version


def decide(line: Optional[str], libnft: bool = True) -> Decision:
    return detect.detect(version_probe=lambda: line, libnft_probe=lambda: libnft)


def short(value: object) -> str:
    """A test id without the filtered words: "iptables v1.8.9 (nf_tables)" → "v1.8.9 (nf_tables)"."""
    return str(value).replace("iptables", "").replace("nftables", "nft").strip() or "empty"


@pytest.mark.parametrize("line, version, mode", [
    ("iptables v1.4.21", "1.4.21", None),
    ("iptables v1.6.1", "1.6.1", None),
    ("iptables v1.8.9 (legacy)", "1.8.9", "legacy"),
    ("iptables v1.8.9 (nf_tables)", "1.8.9", "nf_tables"),
    ("iptables v1.8.10 (nf_tables)\n", "1.8.10", "nf_tables"),
    ("iptables v1.3.8", "1.3.8", None),
], ids=short)
def test_parse_real_version_lines(line: str, version: str, mode: Optional[str]) -> None:
    assert parse_iptables_version(line) == (Version(version), mode)


@pytest.mark.parametrize("line", ["", "garbage", "iptables", "iptables vX.Y", "iptables 1.8.9",
                                  "ip6tables v1.8.9 (legacy)", "iptables v1.8.9 (nf_tables) extra",
                                  "iptables v1.8.9 (NF_TABLES)", "iptables: command not found"], ids=short)
def test_parse_rejects_garbage(line: str) -> None:
    with pytest.raises(ValueError):
        parse_iptables_version(line)


@pytest.mark.parametrize("line", ["iptables v1.4.21", "iptables v1.6.1", "iptables v1.8.9 (legacy)",
                                  "iptables v1.4.0"], ids=short)
@pytest.mark.parametrize("libnft", [True, False], ids=["lib", "nolib"])
def test_legacy_at_or_above_1_4_0_picks_the_legacy_backend(line: str, libnft: bool) -> None:
    d = decide(line, libnft)
    assert (d.backend, d.flavour) == ("iptables", "legacy")
    assert line.split()[1][1:] in d.reason
    assert any(line in e for e in d.evidence)


def test_nf_tables_mode_picks_the_nft_backend() -> None:
    d = decide("iptables v1.8.9 (nf_tables)", libnft=True)
    assert (d.backend, d.flavour) == ("nftables", None)
    assert "nf_tables" in d.reason
    assert "libnftables: found" in d.evidence


def test_nf_tables_mode_without_the_library_falls_back_to_xt_over_nft() -> None:
    d = decide("iptables v1.8.9 (nf_tables)", libnft=False)
    assert (d.backend, d.flavour) == ("iptables", "nft")
    assert "libnftables" in d.reason


@pytest.mark.parametrize("libnft", [True, False], ids=["lib", "nolib"])
def test_too_old_is_a_clear_error(libnft: bool) -> None:
    with pytest.raises(DetectError, match=r"1\.3\.8.*older than.*1\.4\.0"):
        decide("iptables v1.3.8", libnft)


@pytest.mark.parametrize("libnft", [True, False], ids=["lib", "nolib"])
@pytest.mark.parametrize("line", ["garbage", "", "iptables vX"], ids=short)
def test_unparsable_version_is_a_clear_error(line: str, libnft: bool) -> None:
    with pytest.raises(DetectError, match="unrecognised"):
        decide(line, libnft)


def test_missing_binary_with_the_library_picks_the_nft_backend() -> None:
    d = decide(None, libnft=True)
    assert (d.backend, d.flavour) == ("nftables", None)
    assert d.evidence == ("iptables: not found", "libnftables: found")


def test_missing_binary_without_the_library_is_a_clear_error() -> None:
    with pytest.raises(DetectError, match="no iptables binary and no libnftables"):
        decide(None, libnft=False)


@pytest.mark.parametrize("line, flavour", [
    ("iptables v1.8.9 (nf_tables)", "nft"), ("iptables v1.8.9 (legacy)", "legacy"), ("iptables v1.4.21", "legacy"),
    ("garbage", "legacy"), (None, "legacy"),
], ids=short)
def test_flavour_of_the_node_binary(line: Optional[str], flavour: str) -> None:
    assert iptables_flavour(lambda: line) == flavour


# -- the real probes, pointed at stand-in binaries on PATH ---------------------------------------------

def _fake_binary(directory: Path, name: str, script: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_version_probe_reads_the_first_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_binary(tmp_path, "iptables", 'echo "iptables v1.8.9 (nf_tables)"; echo "second line"')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert run_iptables_version() == "iptables v1.8.9 (nf_tables)"


def test_version_probe_falls_back_to_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_binary(tmp_path, "iptables", 'echo "iptables v1.4.21" >&2; exit 2')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert run_iptables_version() == "iptables v1.4.21"


def test_version_probe_silent_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_binary(tmp_path, "iptables", "exit 1")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert run_iptables_version() == ""
    with pytest.raises(DetectError):
        detect.detect(version_probe=run_iptables_version, libnft_probe=lambda: True)


def test_version_probe_missing_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert run_iptables_version() is None
    assert run_iptables_version(os.path.join(str(tmp_path), "nope")) is None


def test_library_probe_asks_the_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []

    def find_library(name: str) -> Optional[str]:
        asked.append(name)
        return "libnftables.so.1" if name == "nftables" else None

    monkeypatch.setattr(detect.ctypes.util, "find_library", find_library)
    assert detect.libnftables_present()
    assert asked == ["nftables"]
    monkeypatch.setattr(detect.ctypes.util, "find_library", lambda name: None)
    assert not detect.libnftables_present()


def test_start_up_line_names_the_versions_of_the_tools_the_backend_drives() -> None:
    seen = {"iptables-nft": "iptables v1.8.9 (nf_tables)", "nft": "nftables v1.0.6 (Lester Gooch #5)"}
    line = detect.tool_versions("iptables", "nft", probe=seen.get)
    assert line.startswith("kernel ") and "iptables-nft: iptables v1.8.9 (nf_tables)" in line
    assert "ip6tables-nft: not found" in line  # a missing tool is named, not skipped
    assert "nft: nftables v1.0.6" in detect.tool_versions("nftables", "legacy", probe=seen.get)


# -- where the nftables backend keeps IPv6 ClientIP affinity: the node's nft decides --------------------

@pytest.mark.parametrize("line, layout", [
    ("nftables v1.0.6 (Lester Gooch #5)", "sets"),      # Debian 12
    ("nftables v0.9.8 (E.D.S.)", "sets"),               # Debian 11
    ("nftables v1.1.0 (Commodore Bullmoose)", "maps"),
    ("nftables v1.1.3 (Commodore Bullmoose #4)", "maps"),  # Debian 13
    ("nftables v1.10.1\n", "maps"),
    (None, "sets"), ("", "sets"), ("garbage", "sets"), ("nftables vX.Y", "sets"),
], ids=short)
def test_ipv6_affinity_layout_follows_the_node_nft(line: Optional[str], layout: str) -> None:
    found = detect.ipv6_affinity_layout(probe=lambda: line)
    assert found.layout == layout
    if line and line.startswith("nftables v1"):
        assert line.split()[1][1:].strip() in found.reason  # the version that decided it is named


def test_nft_version_probe_reads_the_node_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_binary(tmp_path, "nft", 'echo "nftables v1.1.3 (Commodore Bullmoose #4)"')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect.run_nft_version() == "nftables v1.1.3 (Commodore Bullmoose #4)"
    assert detect.ipv6_affinity_layout().layout == "maps"
    (tmp_path / "nft").unlink()
    assert detect.run_nft_version() is None and detect.ipv6_affinity_layout().layout == "sets"
