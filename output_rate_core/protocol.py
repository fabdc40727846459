"""Wire protocol between the control plane and engines (used by both sides).

Imports neither vLLM nor SQLAlchemy. Every message is one ZMQ frame: a
one-byte message type followed by a msgpack-encoded msgspec struct. Decoding
validates everything (types, rate ranges, op shapes) before a message is
handed on, so a malformed delta is dropped whole and never half applied.

Model (after Envoy xDS and the ZeroMQ guide's Clustered Hashmap Protocol):
an engine says HELLO with the version it holds and gets a full SNAPSHOT before
anything else, then every change as a DELTA whose version is exactly one more
than the last; it ACKs every version it applied. Both sides send HEARTBEATs:
the server's carries the last version it sent to that engine (sent after that
version's frame on the same connection, so an engine holding less knows a
frame was lost); the engine's carries the version it applied. A gap, a silent
server or a reconnect make the engine ask for a fresh snapshot (RESYNC).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Literal

import msgspec

from output_rate_core import ids, keys
from output_rate_core.outage import MAX_OUTAGE_KEEP_S, OutageMode, OutagePolicy
from output_rate_core.policy import Enforcement, Policy, Scope
from output_rate_core.rates import MAX_RATE, MIN_RATE

# Snapshots of 1,000,000 users fit in ~40 MB; anything beyond this is dropped.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Engines only send small messages (usage reports of at most MAX_USAGE_USERS users).
MAX_ENGINE_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_USAGE_USERS = 20_000
# What one engine can produce: output tokens granted per second, and request-steps
# refused a token per second, over all its users (100x an H200's decode rate). A usage
# report claiming more for its interval is refused whole.
MAX_ENGINE_TOKENS_PER_S = 1_000_000
MAX_ENGINE_STEPS_PER_S = 1_000_000
# The interval a usage report covers, as the engine measured it (NaN and infinities are
# refused: they fail both bounds). Engines report about once a second.
MIN_USAGE_INTERVAL_S = 1e-3
MAX_USAGE_INTERVAL_S = 3600.0
# The control plane takes at most this many usage reports a second from one engine
# (this many at once), by its own clock; engines send at most half as many.
MAX_USAGE_REPORTS_PER_S = 4.0
MAX_USAGE_REPORT_BURST = 8
# A report too large for one engine frame (thousands of long multi-byte user ids) goes as
# up to this many parts, split by users; the worst case (MAX_USAGE_USERS ids of 256
# four-byte characters in all four maps) takes 20 parts of MAX_ENGINE_MESSAGE_BYTES.
MAX_USAGE_PARTS = 32
HEARTBEAT_INTERVAL_S = 1.0
# The engine treats the server as gone after this long without any frame.
SERVER_SILENCE_S = 3.5
# A snapshot asked for and not received within this long is asked for again.
RESYNC_RETRY_S = 2.0

HELLO = 1
SNAPSHOT = 2
DELTA = 3
ACK = 4
HEARTBEAT = 5
USAGE = 6
RESYNC = 7
DEMAND = 8
SHARES = 9
SHARE_ACK = 10
KEY_USE = 11
GOODBYE = 12
REFUSED = 13
LEAVING = 14

# Fleet shares (docs/fleet.md) are in milli-tokens/s, so that an engine with demand
# always holds a share (>= 1) and shares sum exactly to a limit.
MILLI = 1000
# Largest share: a whole limit.
MAX_SHARE = MAX_RATE * MILLI
# An API server reports at most this many keys' last use in one message.
MAX_KEY_USES = 10_000
KEY_USE_INTERVAL_S = 5.0
# An engine reports at most this many users' demand in one message.
MAX_DEMAND_USERS = MAX_USAGE_USERS
MAX_LEASE_MS = 3_600_000
MAX_OUTAGE_KEEP_MS = int(MAX_OUTAGE_KEEP_S * 1000)
# An engine core's capacity, as it says at HELLO (vLLM's max_num_seqs): its demand for one
# user counts up to it (docs/fleet.md, "Trust"). An engine that does not say (an older
# build) counts as DEFAULT_ENGINE_CAPACITY; one that says more, as MAX_ENGINE_CAPACITY.
DEFAULT_ENGINE_CAPACITY = 1024
MAX_ENGINE_CAPACITY = 4096
# The control plane takes at most this many demand frames a second from one connection
# (this many at once), by its own clock; engines send at most half as many (and the parts
# of one large map together). And at most this many bytes of them a second (one frame of
# the largest size at once): a frame's cost is its entries (an engine with 20,000 fleet
# users restates ~0.4 MB every 5 s).
MAX_DEMAND_FRAMES_PER_S = 16.0
MAX_DEMAND_FRAME_BURST = 32
MAX_DEMAND_BYTES_PER_S = 512 * 1024
MAX_DEMAND_BYTES_BURST = MAX_ENGINE_MESSAGE_BYTES

# tokens/s (a rate or a ceiling); None: unlimited, not set or inherit, as each field says.
SetRate = Annotated[int, msgspec.Meta(ge=MIN_RATE, le=MAX_RATE)]
Rate = SetRate | None
# Who a connection is: an engine core (limits, usage, demand, shares), or the API server
# of an engine in --output-rate-identity api-key mode (API keys only; docs/identity.md).
Role = Literal["engine", "api"]
ENGINE_ROLE: Role = "engine"
API_ROLE: Role = "api"
# milli-tokens/s; 0: no share (the engine holds none for that user).
Share = Annotated[int, msgspec.Meta(ge=0, le=MAX_SHARE)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Version = Annotated[int, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Epoch = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Seq = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
# What engines send is checked against the shared id rules (output_rate_core/ids.py); what
# the server sends came from the database, which the REST API already checked.
EngineId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=ids.MAX_ENGINE_ID_LEN,
        pattern=ids.wire_pattern(ids.ENGINE_ID_PATTERN),
    ),
]
ModelName = Annotated[
    str, msgspec.Meta(max_length=ids.MAX_MODEL_LEN, pattern=ids.wire_pattern(ids.MODEL_PATTERN))
]
UserId = Annotated[
    str,
    msgspec.Meta(
        min_length=1, max_length=ids.MAX_USER_ID_LEN, pattern=ids.wire_pattern(ids.USER_ID_PATTERN)
    ),
]
KeyId = Annotated[str, msgspec.Meta(pattern=ids.wire_pattern(keys.KEY_ID_PATTERN))]
KeyHash = Annotated[str, msgspec.Meta(pattern=ids.wire_pattern(keys.KEY_HASH_PATTERN))]
VllmVersion = Annotated[
    str,
    msgspec.Meta(
        max_length=ids.MAX_VLLM_VERSION_LEN, pattern=ids.wire_pattern(ids.VLLM_VERSION_PATTERN)
    ),
]


# ---- the ops of a delta (the rows of config_changes.ops) ----------------------
#
# A policy (output_rate_core/policy.py) travels as its fields, flat, exactly as before
# there was a Policy value: engines and control planes of different builds talk to each
# other during a rolling upgrade, and the config_changes rows already stored must keep
# decoding. So the wire format never changes with the code's shapes: code builds ops and
# snapshots with `of` and reads them with `policy` and the `*_policies` accessors, and
# only these name the flat fields.


class SetUser(msgspec.Struct, frozen=True, tag_field="op", tag="set_user"):
    user: Name
    tier: Name | None = None
    rate: Rate = None
    # None: inherit (the tier's, else the default's).
    scope: Scope | None = None
    enforcement: Enforcement | None = None
    # tokens/s the user may borrow up to; None: inherit. Fields are appended last, with
    # a default: config_changes rows and peers older than a field still decode.
    ceiling: Rate = None

    @classmethod
    def of(cls, user: str, tier: str | None, policy: Policy) -> SetUser:
        return cls(user, tier, policy.rate, policy.scope, policy.enforcement, policy.ceiling)

    @property
    def policy(self) -> Policy:
        return Policy(self.rate, self.scope, self.enforcement, self.ceiling)


class DeleteUser(msgspec.Struct, frozen=True, tag_field="op", tag="delete_user"):
    user: Name


class SetTier(msgspec.Struct, frozen=True, tag_field="op", tag="set_tier"):
    name: Name
    rate: Rate = None
    scope: Scope | None = None
    enforcement: Enforcement | None = None
    ceiling: Rate = None

    @classmethod
    def of(cls, name: str, policy: Policy) -> SetTier:
        return cls(name, policy.rate, policy.scope, policy.enforcement, policy.ceiling)

    @property
    def policy(self) -> Policy:
        return Policy(self.rate, self.scope, self.enforcement, self.ceiling)


class DeleteTier(msgspec.Struct, frozen=True, tag_field="op", tag="delete_tier"):
    name: Name


class SetDefault(msgspec.Struct, frozen=True, tag_field="op", tag="set_default"):
    rate: Rate = None
    # None: "fleet".
    scope: Scope | None = None
    # None: "enforce".
    enforcement: Enforcement | None = None
    # None: no borrowing.
    ceiling: Rate = None

    @classmethod
    def of(cls, policy: Policy) -> SetDefault:
        return cls(policy.rate, policy.scope, policy.enforcement, policy.ceiling)

    @property
    def policy(self) -> Policy:
        return Policy(self.rate, self.scope, self.enforcement, self.ceiling)


class SetKey(msgspec.Struct, frozen=True, tag_field="op", tag="set_key"):
    """An API key of ``user`` (output_rate_core/keys.py); only its hash travels."""

    id: KeyId
    user: Name
    hash: KeyHash


class DeleteKey(msgspec.Struct, frozen=True, tag_field="op", tag="delete_key"):
    id: KeyId


LimitOp = SetUser | DeleteUser | SetTier | DeleteTier | SetDefault
KeyOp = SetKey | DeleteKey
Op = LimitOp | KeyOp


# ---- messages -----------------------------------------------------------------


class Hello(msgspec.Struct, frozen=True):
    engine_id: EngineId
    model: ModelName
    version: Version
    # An engine's API server connects with its engine's id and role "api": one connection
    # per (engine id, role); it gets the keys only (its snapshot has no limits, and its
    # deltas carry only key ops, with every version kept so gaps still show).
    role: Role = ENGINE_ROLE
    # The vLLM the engine runs (GET /engines shows it); "": not known (an engine from
    # before HELLO said it: it decodes, as any field added with a default).
    vllm_version: VllmVersion = ""
    # An engine core's capacity (max_num_seqs; 0: not said), which bounds its demand.
    capacity: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0


# A user's record with its policy's fields flat, as the control plane's table holds it:
# (user, tier or None, rate, scope, enforcement, ceiling).
UserRow = tuple[str, str | None, int | None, Scope | None, Enforcement | None, int | None]


class Snapshot(msgspec.Struct, frozen=True):
    """The whole configuration at one version. Its policies travel as separate flat maps
    (the wire format, kept as it is: see the ops above); `of`, `of_rows` and the
    accessors below are the only code that names them."""

    version: Version
    default_rate: Rate
    tiers: dict[Name, Rate]
    # user -> (tier, override rate)
    users: dict[Name, tuple[Name | None, Rate]]
    default_scope: Scope | None = None
    # tier / user -> its own scope (absent: inherit)
    tier_scopes: dict[Name, Scope] = {}
    user_scopes: dict[Name, Scope] = {}
    default_enforcement: Enforcement | None = None
    # tier / user -> its own enforcement (absent: inherit)
    tier_enforcements: dict[Name, Enforcement] = {}
    user_enforcements: dict[Name, Enforcement] = {}
    # Live engines in the fleet (the engine's safe share divides fleet limits by it).
    num_engines: Annotated[int, msgspec.Meta(ge=1)] = 1
    # API key id -> (user, hash of the key); only in snapshots for the "api" role.
    keys: dict[KeyId, tuple[Name, KeyHash]] = {}
    # The default's ceiling (None: no borrowing); tier / user -> its own ceiling (absent:
    # inherit). After the other fields: a snapshot from an older control plane decodes.
    default_ceiling: Rate = None
    tier_ceilings: dict[Name, SetRate] = {}
    user_ceilings: dict[Name, SetRate] = {}

    @classmethod
    def of(
        cls,
        version: int,
        default: Policy,
        tiers: Mapping[str, Policy],
        users: Mapping[str, tuple[str | None, Policy]],
    ) -> Snapshot:
        """`users`: user -> (its tier or None, its own policy)."""
        rows = (
            (user, tier, policy.rate, policy.scope, policy.enforcement, policy.ceiling)
            for user, (tier, policy) in users.items()
        )
        return cls.of_rows(version, default, tiers, rows)

    @classmethod
    def of_rows(
        cls,
        version: int,
        default: Policy,
        tiers: Mapping[str, Policy],
        users: Iterable[UserRow],
    ) -> Snapshot:
        """`users`: one row per user, its policy flat as stored, so that a snapshot of
        the whole table (it may hold a million users) builds no Policy on the way."""
        # One pass over the users.
        flat: dict[str, tuple[str | None, int | None]] = {}
        user_scopes: dict[str, Scope] = {}
        user_enforcements: dict[str, Enforcement] = {}
        user_ceilings: dict[str, int] = {}
        for user, tier, rate, scope, enforcement, ceiling in users:
            flat[user] = (tier, rate)
            if scope is not None:
                user_scopes[user] = scope
            if enforcement is not None:
                user_enforcements[user] = enforcement
            if ceiling is not None:
                user_ceilings[user] = ceiling
        return cls(
            version=version,
            default_rate=default.rate,
            tiers={name: policy.rate for name, policy in tiers.items()},
            users=flat,
            default_scope=default.scope,
            tier_scopes={n: t.scope for n, t in tiers.items() if t.scope is not None},
            user_scopes=user_scopes,
            default_enforcement=default.enforcement,
            tier_enforcements={
                n: t.enforcement for n, t in tiers.items() if t.enforcement is not None
            },
            user_enforcements=user_enforcements,
            default_ceiling=default.ceiling,
            tier_ceilings={n: t.ceiling for n, t in tiers.items() if t.ceiling is not None},
            user_ceilings=user_ceilings,
        )

    @property
    def default_policy(self) -> Policy:
        return Policy(
            self.default_rate, self.default_scope, self.default_enforcement, self.default_ceiling
        )

    def tier_policies(self) -> dict[str, Policy]:
        scopes, modes, ceilings = self.tier_scopes, self.tier_enforcements, self.tier_ceilings
        return {
            name: Policy(rate, scopes.get(name), modes.get(name), ceilings.get(name))
            for name, rate in self.tiers.items()
        }

    def user_policies(self) -> dict[str, tuple[str | None, Policy]]:
        """user -> (its tier or None, its own policy)."""
        scopes, modes, ceilings = self.user_scopes, self.user_enforcements, self.user_ceilings
        return {
            user: (tier, Policy(rate, scopes.get(user), modes.get(user), ceilings.get(user)))
            for user, (tier, rate) in self.users.items()
        }


class Delta(msgspec.Struct, frozen=True):
    version: Version
    ops: list[Op]


class Ack(msgspec.Struct, frozen=True):
    engine_id: EngineId
    version: Version


class Heartbeat(msgspec.Struct, frozen=True):
    # Server: the last version it sent this engine. Engine: the version it applied.
    version: Version
    # Set by engines, so a restarted server can tell who is talking ("" from the server).
    engine_id: Annotated[str, msgspec.Meta(max_length=ids.MAX_ENGINE_ID_LEN)] = ""
    model: ModelName = ""
    # Set by peers like Hello.role: a restarted server binds a redialled connection by
    # its first HEARTBEAT or RESYNC, and must know which of an engine's two it is.
    role: Role = ENGINE_ROLE


class Usage(msgspec.Struct, frozen=True):
    engine_id: EngineId
    # Seconds the counts cover (measured by the engine).
    interval_s: Annotated[float, msgspec.Meta(ge=MIN_USAGE_INTERVAL_S, le=MAX_USAGE_INTERVAL_S)]
    # user -> output tokens granted / request-steps refused a token, in the interval
    granted: dict[UserId, Count]
    throttled: dict[UserId, Count]
    # One interval's report in `num_parts` frames, sent in order, each naming other
    # users: the control plane takes the interval when its last part arrives, and
    # refuses it whole (every bound counts the parts together) or takes it whole.
    part: Annotated[int, msgspec.Meta(ge=0, lt=MAX_USAGE_PARTS)] = 0
    num_parts: Annotated[int, msgspec.Meta(ge=1, le=MAX_USAGE_PARTS)] = 1
    # user -> request-steps a shadow limit would have refused (they were served)
    would_throttle: dict[UserId, Count] = {}
    # user -> output tokens of `granted` lent beyond the user's rate (docs/scheduler.md,
    # "Borrowing"). Read it through `borrowed_counts`. Never in the frame while empty
    # (msgspec.UNSET is left out, and an empty map is made UNSET): a report with nothing
    # borrowed is the bytes it was before the field, and older peers' frames decode.
    borrowed: dict[UserId, Count] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if self.borrowed == {}:
            msgspec.structs.force_setattr(self, "borrowed", msgspec.UNSET)

    @property
    def borrowed_counts(self) -> dict[str, int]:
        """user -> tokens borrowed ({} when none)."""
        return {} if isinstance(self.borrowed, msgspec.UnsetType) else self.borrowed


class Resync(msgspec.Struct, frozen=True):
    engine_id: EngineId
    version: Version
    role: Role = ENGINE_ROLE


# ---- fleet shares (docs/fleet.md) ----------------------------------------------


class Demand(msgspec.Struct, frozen=True):
    """Engine -> control plane: streams (running + waiting requests) per fleet-limited
    user. ``full``: every user with demand (the rest have none); else only changes,
    with 0 for a user whose demand ended. ``stalled`` (every frame: the whole set now):
    users with requests here none of which can run (every running slot is taken by
    others): they hold their place in the split but weigh nothing, so the share goes
    where it is used (docs/fleet.md, "Demand")."""

    engine_id: EngineId
    full: bool
    streams: dict[UserId, Count]
    # Set by the replica the engine talks to (whatever the engine sent): the users whose
    # count it cut to the engine's capacity (docs/fleet.md, "Trust").
    over_capacity: list[UserId] = []
    stalled: list[UserId] = []
    # Set by the replica too (every frame: the whole set now): the users with demand whose
    # last usage report from the engine bears out the streams claimed: at least a token a
    # second granted per stream, or throttled (would-throttle) steps (docs/fleet.md, "Trust").
    evidenced: list[UserId] = []


class Shares(msgspec.Struct, frozen=True, omit_defaults=True):
    """Control plane -> engine: this engine's shares. ``seq`` counts up by one per
    message within an ``epoch`` (one allocator's lifetime); ``full`` replaces every
    share, else only the users named change (0: none). Every message renews the lease
    of all the engine's shares for ``lease_ms``. Fields at their default are left out
    of the frame (a renewal under the default policy is the bytes it was before them)."""

    epoch: Epoch
    seq: Seq
    lease_ms: Annotated[int, msgspec.Meta(ge=1, le=MAX_LEASE_MS)]
    num_engines: Annotated[int, msgspec.Meta(ge=1)]
    full: bool
    # user -> share
    shares: dict[Name, Share]
    # What the engine does when the lease ends (output_rate_core.limits.OutagePolicy, the
    # control plane's setting): "serving", "keep" (the shares, ``outage_keep_ms`` more) or
    # "fraction" (``outage_fraction`` x L on each engine). Added after the frames above:
    # an older control plane's frame decodes as "serving" with no counts, which is what
    # engines did before (the safe share of the whole fleet).
    outage: OutageMode = "serving"
    outage_keep_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_OUTAGE_KEEP_MS)] = 0
    outage_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    # user -> the engines serving it (with demand for it, or holding a share of it), for
    # users given a share > 0 in this frame: "serving" and "keep" fall back to L / count.
    serving: dict[Name, Annotated[int, msgspec.Meta(ge=1, le=2**31)]] = {}

    @property
    def outage_policy(self) -> OutagePolicy:
        return OutagePolicy(self.outage, self.outage_keep_ms / 1000, self.outage_fraction)


class ShareAck(msgspec.Struct, frozen=True):
    engine_id: EngineId
    epoch: Epoch
    seq: Seq


class KeyUse(msgspec.Struct, frozen=True):
    """API server -> control plane, about every KEY_USE_INTERVAL_S while keys are used:
    when each key was last used (Unix seconds), for ``last_used_at``."""

    engine_id: EngineId
    # key id -> last use (Unix seconds)
    used: dict[KeyId, Annotated[float, msgspec.Meta(ge=0, le=2**40)]]


class Goodbye(msgspec.Struct, frozen=True):
    """Control plane -> engine, when a replica shuts down cleanly: move to the next
    replica now instead of waiting for silence (the engine keeps what it holds)."""


# Why a claim of an engine id was refused: another live connection holds the id (on this
# replica or another), the connection's CURVE key may not claim it, or the server is full.
RefusalReason = Literal["engine_id_in_use", "engine_id_not_allowed", "server_full"]


class Refused(msgspec.Struct, frozen=True):
    """Control plane -> a connection whose claim of an engine id it refused (its HELLO, or
    a HEARTBEAT or RESYNC that would bind it): why, so that the engine says so instead of
    waiting in silence. Each later claim from it (every heartbeat) is another try."""

    reason: RefusalReason
    detail: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class Leaving(msgspec.Struct, frozen=True):
    """Engine -> control plane, the last frame of a connection whose engine stops (SIGTERM,
    vLLM shutting down): it serves nothing more, so its fleet shares go to the others now
    and its id is free for the engine that replaces it."""

    engine_id: EngineId
    role: Role = ENGINE_ROLE


Message = (
    Hello
    | Snapshot
    | Delta
    | Ack
    | Heartbeat
    | Usage
    | Resync
    | Demand
    | Shares
    | ShareAck
    | KeyUse
    | Goodbye
    | Refused
    | Leaving
)

TYPES: dict[int, type[Message]] = {
    HELLO: Hello,
    SNAPSHOT: Snapshot,
    DELTA: Delta,
    ACK: Ack,
    HEARTBEAT: Heartbeat,
    USAGE: Usage,
    RESYNC: Resync,
    DEMAND: Demand,
    SHARES: Shares,
    SHARE_ACK: ShareAck,
    KEY_USE: KeyUse,
    GOODBYE: Goodbye,
    REFUSED: Refused,
    LEAVING: Leaving,
}
TYPE_OF: dict[type[Message], int] = {cls: code for code, cls in TYPES.items()}

_encoder = msgspec.msgpack.Encoder()
_decoders = {code: msgspec.msgpack.Decoder(cls) for code, cls in TYPES.items()}


class ProtocolError(ValueError):
    """A frame that is not a valid message; the receiver drops and counts it."""


def encode(message: Message) -> bytes:
    return TYPE_OF[type(message)].to_bytes(1, "big") + _encoder.encode(message)


def decode(frame: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    if not frame or len(frame) > max_bytes:
        raise ProtocolError(f"bad frame size {len(frame)}")
    decoder = _decoders.get(frame[0])
    if decoder is None:
        raise ProtocolError(f"unknown message type {frame[0]}")
    try:
        message: Message = decoder.decode(memoryview(frame)[1:])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"{TYPES[frame[0]].__name__}: {e}") from None
    if isinstance(message, Usage):
        check_usage_bounds(message)
    elif isinstance(message, Demand) and (
        max(len(message.streams), len(message.stalled), len(message.over_capacity))
        > MAX_DEMAND_USERS
    ):
        raise ProtocolError(f"demand report names over {MAX_DEMAND_USERS} users")
    elif isinstance(message, Shares):
        try:
            message.outage_policy  # noqa: B018 (validates the fields together)
        except ValueError as e:
            raise ProtocolError(f"Shares: {e}") from None
    elif isinstance(message, KeyUse) and len(message.used) > MAX_KEY_USES:
        raise ProtocolError(f"key use report names over {MAX_KEY_USES} keys")
    elif isinstance(message, Heartbeat) and message.engine_id:
        try:
            ids.check_engine_id(message.engine_id)
        except ValueError as e:
            raise ProtocolError(f"Heartbeat: {e}") from None
    return message


def check_usage_bounds(report: Usage) -> None:
    """A report names at most MAX_USAGE_USERS users in each map, and claims no more than
    one engine can produce in its interval."""
    maps = (report.granted, report.throttled, report.would_throttle, report.borrowed_counts)
    if max(map(len, maps)) > MAX_USAGE_USERS:
        raise ProtocolError(f"usage report names too many users (over {MAX_USAGE_USERS} in a map)")
    if report.part >= report.num_parts:
        raise ProtocolError(f"usage report part {report.part} of {report.num_parts}")
    # +1: an engine's first tokens may land in a very short first interval.
    if sum(report.granted.values()) > MAX_ENGINE_TOKENS_PER_S * report.interval_s + 1:
        raise ProtocolError("usage report grants more tokens than one engine can produce")
    # Borrowed tokens are a part of the granted ones: the same bound.
    if sum(report.borrowed_counts.values()) > MAX_ENGINE_TOKENS_PER_S * report.interval_s + 1:
        raise ProtocolError("usage report lends more tokens than one engine can produce")
    if sum(report.throttled.values()) > MAX_ENGINE_STEPS_PER_S * report.interval_s + 1:
        raise ProtocolError("usage report refuses more steps than one engine can make")
    if sum(report.would_throttle.values()) > MAX_ENGINE_STEPS_PER_S * report.interval_s + 1:
        raise ProtocolError("usage report would refuse more steps than one engine can make")


def ops_from_rows(rows: list[dict[str, object]]) -> list[Op]:
    """Validate ops as stored in config_changes (server side, before sending)."""
    try:
        return msgspec.convert(rows, list[Op])
    except msgspec.ValidationError as e:
        raise ProtocolError(f"bad op in the change log: {e}") from None


def peek_type(frame: bytes) -> int | None:
    return frame[0] if frame else None
