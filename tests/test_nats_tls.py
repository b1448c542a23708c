"""TLS to NATS: a nats-server with a certificate of a private CA, the daemon connecting with a `tls://` URL and the
CA named by `SSL_CERT_FILE` (Python's default context reads it), as docs/platform.md ("Users, permissions, TLS")
says; a client that does not trust the CA is refused."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import nats
import pytest

from recovery.testing.nats import NatsServer
from tests.daemon_support import running_daemon
from tests.test_daemon import ctl, spec


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate it signed for 127.0.0.1 and localhost: (ca, cert, key)."""
    openssl = shutil.which("openssl")
    assert openssl, "the TLS test needs the openssl command (Debian's openssl package; .ci/run installs it)"
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.pem", "server.key", "server.csr",
                                                          "server.pem"))
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", "/CN=recovery test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(cert),
        "-days", "2", "-extfile", str(ext))
    return ca, cert, key


async def test_the_daemon_runs_over_tls_with_the_ca_in_ssl_cert_file(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ca, cert, key = make_certificates(tmp_path)
    with NatsServer(tmp_path / "nats", extra_args=["--tls", "--tlscert", str(cert), "--tlskey", str(key)]) as server:
        url = server.url.replace("nats://", "tls://")
        with pytest.raises((nats.errors.NoServersError, OSError)):  # no trust in the CA: refused
            await nats.connect(url, allow_reconnect=False, connect_timeout=2)
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        async with running_daemon(url, tmp_path / "data", timers_enabled=False) as daemon:
            reply = await ctl(url, "submit", job="t", spec=spec(["a"]))
            assert reply["ok"] and reply["applied"]
            assert daemon.nc is not None and daemon.nc.connected_url is not None
            assert daemon.nc.connected_url.scheme == "tls"
