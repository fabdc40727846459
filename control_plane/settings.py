"""The control plane's settings: environment variables prefixed OUTPUT_RATE_, or .env."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OUTPUT_RATE_", env_file=".env", extra="ignore")

    database_url: str = "sqlite:///./output_rate.db"
    host: str = "127.0.0.1"
    port: int = 8700
    zmq_endpoint: str = "tcp://127.0.0.1:5557"
    admin_token: SecretStr | None = None
    # CURVE keys (Z85) of the push endpoint, from `output-rate keys`; unset = plain TCP.
    zmq_secret_key: SecretStr | None = None
    zmq_public_key: str | None = None
    # Comma-separated CURVE public keys of the engines allowed to connect (from
    # `output-rate keys`); empty = any engine that knows the server's public key.
    zmq_client_keys: str = ""
    # Seconds without a heartbeat before an engine is shown as disconnected.
    engine_timeout_s: float = 5.0
    # Days of per-minute usage history kept (GET /usage/history); older minutes are pruned.
    usage_retention_days: int = Field(default=7, ge=1, le=3650)


@lru_cache
def get_settings() -> Settings:
    return Settings()
