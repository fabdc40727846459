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

from output_rate_core.zmq_util import ENGINE_SECRET_KEY_ENV


@dataclass(frozen=True)
class KeyPair:
    public: str
    secret: str

    @classmethod
    def new(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public=public.decode(), secret=secret.decode())


def engine_id(number: int) -> str:
    """The engine id key pair `number` (1-based) is bound to in the allow-list."""
    return f"engine-{number}"


def control_plane_env(server: KeyPair, engines: list[KeyPair]) -> str:
    # Each engine key may claim only its own engine id (--output-rate-engine-id engine-N).
    allowed = ",".join(f"{e.public}={engine_id(i)}" for i, e in enumerate(engines, 1))
    return (
        f"OUTPUT_RATE_ZMQ_SECRET_KEY='{server.secret}'\n"
        f"OUTPUT_RATE_ZMQ_PUBLIC_KEY='{server.public}'\n"
        f"OUTPUT_RATE_ZMQ_CLIENT_KEYS='{allowed}'\n"
    )


def engine_env(engine: KeyPair) -> str:
    return f"{ENGINE_SECRET_KEY_ENV}='{engine.secret}'\n"


class KeysExist(Exception):
    """`keys --out` would overwrite key files (the old keys would be lost)."""


def _write_private(path: Path, text: str) -> None:
    # O_EXCL: never overwrite a key file (checked for all files first; this is the guard
    # against a race).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def public_key_flag(public: str) -> str:
    """The engine's flag for the server public key, ready to paste into a shell."""
    # '=': a Z85 key may begin with '-', which argparse would take for another flag. Quoted:
    # Z85 has shell metacharacters but no single quote.
    return f"--control-plane-public-key='{public}'"


def run(*, out_dir: Path | None, num_engines: int, force: bool = False) -> str:
    """Make the keys; write them under out_dir (mode 0600) or return them all as text.

    Existing key files are never overwritten unless ``force`` (KeysExist names them)."""
    server = KeyPair.new()
    engines = [KeyPair.new() for _ in range(num_engines)]
    flag = public_key_flag(server.public)
    if out_dir is None:
        lines = ["# control plane (environment or .env of `output-rate serve`)"]
        lines.append(control_plane_env(server, engines).rstrip())
        for i, engine in enumerate(engines, 1):
            lines.append(
                f"# engine {i}: environment of the vLLM server "
                f"(--output-rate-engine-id {engine_id(i)})"
            )
            lines.append(engine_env(engine).rstrip())
        lines.append(f"# every engine's vLLM flag: {flag}")
        return "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {out_dir / "control-plane.env": control_plane_env(server, engines)}
    for i, engine in enumerate(engines, 1):
        files[out_dir / f"{engine_id(i)}.env"] = engine_env(engine)
    existing = [path for path in files if path.exists()]
    if existing and not force:
        raise KeysExist(
            "refusing to overwrite " + ", ".join(map(str, existing)) + " (--force replaces them)"
        )
    for path, text in files.items():
        if force:
            path.unlink(missing_ok=True)
        _write_private(path, text)
    return (
        "wrote " + ", ".join(str(p) for p in files) + "\n"
        f"server public key: {server.public}\n"
        f"every engine's vLLM flag: {flag} --output-rate-engine-id engine-N\n"
    )
