"""The wire protocol: every message round-trips; anything malformed is refused whole."""

from __future__ import annotations

import msgspec
import pytest

from output_rate_core import ids
from output_rate_core import protocol as p
from output_rate_core.outage import OutagePolicy
from output_rate_core.policy import Policy

MESSAGES: list[p.Message] = [
    p.Hello("engine-1", "tiny", 7),
    p.Hello("engine-1", "tiny", 7, role="api"),
    p.Snapshot(
        version=12,
        default_rate=None,
        tiers={"free": 20, "pro": None},
        users={"a": ("free", None), "b": (None, 5), "c": ("pro", 1_000_000)},
    ),
    p.Delta(
        13,
        [
            p.SetUser("a", "pro", None),
            p.SetUser("b", None, 7),
            p.DeleteUser("c"),
            p.SetTier("free", 30),
            p.SetTier("pro", None),
            p.DeleteTier("old"),
            p.SetDefault(None),
            p.SetDefault(1),
            p.SetKey("abcdefgh2345", "a", "0" * 64),
            p.DeleteKey("abcdefgh2345"),
        ],
    ),
    p.Snapshot(
        version=3, default_rate=5, tiers={}, users={}, keys={"abcdefgh2345": ("a", "f" * 64)}
    ),
    p.KeyUse("engine-1", {"abcdefgh2345": 1_790_000_000.5}),
    p.Goodbye(),
    p.Refused("engine_id_in_use", "'engine-1' is held by the live connection from 10.0.0.1"),
    p.Leaving("engine-1"),
    p.Leaving("engine-1", "api"),
    p.Ack("engine-1", 13),
    p.Heartbeat(13),
    p.Heartbeat(13, "engine-1", "tiny"),
    p.Heartbeat(13, "engine-1", "tiny", role="api"),
    p.Usage("engine-1", 1.02, {"a": 40, "b": 3}, {"a": 12}),
    p.Usage("engine-1", 1.02, {"c": 1}, {}, part=2, num_parts=3),
    p.Usage("engine-1", 1.02, {"a": 40}, {}, would_throttle={"a": 9}),
    p.Snapshot(
        version=14,
        default_rate=5,
        tiers={"free": 20},
        users={"a": ("free", None), "b": (None, 5)},
        default_enforcement="shadow",
        tier_enforcements={"free": "enforce"},
        user_enforcements={"b": "shadow"},
    ),
    p.Delta(
        15,
        [
            p.SetUser("a", None, 5, enforcement="shadow"),
            p.SetTier("free", 30, enforcement="enforce"),
            p.SetDefault(1, enforcement="shadow"),
        ],
    ),
    p.Snapshot(
        version=16,
        default_rate=5,
        tiers={"free": 20, "pro": None},
        users={"a": ("free", None), "b": (None, 5)},
        default_ceiling=10,
        tier_ceilings={"free": 1_000_000},
        user_ceilings={"b": 6},
    ),
    p.Delta(
        17,
        [
            p.SetUser("a", None, 5, ceiling=9),
            p.SetTier("free", 30, enforcement="shadow", ceiling=40),
            p.SetDefault(1, ceiling=1),
            p.SetDefault(None),
        ],
    ),
    p.Resync("engine-1", 11),
    p.Resync("engine-1", 11, role="api"),
    p.Hello("engine-1", "tiny", 7, vllm_version="0.34.0"),
    p.Hello("engine-1", "tiny", 7, role="api", vllm_version="0.33.0rc1.dev4+g2b0f.cpu"),
    p.Hello("engine-1", "tiny", 7, vllm_version="1" * ids.MAX_VLLM_VERSION_LEN),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: p.Message) -> None:
    frame = p.encode(message)
    assert frame[0] == p.TYPE_OF[type(message)]
    assert p.decode(frame) == message


