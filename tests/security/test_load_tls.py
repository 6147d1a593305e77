"""`mha-client load` over TLS, mutual TLS and a bearer token (issue 11): the load's own
channels are secured as the CLI's client is, with the same flags as every other command."""

from __future__ import annotations

import asyncio
import json

import pytest

from mha_client.cli import main
from tests.security.certs import Authority
from tests.security.test_tls_auth import TOKEN, config, started


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca = Authority(directory)
    return {
        "ca": ca.ca_file,
        "server": ca.issue("mha-serve", server=True),
        "alice": ca.issue("alice", server=False),
    }


def load_argv(target: str, out, *security: str) -> list[str]:
    return [
        "load",
        "small",
        "--target",
        target,
        "--timeout",
        "30",
        "--concurrency",
        "2",
        "--requests",
        "6",
        "--warmup",
        "1",
        "--seq-len",
        "3",
        "--json-out",
        str(out),
        *security,
    ]


async def test_load_over_mutual_tls_with_a_token(pki, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    server, target = await started(
        config(
            tls_cert_file=pki["server"].cert,
            tls_key_file=pki["server"].key,
            tls_client_ca_file=pki["ca"],
            auth_token_file=str(token_file),
        )
    )
    alice = pki["alice"]
    tls = ["--ca-file", pki["ca"], "--cert-file", alice.cert, "--key-file", alice.key]
    out = tmp_path / "load.json"
    try:
        # main blocks (its client, then a loop of its own): off this loop, which serves.
        code = await asyncio.to_thread(
            main, load_argv(target, out, *tls, "--token-file", str(token_file))
        )
        assert code == 0, capsys.readouterr().err
        result = json.loads(out.read_text())
        assert result["ok"] == 6 and result["errors"] == {}
        # The same flags after the command or before it (the common parser's).
        before = ["--token-file", str(token_file), *tls]
        assert await asyncio.to_thread(main, [*before, *load_argv(target, out)]) == 0
        assert json.loads(out.read_text())["ok"] == 6
        # Without the token the server refuses, and the command says so.
        capsys.readouterr()
        assert await asyncio.to_thread(main, load_argv(target, out, *tls)) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
    finally:
        await server.stop()


async def test_load_over_server_tls(pki, tmp_path, capsys):
    server, target = await started(
        config(tls_cert_file=pki["server"].cert, tls_key_file=pki["server"].key)
    )
    out = tmp_path / "load.json"
    try:
        argv = load_argv(target, out, "--ca-file", pki["ca"])
        assert await asyncio.to_thread(main, argv) == 0, capsys.readouterr().err
        assert json.loads(out.read_text())["ok"] == 6
    finally:
        await server.stop()
