"""The README names only flags that exist: every ``--flag`` it writes is an option of some netproxy
command (or of the other tool it is quoted with), and the flags people look for there are named."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Set

from netproxy.cli.args import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OTHER_TOOLS = {"--noflush": "iptables-restore", "--net": "unshare", "--debug": "nft (--debug=netlink)",
               "--strict": "mypy", "--network": "podman run", "--pull": "podman build", "--rm": "podman run",
               "--type": "kubectl patch"}


def netproxy_flags() -> Set[str]:
    parser = build_parser()
    found = {o for a in parser._actions for o in a.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= {o for a in sub._actions for o in a.option_strings}
    return found


def readme_flags() -> Set[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    # A family written as `--conntrack-*` is no flag name: the match must end the word.
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w*.-])", text))


def test_every_flag_the_readme_names_exists() -> None:
    ours = netproxy_flags()
    missing = sorted(f for f in readme_flags() if f not in ours and f not in OTHER_TOOLS)
    assert not missing, f"README names flags no netproxy command has: {missing}"


def test_the_readme_names_the_run_and_sync_flags_people_look_for() -> None:
    named = readme_flags()
    for flag in ("--use-endpoints", "--iptables-flavour", "--iptables-lock-timeout", "--feature-gates",
                 "--init-only", "--version"):
        assert flag in named, flag


def test_plans_exit_codes_are_the_documented_ones(tmp_path: object) -> None:
    """README: plan exits 0 printed, 1 unreadable source, 2 some objects rejected."""
    bad = Path(str(tmp_path)) / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: Bad_Name, namespace: default}\n"
                   "spec: {clusterIP: 10.96.0.9, ports: [{port: 80}]}\n")

    def plan(source: str) -> int:
        return subprocess.run([sys.executable, "-m", "netproxy", "plan", "--backend", "nftables", "--source", source],
                              capture_output=True).returncode

    with open(os.path.join(REPO, "README.md")) as f:
        row = next(line for line in f if line.startswith("| `netproxy plan --source PATH"))
    assert "0 printed; 1 the source is unreadable" in row and "2 some objects rejected" in row
    assert plan(os.path.join(REPO, "examples", "cluster.yaml")) == 0
    assert plan(str(Path(str(tmp_path)) / "missing.yaml")) == 1
    assert plan(str(bad)) == 2


def _readme_row(command: str) -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        return next(line for line in f if line.startswith(f"| `netproxy {command} "))


def _exit(tmp_path: Path, *args: str) -> int:
    return subprocess.run([sys.executable, "-m", "netproxy", *args], capture_output=True, cwd=str(tmp_path)).returncode


def _bad_source(tmp_path: Path) -> str:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: Bad_Name, namespace: default}\n"
                   "spec: {clusterIP: 10.96.0.9, ports: [{port: 80}]}\n")
    return str(bad)


def test_syncs_exit_codes_are_the_documented_ones(tmp_path: Path) -> None:
    """README: sync exits 0 applied, 1 unusable source, 2 some objects rejected (the fake backend: no kernel)."""
    row = _readme_row("sync")
    assert "0 applied; 1 " in row and "the source/backend is unusable; 2 some objects were rejected" in row
    example = os.path.join(REPO, "examples", "cluster.yaml")
    assert _exit(tmp_path, "sync", "--backend", "fake", "--source", example) == 0
    assert _exit(tmp_path, "sync", "--backend", "fake", "--source", str(tmp_path / "missing.yaml")) == 1
    assert _exit(tmp_path, "sync", "--backend", "fake", "--source", _bad_source(tmp_path)) == 2


def test_traces_exit_codes_are_the_documented_ones(tmp_path: Path) -> None:
    """README: trace exits 0 traced, 1 nothing to trace (bad source or --to), 2 traced, some objects rejected."""
    row = _readme_row("trace")
    assert "| 0 traced; 1 the source or `--to` is unusable; 2 some objects rejected (named), the rest traced |" in row
    example = os.path.join(REPO, "examples", "cluster.yaml")
    trace = ("trace", "--backend", "nftables", "--to", "10.96.0.10:53", "--protocol", "udp")
    assert _exit(tmp_path, *trace, "--source", example) == 0
    assert _exit(tmp_path, *trace, "--source", str(tmp_path / "missing.yaml")) == 1
    assert _exit(tmp_path, "trace", "--backend", "nftables", "--to", "10.96.0.10", "--source", example) == 1
    assert _exit(tmp_path, *trace, "--source", _bad_source(tmp_path)) == 2
