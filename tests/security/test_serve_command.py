"""`mha-serve` with TLS, mutual TLS and a token set by environment, flag and TOML, and
`mha-client` with the matching flags; /metrics bound to another address than the API."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization

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


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the server's certificate and key, alice's, and a file that is no PEM."""
    directory = tmp_path_factory.mktemp("bad-tls")
    ca = Authority(directory)
    server, alice = ca.issue("mha-serve", server=True), ca.issue("alice", server=False)
    key = serialization.load_pem_private_key(Path(server.key).read_bytes(), None)
    encrypted = directory / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    junk = directory / "junk.pem"
    junk.write_text("not a PEM file\n")
    return {
        "ca": ca.ca_file,
        "cert": server.cert,
        "key": server.key,
        "alice_key": alice.key,
        "encrypted": str(encrypted),
        "junk": str(junk),
    }


# (settings as names of pki's files, the file the error must name, what it must say)
BAD_TLS = {
    "cert-no-pem": ({"tls_cert_file": "junk", "tls_key_file": "key"}, "junk", "no PEM certificate"),
    "key-no-pem": (
        {"tls_cert_file": "cert", "tls_key_file": "junk"},
        "junk",
        "not the PEM private key",
    ),
    "key-of-another": (
        {"tls_cert_file": "cert", "tls_key_file": "alice_key"},
        "alice_key",
        "not the PEM private key",
    ),
    "key-encrypted": (
        {"tls_cert_file": "cert", "tls_key_file": "encrypted"},
        "encrypted",
        "encrypted",
    ),
    "client-ca-no-pem": (
        {"tls_cert_file": "cert", "tls_key_file": "key", "tls_client_ca_file": "junk"},
        "junk",
        "no PEM CA certificates",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TLS))
def test_tls_files_that_do_not_load_fail_at_start_naming_the_file(pki, case):
    settings, named, message = BAD_TLS[case]
    with pytest.raises(ValueError, match=message) as err:
        build_config(None, {key: pki[name] for key, name in settings.items()})
    assert repr(pki[named]) in str(err.value)


def test_good_tls_files_load(pki):
    settings = {"tls_cert_file": pki["cert"], "tls_key_file": pki["key"]}
    assert build_config(None, {**settings, "tls_client_ca_file": pki["ca"]}).tls_cert_file


@pytest.mark.parametrize("workers", ["1", "2"])
def test_mha_serve_with_a_key_that_is_not_the_certificates_exits_2_naming_it(pki, workers):
    """Before anything starts (with frontend workers, a frontend found it only once the models
    were warm, died and was started again until the crash loop stopped the server)."""
    done = subprocess.run(
        [sys.executable, "-m", "mha_serve.transport.main", "--host", "127.0.0.1", "--port", "0"]
        + ["--metrics-port", "0", "--frontend-workers", workers]
        + ["--tls-cert-file", pki["cert"], "--tls-key-file", pki["alice_key"]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "configuration error" in done.stderr and pki["alice_key"] in done.stderr, done.stderr
