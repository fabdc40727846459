"""`output-rate keys`: CURVE key pairs for the push endpoint and its engines.

The control plane gets its secret key and the list of engine public keys it
admits; each engine gets its own secret key (environment, never a flag, so it
does not show in `ps` or vLLM's logged arguments) and the server's public key
(`--control-plane-public-key`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq

from engine_ext.zmq_util import ENGINE_SECRET_KEY_ENV


@dataclass(frozen=True)
class KeyPair:
    public: str
    secret: str

    @classmethod
    def new(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public=public.decode(), secret=secret.decode())


def control_plane_env(server: KeyPair, engines: list[KeyPair]) -> str:
    return (
        f"OUTPUT_RATE_ZMQ_SECRET_KEY='{server.secret}'\n"
        f"OUTPUT_RATE_ZMQ_PUBLIC_KEY='{server.public}'\n"
        f"OUTPUT_RATE_ZMQ_CLIENT_KEYS='{','.join(e.public for e in engines)}'\n"
    )


def engine_env(engine: KeyPair) -> str:
    return f"{ENGINE_SECRET_KEY_ENV}='{engine.secret}'\n"


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def run(*, out_dir: Path | None, num_engines: int) -> str:
    """Make the keys; write them under out_dir (mode 0600) or return them all as text."""
    server = KeyPair.new()
    engines = [KeyPair.new() for _ in range(num_engines)]
    # Z85 has shell metacharacters but no single quote.
    flag = f"--control-plane-public-key '{server.public}'"
    if out_dir is None:
        lines = ["# control plane (environment or .env of `output-rate serve`)"]
        lines.append(control_plane_env(server, engines).rstrip())
        for i, engine in enumerate(engines, 1):
            lines.append(f"# engine {i}: environment of the vLLM server")
            lines.append(engine_env(engine).rstrip())
        lines.append(f"# every engine's vLLM flag: {flag}")
        return "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "control-plane.env"]
    _write_private(written[0], control_plane_env(server, engines))
    for i, engine in enumerate(engines, 1):
        path = out_dir / f"engine-{i}.env"
        _write_private(path, engine_env(engine))
        written.append(path)
    return (
        "wrote " + ", ".join(str(p) for p in written) + "\n"
        f"server public key: {server.public}\n"
        f"every engine's vLLM flag: {flag}\n"
    )