def test_ops_are_tagged_as_in_the_change_log() -> None:
    rows: list[dict[str, object]] = [
        {
            "op": "set_user",
            "user": "a",
            "tier": "free",
            "rate": None,
            "scope": None,
            "enforcement": "shadow",
            "ceiling": 8,
        },
        {"op": "delete_user", "user": "a"},
        {
            "op": "set_tier",
            "name": "free",
            "rate": 3,
            "scope": "engine",
            "enforcement": None,
            "ceiling": None,
        },
        {"op": "delete_tier", "name": "free"},
        {
            "op": "set_default",
            "rate": None,
            "scope": "fleet",
            "enforcement": "enforce",
            "ceiling": None,
        },
    ]
    ops = p.ops_from_rows(rows)
    assert [type(op) for op in ops] == [
        p.SetUser,
        p.DeleteUser,
        p.SetTier,
        p.DeleteTier,
        p.SetDefault,
    ]
    # The server sends typed ops; their encoding is exactly the stored rows.
    assert msgspec.json.decode(msgspec.json.encode(ops)) == rows
    # Rows written before scopes (or enforcement, or ceilings) existed read as "inherit".
    assert p.ops_from_rows([{"op": "set_user", "user": "a", "tier": None, "rate": 5}]) == [
        p.SetUser("a", None, 5, None)
    ]
    old_default = {"op": "set_default", "rate": 5, "scope": None, "enforcement": "shadow"}
    assert p.ops_from_rows([old_default]) == [p.SetDefault(5, None, "shadow", None)]


def test_policies_travel_as_the_flat_fields_they_always_had() -> None:
    """Ops and snapshots built from policies encode exactly as the flat fields did (a
    rolling upgrade mixes builds; stored config_changes rows must keep decoding)."""
    pro = Policy(3, "engine", None, 12)
    shadow = Policy(None, None, "shadow")
    ops: list[p.Op] = [
        p.SetUser.of("a", "free", shadow),
        p.SetTier.of("free", pro),
        p.SetDefault.of(Policy(None, "fleet", "enforce", 7)),
    ]
    assert ops == [
        p.SetUser("a", "free", None, None, "shadow"),
        p.SetTier("free", 3, "engine", None, 12),
        p.SetDefault(None, "fleet", "enforce", 7),
    ]
    assert [op.policy for op in ops] == [shadow, pro, Policy(None, "fleet", "enforce", 7)]
    borrower = Policy(4, None, None, 9)
    snapshot = p.Snapshot.of(
        7,
        Policy(5, "engine", None, 6),
        {"free": pro},
        {"a": ("free", shadow), "b": (None, borrower)},
    )
    assert snapshot == p.Snapshot(
        7,
        5,
        {"free": 3},
        {"a": ("free", None), "b": (None, 4)},
        default_scope="engine",
        tier_scopes={"free": "engine"},
        user_enforcements={"a": "shadow"},
        default_ceiling=6,
        tier_ceilings={"free": 12},
        user_ceilings={"b": 9},
    )
    assert snapshot.default_policy == Policy(5, "engine", None, 6)
    assert snapshot.tier_policies() == {"free": pro}
    assert snapshot.user_policies() == {"a": ("free", shadow), "b": (None, borrower)}


def _frame(kind: int, payload: object) -> bytes:
    return bytes([kind]) + msgspec.msgpack.encode(payload)


