"""The benchmark reports only what a run measured: sampling, timeouts, data-plane failures."""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List

import pytest

from bench import dataplane, latency, report, sample, targets


def test_repeat_takes_the_median_with_min_max_and_every_run() -> None:
    got = sample.repeat(lambda k: {"seconds": [0.3, 0.1, 0.2][k], "bytes": k}, 3, budget=100.0)
    assert got["seconds"] == 0.2
    assert (got["min"], got["max"], got["runs"]) == (0.1, 0.3, [0.3, 0.1, 0.2])
    assert got["bytes"] == 2  # the last run's other fields


def test_repeat_stops_when_the_next_run_would_not_fit_the_budget() -> None:
    calls: List[int] = []

    def once(k: int) -> Dict[str, Any]:
        calls.append(k)
        return {"seconds": 3.0}

    got = sample.repeat(once, 3, budget=5.0)
    assert calls == [0] and got["runs"] == [3.0]


def test_repeat_returns_the_first_failure_as_it_is() -> None:
    got = sample.repeat(lambda k: {"seconds": 0.1} if k == 0 else {"timeout": 9}, 3, budget=100.0)
    assert got == {"timeout": 9}


def test_summary_takes_the_median_of_every_seconds_field() -> None:
    got = sample.summary([{"seconds": 1.0, "backend_seconds": 0.5}, {"seconds": 3.0, "backend_seconds": 0.1},
                          {"seconds": 2.0, "backend_seconds": 0.3}])
    assert (got["seconds"], got["backend_seconds"]) == (2.0, 0.3)


def test_latency_counts_a_timeout_as_a_failure_and_as_infinity() -> None:
    got = latency.summary([0.1, 0.2, math.inf, 0.3], change_deadline=31.0)
    assert (got["n"], got["failures"]) == (4, 1)
    assert got["p95"] is None  # the slowest change never landed: p95 is over the deadline
    assert got["median"] == pytest.approx(0.25)
    assert got["runs"] == [0.1, 0.2, 0.3]
    assert "1 FAILED" in latency.describe(got) and "over the deadline" in latency.describe(got)


def test_latency_median_is_over_the_deadline_when_most_changes_timed_out() -> None:
    got = latency.summary([0.1, math.inf, math.inf], change_deadline=31.0)
    assert got["median"] is None and got["failures"] == 2


def test_a_failed_change_misses_the_event_to_kernel_target_whatever_the_p95() -> None:
    cell = {**latency.summary([0.2] * 19 + [math.inf], change_deadline=31.0), "min_sync_period": 1.0,
            "wanted": 20}
    assert cell["p95"] == 0.2  # the percentile alone would pass the 1.05 s limit
    got = targets.event_to_kernel({"latency": {targets.NFT: {"10000": cell}}, "meta": {"sizes": [10000]}})
    assert got["met"] is False


def test_failed_connections_are_a_data_plane_failure() -> None:
    batch = {"ok": 90, "errors": 10, "p50_us": 20.0, "p99_us": 40.0, "rate": 1000.0}
    cell = dataplane.summarise([batch, dict(batch)])
    assert "warning" not in cell
    assert dataplane.failure(cell) == "20 of 200 connections failed"
    assert "FAILED: 20 of 200 connections" in report._dp(cell)


def test_a_clean_data_plane_cell_is_no_failure_and_a_missing_figure_is_one() -> None:
    batch = {"ok": 100, "errors": 0, "p50_us": 20.0, "p99_us": 40.0, "rate": 1000.0}
    assert dataplane.failure(dataplane.summarise([batch])) == ""
    assert dataplane.failure({"error": "not reachable"}) == "not reachable"
    assert "did not finish" in dataplane.failure({"timeout": 21.0})


