"""`rediss://` for real: a TLS-terminating proxy (a test CA, a server certificate for
127.0.0.1) in front of the test redis-server; the pipeline connects with
PIPELINE_REDIS_TLS_CA, submits and reads state through it, and refuses an untrusted server."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

import pipeline
from pipeline.core.broker.connection import connect_redis


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pipeline test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path, cert_path, key_path = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_path, cert_path, key_path


def _pipe(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, target):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def tls_proxy(tmp_path: Path, redis_url: str) -> Iterator[tuple[int, Path]]:
    """A TLS listener on 127.0.0.1 forwarding to the plain test redis-server; yields (port, CA file)."""
    ca, cert, key = _certificates(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    upstream = urlsplit(redis_url)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                raw, _ = listener.accept()
            except OSError:
                return
            try:
                client = context.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):
                raw.close()
                continue
            backend = socket.create_connection((upstream.hostname, upstream.port))
            threading.Thread(target=_pipe, args=(client, backend), daemon=True).start()
            threading.Thread(target=_pipe, args=(backend, client), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port, ca
    stop.set()
    listener.close()


def test_rediss_with_the_configured_ca(tls_proxy: tuple[int, Path], monkeypatch: pytest.MonkeyPatch,
                                        redis_client: redis.Redis) -> None:
    port, ca = tls_proxy
    monkeypatch.setenv("PIPELINE_REDIS_TLS_CA", str(ca))
    client = pipeline.connect(f"rediss://127.0.0.1:{port}/0")
    assert client.conn.ping()
    batch = client.submit([{"id": "a", "input_ids": [1, 2]}], run="tls", output="memory://tls")
    # The job went through TLS into the same Redis the plain client sees.
    assert redis_client.exists(f"rq:job:{batch.job_ids[0]}")
    assert client.control_state().generation == 0


def test_rediss_refuses_an_untrusted_server(tls_proxy: tuple[int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = tls_proxy
    monkeypatch.delenv("PIPELINE_REDIS_TLS_CA", raising=False)
    conn = connect_redis(f"rediss://127.0.0.1:{port}/0", reconnect_for_s=0)
    with pytest.raises(redis.ConnectionError, match=r"certificate verify failed|CERTIFICATE_VERIFY_FAILED"):
        conn.ping()