BAD_FRAMES = {
    "empty": b"",
    "unknown type": b"\xff\x80",
    "type zero": b"\x00\x80",
    "not msgpack": bytes([p.DELTA]) + b"\xc1\xc1",
    "truncated": p.encode(MESSAGES[2])[:-3],
    "wrong struct": _frame(p.DELTA, {"engine_id": "x", "model": "m", "version": 1}),
    "negative version": _frame(p.ACK, {"engine_id": "x", "version": -1}),
    "zero rate": _frame(p.DELTA, {"version": 2, "ops": [{"op": "set_default", "rate": 0}]}),
    "huge rate": _frame(
        p.DELTA, {"version": 2, "ops": [{"op": "set_tier", "name": "t", "rate": 10**7}]}
    ),
    "fractional rate": _frame(
        p.DELTA, {"version": 2, "ops": [{"op": "set_user", "user": "u", "rate": 2.5}]}
    ),
    "string rate": _frame(
        p.DELTA, {"version": 2, "ops": [{"op": "set_user", "user": "u", "rate": "5"}]}
    ),
    "unknown op": _frame(p.DELTA, {"version": 2, "ops": [{"op": "drop_table", "name": "t"}]}),
    "op without user": _frame(p.DELTA, {"version": 2, "ops": [{"op": "delete_user"}]}),
    "empty user": _frame(p.DELTA, {"version": 2, "ops": [{"op": "delete_user", "user": ""}]}),
    "snapshot bad user": _frame(
        p.SNAPSHOT, {"version": 1, "default_rate": None, "tiers": {}, "users": {"u": [None, 0]}}
    ),
    "usage negative": _frame(
        p.USAGE, {"engine_id": "e", "interval_s": 1.0, "granted": {"u": -1}, "throttled": {}}
    ),
    "usage negative would-throttle": _frame(
        p.USAGE,
        {
            "engine_id": "e",
            "interval_s": 1.0,
            "granted": {},
            "throttled": {},
            "would_throttle": {"u": -1},
        },
    ),
    **{
        f"hello vllm version {name}": _frame(
            p.HELLO, {"engine_id": "e", "model": "m", "version": 0, "vllm_version": version}
        )
        for name, version in [
            ("too long", "1" * (ids.MAX_VLLM_VERSION_LEN + 1)),
            ("with a space", "0.32.0 cpu"),
            ("with a newline", "0.32.0\n"),
            ("with a slash", "0.32.0/../x"),
            ("not a string", 32),
        ]
    },
    "bad enforcement": _frame(
        p.DELTA, {"version": 2, "ops": [{"op": "set_default", "enforcement": "dry"}]}
    ),
    **{
        f"ceiling {name}": _frame(p.DELTA, {"version": 2, "ops": [op]})
        for name, op in [
            ("zero", {"op": "set_default", "ceiling": 0}),
            ("huge", {"op": "set_tier", "name": "t", "ceiling": 10**7}),
            ("fractional", {"op": "set_user", "user": "u", "ceiling": 1.5}),
            ("a string", {"op": "set_user", "user": "u", "ceiling": "5"}),
        ]
    },
    "snapshot user ceiling zero": _frame(
        p.SNAPSHOT,
        {"version": 1, "default_rate": 5, "tiers": {}, "users": {}, "user_ceilings": {"u": 0}},
    ),
    "snapshot tier ceiling null": _frame(
        p.SNAPSHOT,
        {"version": 1, "default_rate": 5, "tiers": {}, "users": {}, "tier_ceilings": {"t": None}},
    ),
    "usage zero interval": _frame(
        p.USAGE, {"engine_id": "e", "interval_s": 0.0, "granted": {}, "throttled": {}}
    ),
    **{
        f"usage {name} parts": _frame(
            p.USAGE,
            {
                "engine_id": "e",
                "interval_s": 1.0,
                "granted": {"u": 1},
                "throttled": {},
                "part": part,
                "num_parts": num_parts,
            },
        )
        for name, part, num_parts in [
            ("part past the last", 3, 3),
            ("negative", -1, 2),
            ("no", 0, 0),
            ("too many", 0, p.MAX_USAGE_PARTS + 1),
        ]
    },
}


# Before: only interval_s > 0 was checked, so 1e-300 s made 1e300 tokens/s (and a
# float overflow +Inf) in /usage and /metrics.
@pytest.mark.parametrize(
    "interval_s",
    [1e-300, 5e-324, 0.0009, -1.0, float("nan"), float("inf"), float("-inf"), 3600.001, 1e308],
)
def test_usage_intervals_outside_the_bounds_are_refused(interval_s: float) -> None:
    frame = _frame(
        p.USAGE, {"engine_id": "e", "interval_s": interval_s, "granted": {"u": 1}, "throttled": {}}
    )
    with pytest.raises(p.ProtocolError, match="interval_s"):
        p.decode(frame)


def test_usage_intervals_at_the_bounds_are_taken() -> None:
    for interval_s in (p.MIN_USAGE_INTERVAL_S, p.MAX_USAGE_INTERVAL_S):
        report = p.Usage("e", interval_s, {"u": 1}, {})
        assert p.decode(p.encode(report)) == report