def test_single_endpoint_services_draw_nothing_and_the_bench_prints_their_object_counts() -> None:
    """One endpoint draws no random number (kube-proxy 1.37): the counts the bench prints, from the
    backends' own plans."""
    from bench import objects

    cell = objects.measure(20)
    nft, ipt = cell["nftables"], cell["iptables"]
    assert (nft["1"]["numgen rules"], nft["1"]["numgen maps"]) == (0, 0)
    assert (nft["2"]["numgen rules"], nft["2"]["numgen maps"]) == (1, 1)  # one shared pick chain for all 20
    # elements: service-ips, the endpoints map, cluster-ips, hairpin pairs (one endpoint each or two)
    # and the service's stamp (service-stamps, one each)
    assert (nft["1"]["elements"], nft["2"]["elements"]) == (100, 140)
    assert (ipt["1"]["statistic rules"], ipt["2"]["statistic rules"]) == (0, 20)
    assert ipt["2"]["rules"] - ipt["1"]["rules"] == 20  # one DNAT rule more per service, the rest alike
    text = "\n".join(objects.markdown(cell))
    assert "### Single-endpoint services" in text
    assert "| 1 endpoint each | " in text and "| 2 endpoints each | " in text
    assert "single-endpoint services, nftables, N = 20 (1 endpoint / 2 endpoints each): rules " in text
    assert "statistic rules 0 / 20" in text


def _floor_results() -> Dict[str, Any]:
    """10k results with nftables only: its `netproxy sync`, restart, RSS and full sync ÷ the raw netlink apply."""
    nft = {"uniform": {"10000": {"cold": {"seconds": 0.6}, "raw-netlink": {"seconds": 0.4}}}}
    return {"meta": {"sizes": [100, 10000], "combos": [{"key": "nftables"}]}, "unavailable": {}, "latency": {},
            "control": {"nftables": nft},
            "rss": {"nftables": {"10000": {"seconds": 1.5, "maxrss_mib": 130.0, "restart": {"timeout": 60}}},
                    "nftables (mixed cluster)": {"10000": {"error": "exited 1", "maxrss_mib": 90.0}}}}


def test_the_floor_group_says_met_missed_or_why_each_line_has_no_figure() -> None:
    from bench import targets_floor

    assert all(fn in targets.CHECKS for fn in targets_floor.CHECKS)  # check() tags them with their module
    by = {fn.__name__: {**fn(_floor_results()), "group": fn.__module__} for fn in targets_floor.CHECKS}
    assert by["sync_process"]["met"] is None  # the legacy half is not in this run
    assert "nftables 1.50 s" in by["sync_process"]["figure"]
    assert "iptables-legacy/restore not in this run" in by["sync_process"]["figure"]
    assert "nftables timeout: 60" in by["restart"]["figure"]
    assert by["source_vs_sync"]["figure"] == targets_floor.API_REPORT
    assert by["peak_rss"]["met"] is False  # 130 MiB = 136 MB misses, whatever the figures it has not
    assert "uniform 136 MB, mixed error: exited 1" in by["peak_rss"]["figure"]  # an error's high-water mark
    assert by["nft_full"]["met"] is True and "1.50× (0.600 s ÷ 0.400 s)" in by["nft_full"]["figure"]
    assert "not run" in by["large"]["figure"] and by["large"]["met"] is None
    text = "\n".join(report.target_lines({"targets": list(by.values())}))
    assert "#### close to the kernel's floor (start-up, restart, memory, full syncs)" in text
    assert "NOT MEASURED (see bench/results/api.md (python -m bench.api))" in text


def test_the_floor_group_reads_the_44k_run_and_an_api_section_when_the_results_hold_them() -> None:
    from bench import api, targets_floor

    r = _floor_results()
    r["meta"]["sizes"].append(44000)
    r["control"]["nftables"]["uniform"]["44000"] = {"cold": {"seconds": 3.5}}
    r["rss"]["nftables"]["44000"] = {"seconds": 9.0, "maxrss_mib": 500.0}
    got = targets_floor.large(r)
    assert got["met"] is False and got["figure"] == "full sync 3.500 s; peak RSS 524 MB"
    r["api"] = {"cells": {"nftables": {"source": {"seconds": 3.3}, "sync": {"seconds": 3.0}}}}
    got = targets_floor.source_vs_sync(r)
    assert got["met"] is True and got["figure"] == "nftables 1.10× (3.30 s ÷ 3.00 s)"
    assert ("nftables: `run --source` ÷ `sync` of the same file", "1.10×", "≤ 1.1", "met") in \
        api.rows("nftables", r["api"]["cells"]["nftables"])


