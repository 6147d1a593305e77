"""`mha-serve` with TLS, mutual TLS and a token set by environment, flag and TOML, and
`mha-client` with the matching flags; /metrics bound to another address than the API."""

from __future__ import annotations

import socket
import urllib.request

import grpc
import pytest

from mha_client import cli
from mha_client.channel import ChannelSecurity
from mha_client.sdk import Client
from mha_serve.config import build_config
from tests.helpers import ServerProcess
from tests.security.certs import Authority

TOKEN = "cli-token-abcdef"
METRICS_HOST = "127.0.0.2"  # loopback too, but not the API's address


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "frontend-workers-2"])
def served(tmp_path_factory, request):
    """The same security in one process and with 2 frontend workers (each frontend loads
    the certificates and checks the token; the engine process serves /metrics)."""
    directory = tmp_path_factory.mktemp("serve-command")
    ca = Authority(directory)
    server, alice = ca.issue("mha-serve", server=True), ca.issue("alice", server=False)
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")
    config = directory / "mha.toml"
    config.write_text(f'[server]\nauth_token_file = "{token_file}"\n')
    proc = ServerProcess(
        "--config",
        str(config),
        "--tls-client-ca-file",
        ca.ca_file,
        "--metrics-host",
        METRICS_HOST,
        "--frontend-workers",
        request.param,
        env={"MHA_SERVE_TLS_CERT_FILE": server.cert, "MHA_SERVE_TLS_KEY_FILE": server.key},
        log_path=directory / "mha-serve.log",
    )
    security = ChannelSecurity(
        ca_file=ca.ca_file, cert_file=alice.cert, key_file=alice.key, token=TOKEN
    )
    try:
        with Client(proc.target, security=security) as client:
            client.wait_ready(120)
        yield proc, ca, alice, token_file
    finally:
        code = proc.stop()
        assert code == 0, proc.log()
    assert TOKEN not in proc.log()


def test_cli_with_matching_options(served, capsys):
    proc, ca, alice, token_file = served
    tls = ["--target", proc.target, "--ca-file", ca.ca_file]
    mtls = [*tls, "--cert-file", alice.cert, "--key-file", alice.key]
    assert cli.main([*mtls, "--token-file", str(token_file), "models"]) == 0
    assert "mha" in capsys.readouterr().out
    assert cli.main([*mtls, "models"]) == cli.EXIT_FAILED  # no token
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli.main([*tls, "--token-file", str(token_file), "models"]) == cli.EXIT_FAILED
    assert "cannot be reached" in capsys.readouterr().err  # no client certificate
    assert cli.main([*mtls, "--token-file", str(token_file), "health"]) == 0


def test_cli_token_from_environment(served, capsys, monkeypatch):
    proc, ca, alice, _ = served
    monkeypatch.setenv(cli.ENV_TOKEN, TOKEN)
    args = ["--target", proc.target, "--ca-file", ca.ca_file]
    args += ["--cert-file", alice.cert, "--key-file", alice.key, "models"]
    assert cli.main(args) == 0


def test_metrics_listen_on_their_own_address(served):
    proc, *_ = served
    body = urllib.request.urlopen(f"http://{METRICS_HOST}:{proc.metrics_port}/metrics", timeout=10)
    assert b"mha_serve_ready 1.0" in body.read()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", proc.metrics_port), 2):
        pass
    # ...and the API not on the metrics address
    with pytest.raises(OSError), socket.create_connection((METRICS_HOST, proc.port), 2):
        pass


def test_plaintext_client_is_refused_by_the_tls_port(served):
    proc, *_ = served
    with Client(proc.target, timeout=5) as client, pytest.raises(Exception) as refused:
        client.list_models()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tls_cert_file": "/x.crt"}, "go together"),
        ({"tls_client_ca_file": "/ca.crt"}, "needs the server's own"),
        ({"tls_cert_file": "/nope.crt", "tls_key_file": "/nope.key"}, "not a readable file"),
        ({"auth_token_file": "/nope"}, "not a readable file"),
        ({"max_sessions_per_client": "-1"}, "negative"),
        ({"max_cache_bytes_per_client": "-5"}, "negative"),
    ],
)
def test_bad_security_settings_fail_at_start(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_config(None, overrides)
