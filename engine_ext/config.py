"""The output-rate settings an engine runs with.

The plugin parses the server flags into an ``OutputRateConfig`` and stores it
in ``VllmConfig.additional_config[CONFIG_KEY]`` as a plain dict, because that
is what vLLM serializes into the engine-core process. The scheduler reads it
back with ``OutputRateConfig.from_vllm_config``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine_ext.metrics import DEFAULT_IDLE_S, DEFAULT_MAX_USERS, MAX_METRICS_USERS
from output_rate_core.rates import validate_rate

CONFIG_KEY = "output_rate"
# How long startup waits for the first snapshot before serving with the flags' limits.
DEFAULT_SNAPSHOT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class OutputRateConfig:
    default_rate: int | None = None
    user_rates: dict[str, int | None] = field(default_factory=dict)
    # The control plane's replicas (--control-plane-endpoint, comma-separated): the
    # push client talks to one at a time and moves to the next when it goes silent.
    control_plane_endpoints: tuple[str, ...] = ()
    engine_id: str | None = None
    # CURVE public key (z85) of the control plane; None = plain TCP.
    control_plane_public_key: str | None = None
    # How long startup waits for the first snapshot before serving with the
    # flags' limits (seconds).
    snapshot_timeout_s: float = DEFAULT_SNAPSHOT_TIMEOUT_S
    # Engine metrics (docs/metrics.md): users with a series of their own, and how
    # long a user stays idle before its series goes.
    metrics_max_users: int = DEFAULT_MAX_USERS
    metrics_idle_s: float = DEFAULT_IDLE_S
    # --data-parallel-size of the server (each rank joins the fleet as its own engine).
    data_parallel_size: int = 1
    # Where each connection to the control plane keeps the last configuration it applied
    # (engine_ext/saved_state.py); None: nowhere.
    state_dir: str | None = None
    # Ceilings for borrowing idle capacity (tokens/s; docs/scheduler.md, "Borrowing"):
    # the default's and per user (None: none). Replaced, like the rates, by the control
    # plane's configuration.
    default_ceiling: int | None = None
    user_ceilings: dict[str, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A list after the round trip through additional_config.
        object.__setattr__(self, "control_plane_endpoints", tuple(self.control_plane_endpoints))
        validate_rate(self.default_rate, field="default_rate")
        if not 0 <= self.metrics_max_users <= MAX_METRICS_USERS:
            raise ValueError(f"metrics_max_users must be 0..{MAX_METRICS_USERS}")
        if not self.metrics_idle_s > 0:
            raise ValueError("metrics_idle_s must be > 0")
        for user, rate in self.user_rates.items():
            validate_rate(rate, field=f"rate of user {user!r}")
        validate_rate(self.default_ceiling, field="default_ceiling")
        for user, ceiling in self.user_ceilings.items():
            validate_rate(ceiling, field=f"ceiling of user {user!r}")

    def engine_id_of_rank(self, rank: int) -> str:
        """The engine id a data-parallel rank connects with: the id, plus the rank."""
        base = self.engine_id or "engine"
        return f"{base}-dp{rank}" if self.data_parallel_size > 1 else base

    @property
    def enabled(self) -> bool:
        """The feature is on when any of the limit flags or the endpoint is given."""
        return (
            self.default_rate is not None
            or bool(self.user_rates)
            or bool(self.control_plane_endpoints)
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OutputRateConfig:
        return cls(**data)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> OutputRateConfig:
        extra = getattr(vllm_config, "additional_config", None)
        if isinstance(extra, dict) and isinstance(extra.get(CONFIG_KEY), dict):
            return cls.from_dict(extra[CONFIG_KEY])
        return cls()