def test_the_bench_times_netproxy_from_bytecode_as_installed(tmp_path: Any) -> None:
    """bench/installed.py compiles each package as pip would (so no timed process compiles), and a
    tree that does not compile stops the bench rather than being timed from its sources."""
    import importlib.util

    from bench import installed

    (tmp_path / "netproxy").mkdir()
    (tmp_path / "netproxy" / "m.py").write_text("X = 1\n")
    installed.precompile(str(tmp_path))
    assert os.path.exists(importlib.util.cache_from_source(str(tmp_path / "netproxy" / "m.py")))
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "bad.py").write_text("def (:\n")
    with pytest.raises(SystemExit, match="compiling"):
        installed.precompile(str(tmp_path))


def test_versions_alternate_the_revisions_on_an_emptied_node(monkeypatch: Any) -> None:
    """bench.versions compares code by turns: every run of a backend takes each revision in turn, and
    each turn (and the end) starts from an emptied node, so no revision inherits the other's rules."""
    from bench import versions

    emptied: List[str] = []
    monkeypatch.setattr(versions, "empty_node", lambda ns: emptied.append(ns))
    turns = list(versions._turns("ns", ["a", "b"], 2, ["nft", "legacy"]))
    assert turns == [("nft", "a"), ("nft", "b")] * 2 + [("legacy", "a"), ("legacy", "b")] * 2
    assert emptied == ["ns"] * (len(turns) + 1)
    assert versions._seconds(0.0025) == "2.50 ms" and versions._seconds(1.5) == "1.500 s"


def test_the_iptables_nft_resync_line_reads_its_resync_step() -> None:
    from bench import targets_floor

    r = _floor_results()
    r["meta"]["combos"].append({"key": "iptables-nft/restore"})
    r["control"]["iptables-nft/restore"] = {"uniform": {"10000": {"resync": {"seconds": 0.235}}}}
    got = targets_floor.nft_flavour_resync(r)
    assert got["met"] is False and got["figure"] == "235.0 ms" and got["target"] == "≤ 50 ms"
    r["control"]["iptables-nft/restore"]["uniform"]["10000"]["resync"]["seconds"] = 0.03
    assert targets_floor.nft_flavour_resync(r)["met"] is True


def test_the_source_change_line_reads_the_mixed_one_file_latency_and_says_why_without_it() -> None:
    from bench import targets_floor

    r = _floor_results()
    assert "not in this run" in targets_floor.source_change(r)["figure"]
    r["meta"]["combos"].append({"key": "iptables-legacy/restore"})
    missing = targets_floor.source_change(r)
    assert missing["met"] is None and "not measured" in missing["figure"]
    cell = {"n": 8, "failures": 0, "change_deadline": 31.0, "median": 3.1, "p95": 3.6, "max": 3.6, "runs": [3.1]}
    r["latency"]["iptables-legacy/restore (mixed cluster)"] = {"10000": cell}
    got = targets_floor.source_change(r)
    assert got["met"] is False and got["figure"].startswith("median 3100 ms, p95 3600 ms, n 8")
    cell["median"] = 1.4
    assert targets_floor.source_change(r)["met"] is True
    cell["median"] = None  # the median change never reached the kernel
    assert targets_floor.source_change(r)["met"] is False


def _scale_results() -> Dict[str, Any]:
    """A --scale 100000 run: nftables met on time, missed on memory; legacy's raw restore absent."""
    nft = {"uniform": {"100000": {"cold": {"seconds": 6.0}, "raw-netlink": {"seconds": 5.0},
                                  "endpoint": {"seconds": 0.004, "backend_seconds": 0.001}}}}
    legacy = {"uniform": {"100000": {"cold": {"seconds": 30.0}, "raw": {"error": "exited 1"}}}}
    return {"meta": {"sizes": [100000], "combos": [{"key": "nftables"}, {"key": "iptables-legacy/restore"}]},
            "unavailable": {}, "control": {"nftables": nft, "iptables-legacy/restore": legacy},
            "rss": {"nftables": {"100000": {"seconds": 7.5, "maxrss_mib": 700.0,
                                            "restart": {"seconds": 6.2, "maxrss_mib": 650.0}}},
                    "iptables-legacy/restore": {"100000": {"seconds": 40.0, "maxrss_mib": 500.0}}}}


