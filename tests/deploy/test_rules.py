"""deploy/prometheus: the alert rules pass promtool, and their unit tests cover every alert."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.sources import RULES, RULES_TEST

SEVERITIES = {"critical", "warning"}


def promtool() -> str:
    local = Path(sys.executable).with_name("promtool")  # .ci/get-promtool puts it there
    found = str(local) if local.exists() else shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not found: `make test` fetches it (.ci/get-promtool)")
    return found


def alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120, cwd=RULES.parent
    )


def test_promtool_check_rules():
    result = run_promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_test_rules():
    result = run_promtool("test", "rules", RULES_TEST.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules_fails_on_a_wrong_expectation(tmp_path):
    """The unit tests can fail: an alert expected on the quiet replica is reported."""
    tests = yaml.safe_load(RULES_TEST.read_text())
    tests["rule_files"] = [str(RULES)]
    fired = tests["tests"][0]["alert_rule_test"][-1]["exp_alerts"][0]["exp_labels"]
    fired["instance"] = "10.0.0.2:9095"
    broken = tmp_path / "broken.test.yml"
    broken.write_text(yaml.safe_dump(tests))
    result = run_promtool("test", "rules", str(broken))
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


def test_every_alert_tells_the_operator_what_to_do():
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names)), names
    for rule in alerts():
        name = rule["alert"]
        assert name.startswith("MhaServe"), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"]["summary"].strip(), name
        assert len(rule["annotations"]["description"]) > 100, f"{name}: say what to do"


def test_the_alerts_the_issue_asks_for():
    exprs = {rule["alert"]: rule["expr"] for rule in alerts()}
    wanted = {
        "MhaServeHighLatencyP99": "mha_serve_request_latency_seconds_bucket",
        "MhaServeHighErrorRatio": "mha_serve_requests_total",
        "MhaServeRejectingRequests": 'code="RESOURCE_EXHAUSTED"',
        "MhaServeKVCacheNearlyFull": "mha_serve_kv_cache_blocks",
        "MhaServeSessionsEvicted": 'reason="evicted"',
        "MhaServeTargetDown": "up{",
        "MhaServeAbsent": "absent(up{",
        "MhaServeNotReady": "mha_serve_ready",
        "MhaServeRestarting": "process_start_time_seconds",
        "MhaServeSessionsLost": "increase(mha_serve_sessions_lost_total[",
    }
    assert set(exprs) == set(wanted)
    for name, needle in wanted.items():
        assert needle in exprs[name], name


def test_every_alert_is_tested_firing_and_quiet():
    cases: dict[str, dict[str, int]] = {}
    for test in yaml.safe_load(RULES_TEST.read_text())["tests"]:
        for case in test["alert_rule_test"]:
            counts = cases.setdefault(case["alertname"], {"firing": 0, "quiet": 0})
            counts["firing" if case.get("exp_alerts") else "quiet"] += 1
            for expected in case.get("exp_alerts") or []:
                assert {"summary", "description"} <= set(expected["exp_annotations"])
    for rule in alerts():
        counts = cases.get(rule["alert"], {})
        assert counts.get("firing") and counts.get("quiet"), f"{rule['alert']}: {counts}"
