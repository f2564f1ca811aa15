"""Certificates of the e2e's control plane, made with the ``openssl`` command (ECDSA P-256,
valid two days): a CA, and leaf certificates it signs for servers and clients.

Used for the API server's front proxy (the aggregator's client certificate, which an
aggregated API server such as KEDA's metrics adapter verifies: :mod:`cluster`) and for KEDA's
own CA (its adapter's serving certificate, and the operator-adapter gRPC mTLS: :mod:`keda`).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DAYS = "2"
KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Pair:
    """A certificate and its key (PEM files)."""

    cert: Path
    key: Path


def ca(folder: Path, name: str) -> Pair:
    """A self-signed CA ``<folder>/<name>.crt`` (and ``.key``)."""
    folder.mkdir(parents=True, exist_ok=True)
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    _openssl(
        "req", "-x509", *KEY, "-keyout", str(pair.key), "-out", str(pair.cert),
        "-days", DAYS, "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    )
    return pair


def leaf(
    signer: Pair,
    folder: Path,
    name: str,
    common_name: str,
    *,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
    organization: str = "",
) -> Pair:
    """``<folder>/<name>.crt`` signed by ``signer``, for ``common_name`` (the user a client
    certificate names), serving ``dns`` and ``ips``, good for server and client auth."""
    folder.mkdir(parents=True, exist_ok=True)
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    csr = folder / f"{name}.csr"
    subject = f"/CN={common_name}" + (f"/O={organization}" if organization else "")
    _openssl("req", *KEY, "-keyout", str(pair.key), "-out", str(csr), "-subj", subject)
    extensions = folder / f"{name}.ext"
    lines = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        "extendedKeyUsage=serverAuth,clientAuth",
    ]
    names = [f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips]
    if names:
        lines.append("subjectAltName=" + ",".join(names))
    extensions.write_text("\n".join(lines) + "\n")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(signer.cert), "-CAkey", str(signer.key),
        "-CAcreateserial", "-out", str(pair.cert), "-days", DAYS, "-extfile", str(extensions),
    )
    return pair
