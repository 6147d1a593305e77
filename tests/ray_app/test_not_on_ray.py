"""Server settings a Ray replica cannot honour are refused with a message that says why: in
the app's overrides before anything is deployed (no Ray cluster needed), and from a config
file as a replica starts (the same check)."""

from __future__ import annotations

import pytest

from mha_serve.ray_app import build
from mha_serve.ray_app.replica import NOT_ON_RAY, check_not_on_ray


@pytest.mark.parametrize("value", ["auto", "1", 0])
def test_the_app_refuses_a_pinned_event_loop_in_its_overrides(value):
    with pytest.raises(ValueError, match="overrides.event_loop_cpu .* does not apply on Ray"):
        build({"overrides": {"event_loop_cpu": value}})


@pytest.mark.parametrize("value", [300, "1"])
def test_the_app_refuses_busy_polling_in_its_overrides(value):
    with pytest.raises(ValueError, match="overrides.busy_poll_us .* does not apply on Ray"):
        build({"overrides": {"busy_poll_us": value}})


# Found by a walk through docs/ray.md: frontend_workers = 4 in the app's overrides (or its
# config file) was taken and did nothing: a replica runs no gRPC server of its own.
@pytest.mark.parametrize("value", [4, "2"])
def test_the_app_refuses_frontend_workers_in_its_overrides(value):
    with pytest.raises(ValueError, match="overrides.frontend_workers .* does not apply on Ray"):
        build({"overrides": {"frontend_workers": value}})
    check_not_on_ray({"frontend_workers": 1}, "")


def test_off_is_the_default_and_passes():
    check_not_on_ray({"event_loop_cpu": "none", "torch_threads": 1}, "overrides.")
    check_not_on_ray({"event_loop_cpu": " None ", "busy_poll_us": 0}, "")
    check_not_on_ray({"busy_poll_us": "0"}, "")
    check_not_on_ray({}, "")
    check_not_on_ray({"auth_token_file": "", "tls_cert_file": " "}, "", environ={})
    assert set(NOT_ON_RAY) == {
        "event_loop_cpu",
        "busy_poll_us",
        "frontend_workers",
        "auth_token_file",
        "tls_cert_file",
        "tls_key_file",
        "tls_client_ca_file",
    }


def test_a_config_files_value_is_refused_as_the_replica_reads_it():
    with pytest.raises(ValueError, match=r"^event_loop_cpu = 'auto' does not apply on Ray"):
        check_not_on_ray({"event_loop_cpu": "auto"}, "")


# Found by a walk through docs/ray.md: a config file with auth_token_file (as the standalone
# server's) deployed on Ray answered calls without a token (no replica checks tokens, and
# Ray's proxy has no TLS option): refused, not silently dropped.
@pytest.mark.parametrize(
    "key", ["auth_token_file", "tls_cert_file", "tls_key_file", "tls_client_ca_file"]
)
def test_the_app_refuses_security_it_cannot_enforce(key):
    with pytest.raises(ValueError, match=rf"overrides.{key} = '/etc/x' does not apply on Ray"):
        build({"overrides": {key: "/etc/x"}})
    with pytest.raises(ValueError, match=rf"^{key} = '/etc/x' does not apply on Ray"):
        check_not_on_ray({key: "/etc/x"}, "")


def test_a_bearer_token_in_the_replicas_environment_is_refused_without_its_value():
    with pytest.raises(ValueError, match="MHA_SERVE_AUTH_TOKEN is set") as e:
        check_not_on_ray({}, "", environ={"MHA_SERVE_AUTH_TOKEN": "s3cret"})
    assert "s3cret" not in str(e.value)
    check_not_on_ray({}, "", environ={"MHA_SERVE_AUTH_TOKEN": " "})