def test_the_scale_targets_say_met_missed_or_why_at_100k() -> None:
    from bench import targets_scale

    by = {t["name"].split(",")[0]: t for t in targets_scale.check(_scale_results())}
    sync = by["nftables `netproxy sync` as a new process"]
    assert sync["met"] is False  # 700 MiB = 734 MB > 600 MB, though 7.5 s ≤ 8 s
    assert sync["figure"].startswith("7.50 s / 734 MB; the full sync alone, in process, 6.00 s")
    restart = by["nftables restart: a new `sync` with one endpoint changed on the programmed node"]
    assert restart["met"] is False and restart["figure"] == "6.20 s, peak RSS 682 MB"
    endpoint = by["nftables one endpoint changed in the running process"]
    assert endpoint["met"] is True and endpoint["figure"] == "4.00 ms (the write 1.00 ms)"
    legacy = by["iptables-legacy `netproxy sync` as a new process"]
    assert legacy["met"] is None and "the raw restore not measured (error: exited 1)" in legacy["figure"]
    r = _scale_results()
    r["control"]["iptables-legacy/restore"]["uniform"]["100000"]["raw"] = {"seconds": 25.0}
    legacy = next(t for t in targets_scale.check(r) if t["name"].startswith("iptables-legacy"))
    assert legacy["met"] is True and "40.00 s = 1.60× the raw restore (25.00 s) / 524 MB" in legacy["figure"]
    assert all(t["group"] == "bench.targets_scale" for t in targets_scale.check(r))


def test_the_44k_scale_run_judges_the_new_process_by_its_own_row_and_prints_the_rest_as_references() -> None:
    from bench import report, targets_scale

    r = _scale_results()
    r["meta"] = {"sizes": [44000], "combos": [{"key": "nftables"}]}  # make bench-100k's 44k run: nftables alone
    r["control"] = {"nftables": {"uniform": {"44000": {"cold": {"seconds": 2.5},
                                                       "endpoint": {"seconds": 0.002, "backend_seconds": 0.001}}}}}
    r["rss"] = {"nftables": {"44000": {"seconds": 2.9, "maxrss_mib": 290.0,
                                       "restart": {"seconds": 2.0, "maxrss_mib": 250.0}}}}
    got = targets_scale.check(r)
    assert [t["name"].split(",")[0] for t in got] == [
        "nftables `netproxy sync` as a new process", "nftables restart: a new `sync` with one endpoint changed "
        "on the programmed node", "nftables one endpoint changed in the running process"]  # no legacy line
    sync = got[0]
    assert sync["target"] == "≤ 3 s / ≤ 300 MB" and sync["met"] is False  # 290 MiB = 304 MB > 300 MB
    r["rss"]["nftables"]["44000"]["maxrss_mib"] = 280.0
    assert targets_scale.check(r)[0]["met"] is True
    r["rss"]["nftables"]["44000"]["seconds"] = 3.1
    assert targets_scale.check(r)[0]["met"] is False  # the 8 s of 100k is not the 44k row's
    assert all(t.get("reference") and t["met"] is None and t["target"] == "" for t in got[1:])
    text = "\n".join(report.target_lines({"targets": got}))
    assert "- reference: nftables restart: a new `sync` with one endpoint changed on the programmed node, " \
        "44,000 × 10: 2.00 s, peak RSS 262 MB" in text
    r["meta"]["sizes"] = [30000]  # an N issue 40 set no target at: every line a reference
    assert all(t.get("reference") for t in targets_scale.check(r))


def test_the_api_rows_take_the_100k_targets_at_100k_and_say_why_the_real_server_is_absent() -> None:
    from bench import api

    cell = {"start": {"seconds": 11.0, "maxrss_mib": 650.0}, "real": {"skipped": "--no-real"}}
    at_10k = {r[0]: r for r in api.rows("nftables", cell)}
    at_100k = {r[0]: r for r in api.rows("nftables", cell, 100000)}
    start = "nftables: start → last service answering (s)"
    assert at_10k[start][2:] == ("≤ 3", "MISSED") and at_100k[start][2:] == ("≤ 12", "met")
    rss = "nftables: `run` peak RSS (MB)"
    assert at_10k[rss][1:] == ("682", "≤ 150", "MISSED") and at_100k[rss][1:] == ("682", "≤ 700", "met")
    real = at_100k["nftables: the same start against a real kube-apiserver (s)"]
    assert real[1:] == ("skipped: --no-real", "", "")