@pytest.mark.parametrize("frame", BAD_FRAMES.values(), ids=list(BAD_FRAMES))
def test_malformed_frames_are_refused(frame: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


def test_a_bad_op_refuses_the_whole_delta() -> None:
    frame = _frame(
        p.DELTA,
        {
            "version": 2,
            "ops": [{"op": "set_default", "rate": 5}, {"op": "set_default", "rate": -5}],
        },
    )
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


def test_oversized_frames_are_refused_before_decoding() -> None:
    frame = p.encode(p.Usage("e", 5.0, {f"u{i}": i for i in range(2000)}, {}))
    assert p.decode(frame).engine_id == "e"  # type: ignore[union-attr]
    with pytest.raises(p.ProtocolError, match="size"):
        p.decode(frame, max_bytes=len(frame) - 1)


def test_usage_naming_too_many_users_is_refused() -> None:
    many = {f"u{i}": 1 for i in range(p.MAX_USAGE_USERS + 1)}
    with pytest.raises(p.ProtocolError, match="too many"):
        p.decode(p.encode(p.Usage("e", 1.0, many, dict(many))))


def test_usage_would_throttle_is_bounded_like_throttled() -> None:
    many = {f"u{i}": 1 for i in range(p.MAX_USAGE_USERS + 1)}
    with pytest.raises(p.ProtocolError, match="too many"):
        p.decode(p.encode(p.Usage("e", 1.0, {}, {}, would_throttle=many)))
    over = {"u": int(p.MAX_ENGINE_STEPS_PER_S * 2.0) + 2}
    with pytest.raises(p.ProtocolError, match="would refuse more steps"):
        p.decode(p.encode(p.Usage("e", 2.0, {}, {}, would_throttle=over)))
    at = {"u": int(p.MAX_ENGINE_STEPS_PER_S * 2.0)}
    assert p.decode(p.encode(p.Usage("e", 2.0, {}, {}, would_throttle=at))).would_throttle == at  # type: ignore[union-attr]


def test_usage_borrowed_is_bounded_like_granted() -> None:
    at = {"u": int(p.MAX_ENGINE_TOKENS_PER_S * 2.0)}
    report = p.decode(p.encode(p.Usage("e", 2.0, dict(at), {}, borrowed=at)))
    assert isinstance(report, p.Usage) and report.borrowed_counts == at
    over = {"u": int(p.MAX_ENGINE_TOKENS_PER_S * 2.0) + 2}
    with pytest.raises(p.ProtocolError, match="lends more tokens"):
        p.decode(p.encode(p.Usage("e", 2.0, {}, {}, borrowed=over)))
    many = {f"u{i}": 1 for i in range(p.MAX_USAGE_USERS + 1)}
    with pytest.raises(p.ProtocolError, match="too many"):
        p.decode(p.encode(p.Usage("e", 100.0, {}, {}, borrowed=many)))


class _UsageBeforeBorrowing(msgspec.Struct, frozen=True):
    """p.Usage as peers built before borrowed tokens were reported."""

    engine_id: str
    interval_s: float
    granted: dict[str, int]
    throttled: dict[str, int]
    part: int = 0
    num_parts: int = 1
    would_throttle: dict[str, int] = {}


def test_usage_with_nothing_borrowed_is_the_frame_it_was_and_old_frames_decode() -> None:
    old = _UsageBeforeBorrowing("e", 1.5, {"a": 30, "b": 2}, {"b": 1}, would_throttle={"a": 4})
    new = p.Usage("e", 1.5, {"a": 30, "b": 2}, {"b": 1}, would_throttle={"a": 4})
    # Not borrowing, or an empty map: the bytes of an engine from before the field.
    assert p.encode(new)[1:] == msgspec.msgpack.encode(old)
    assert p.encode(p.Usage("e", 1.5, {"a": 30, "b": 2}, {"b": 1}, 0, 1, {"a": 4}, {})) == (
        p.encode(new)
    )
    # An old engine's frame decodes as nothing borrowed.
    decoded = p.decode(_frame(p.USAGE, old))
    assert decoded == new
    assert isinstance(decoded, p.Usage) and decoded.borrowed_counts == {}
    # A control plane from before the field reads a new engine's frame, less the field.
    lent = p.Usage("e", 1.5, {"a": 30}, {}, borrowed={"a": 10})
    assert msgspec.msgpack.decode(p.encode(lent)[1:], type=_UsageBeforeBorrowing) == (
        _UsageBeforeBorrowing("e", 1.5, {"a": 30}, {})
    )
    assert p.decode(p.encode(lent)) == lent


def test_peers_without_enforcement_decode_as_inherit_and_empty() -> None:
    """Frames of peers that predate shadow limits (no enforcement, no would_throttle)."""
    usage = p.decode(
        _frame(p.USAGE, {"engine_id": "e", "interval_s": 1.0, "granted": {"u": 1}, "throttled": {}})
    )
    assert usage == p.Usage("e", 1.0, {"u": 1}, {}, would_throttle={})
    snapshot = p.decode(
        _frame(p.SNAPSHOT, {"version": 1, "default_rate": 5, "tiers": {"t": 3}, "users": {}})
    )
    assert isinstance(snapshot, p.Snapshot)
    assert (snapshot.default_enforcement, snapshot.tier_enforcements) == (None, {})


def test_peers_without_ceilings_decode_as_no_borrowing() -> None:
    """Frames of a control plane that predates ceilings: nothing is borrowed."""
    snapshot = p.decode(
        _frame(
            p.SNAPSHOT,
            {
                "version": 1,
                "default_rate": 5,
                "tiers": {"t": 3},
                "users": {"u": ["t", 2]},
                "default_enforcement": "shadow",
            },
        )
    )
    assert isinstance(snapshot, p.Snapshot)
    assert (snapshot.default_ceiling, snapshot.tier_ceilings, snapshot.user_ceilings) == (
        None,
        {},
        {},
    )
    assert snapshot.user_policies() == {"u": ("t", Policy(2))}
    delta = p.decode(
        _frame(
            p.DELTA,
            {
                "version": 2,
                "ops": [
                    {"op": "set_user", "user": "u", "tier": None, "rate": 5, "scope": "engine"},
                    {"op": "set_tier", "name": "t", "rate": 3, "enforcement": "shadow"},
                    {"op": "set_default", "rate": 4},
                ],
            },
        )
    )
    assert isinstance(delta, p.Delta)
    assert [op.policy for op in delta.ops] == [  # type: ignore[union-attr]
        Policy(5, "engine"),
        Policy(3, None, "shadow"),
        Policy(4),
    ]


def test_an_engine_that_predates_ceilings_reads_new_frames() -> None:
    """An older engine's structs (no ceiling fields) decode what a new control plane
    sends: the unknown fields are skipped, so it enforces the rates and borrows nothing."""

    class OldSetUser(msgspec.Struct, frozen=True, tag_field="op", tag="set_user"):
        user: str
        tier: str | None = None
        rate: int | None = None
        scope: str | None = None
        enforcement: str | None = None

    class OldSnapshot(msgspec.Struct, frozen=True):
        version: int
        default_rate: int | None
        tiers: dict[str, int | None]
        users: dict[str, tuple[str | None, int | None]]
        default_enforcement: str | None = None

    op = msgspec.msgpack.encode(p.SetUser("u", None, 5, "engine", None, 9))
    assert msgspec.msgpack.decode(op, type=OldSetUser) == OldSetUser("u", None, 5, "engine")
    frame = p.encode(
        p.Snapshot.of(3, Policy(5, None, "shadow", 8), {}, {"u": (None, Policy(6, None, None, 7))})
    )
    assert msgspec.msgpack.decode(frame[1:], type=OldSnapshot) == OldSnapshot(
        3, 5, {}, {"u": (None, 6)}, "shadow"
    )


def test_bad_rows_in_the_change_log_are_refused() -> None:
    with pytest.raises(p.ProtocolError):
        p.ops_from_rows([{"op": "set_default", "rate": 0}])


def test_a_large_snapshot_fits() -> None:
    users = {
        f"user-{i:07d}": ("free" if i % 2 else None, None if i % 2 else i % 1000 + 1)
        for i in range(100_000)
    }
    snap = p.Snapshot(1, 10, {"free": 20}, users)
    frame = p.encode(snap)
    assert len(frame) < p.MAX_MESSAGE_BYTES
    assert p.decode(frame) == snap


def test_a_hello_of_an_engine_that_predates_vllm_versions_decodes_as_unknown() -> None:
    old_hello = _frame(p.HELLO, {"engine_id": "e1", "model": "m", "version": 3, "role": "api"})
    assert p.decode(old_hello) == p.Hello("e1", "m", 3, p.API_ROLE, vllm_version="")


def test_a_control_plane_that_predates_vllm_versions_reads_a_new_hello() -> None:
    class OldHello(msgspec.Struct, frozen=True):
        engine_id: str
        model: str
        version: int
        role: str = "engine"

    frame = p.encode(p.Hello("e1", "m", 3, vllm_version="0.34.0"))
    assert msgspec.msgpack.decode(frame[1:], type=OldHello) == OldHello("e1", "m", 3)


def test_heartbeat_and_resync_name_their_role_and_default_to_the_engine() -> None:
    # A peer that predates roles (no "role" key) is an engine core.
    old_beat = _frame(p.HEARTBEAT, {"version": 3, "engine_id": "e1", "model": "m"})
    old_resync = _frame(p.RESYNC, {"engine_id": "e1", "version": 3})
    assert p.decode(old_beat) == p.Heartbeat(3, "e1", "m", role=p.ENGINE_ROLE)
    assert p.decode(old_resync) == p.Resync("e1", 3, role=p.ENGINE_ROLE)
    for kind, payload in (
        (p.HEARTBEAT, {"version": 3, "engine_id": "e1", "role": "admin"}),
        (p.RESYNC, {"engine_id": "e1", "version": 3, "role": ""}),
    ):
        with pytest.raises(p.ProtocolError):
            p.decode(_frame(kind, payload))


def test_a_shares_frame_of_a_control_plane_before_outage_policies_decodes_as_serving() -> None:
    # What an older control plane sends: no policy, no serving counts. The engine then does
    # what it did before: the safe share of the whole fleet at lease end.
    old = {"epoch": 3, "seq": 1, "lease_ms": 5000, "num_engines": 2, "full": True}
    message = p.decode(_frame(p.SHARES, {**old, "shares": {"a": 20_000}}))
    assert isinstance(message, p.Shares)
    assert (message.outage, message.serving) == ("serving", {})
    assert message.outage_policy == OutagePolicy()


def test_an_older_engine_reads_a_shares_frame_with_a_policy_and_counts() -> None:
    class OldShares(msgspec.Struct, frozen=True):
        epoch: int
        seq: int
        lease_ms: int
        num_engines: int
        full: bool
        shares: dict[str, int]

    new = p.Shares(3, 1, 5000, 2, True, {"a": 20_000}, "keep", 30_000, serving={"a": 2})
    assert p.decode(p.encode(new)) == new
    old = msgspec.msgpack.decode(p.encode(new)[1:], type=OldShares)
    assert old == OldShares(3, 1, 5000, 2, True, {"a": 20_000})
    # A renewal under the default policy costs the bytes it did before the policy.
    renewal = p.encode(p.Shares(3, 2, 5000, 2, False, {}))
    assert renewal[1:] == msgspec.msgpack.encode(OldShares(3, 2, 5000, 2, False, {}))


@pytest.mark.parametrize(
    "fields",
    [
        {"outage": "drop"},
        {"outage": "keep"},  # no keep time
        {"outage": "fraction"},  # no fraction
        {"outage": "fraction", "outage_fraction": 1.5},
        {"outage": "serving", "outage_keep_ms": 5000},
        {"outage_keep_ms": -1},
        {"serving": {"a": 0}},
    ],
)
def test_a_shares_frame_with_a_bad_policy_or_count_is_refused(fields: dict[str, object]) -> None:
    base = {"epoch": 3, "seq": 1, "lease_ms": 5000, "num_engines": 2, "full": True, "shares": {}}
    with pytest.raises(p.ProtocolError, match="Shares"):
        p.decode(_frame(p.SHARES, {**base, **fields}))
