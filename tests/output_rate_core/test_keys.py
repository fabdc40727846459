"""API keys: format, hashing, and the table an engine's API server checks them against."""

from __future__ import annotations

import msgspec
import pytest

from output_rate_core import keys
from output_rate_core import protocol as p
from output_rate_core.key_table import KeyTable


def make_table(*users: str) -> tuple[KeyTable, list[tuple[str, str]]]:
    table, issued = KeyTable(), []
    for user in users:
        key_id, key = keys.new_key()
        table.apply(p.SetKey(key_id, user, keys.hash_key(key)))
        issued.append((key_id, key))
    return table, issued


def test_new_keys_are_unique_and_shaped_as_documented() -> None:
    made = [keys.new_key() for _ in range(200)]
    assert len({key for _, key in made}) == 200
    for key_id, key in made:
        assert keys.key_id_of(key) == key_id
        assert key.startswith(keys.display_prefix(key_id) + "_")
        assert len(key) <= keys.MAX_KEY_LEN
        # What travels and is stored passes the wire's own checks.
        msgspec.convert(
            {"op": "set_key", "id": key_id, "user": "u", "hash": keys.hash_key(key)}, p.Op
        )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "ork",
        "ork_",
        "ork_abcdefgh2345",
        "ork_abcdefgh2345_",
        "xyz_abcdefgh2345_s",
        "ork_ABCDEFGH2345_s",
        "ork_abcdefgh234_s",
        "ork_abcdefgh2340_s",
        "ork_" + "a" * 200,
    ],
)
def test_text_not_shaped_like_a_key_claims_no_id(text: str) -> None:
    assert keys.key_id_of(text) is None


def test_a_key_maps_to_its_user_and_nothing_else_does() -> None:
    table, [(id_a, key_a), (id_b, key_b)] = make_table("alice", "bob")
    assert table.user_of(key_a) == (id_a, "alice")
    assert table.user_of(key_b) == (id_b, "bob")
    # The right id with another secret, another key's secret, a truncated key.
    forged = key_a[:-4] + ("AAAA" if not key_a.endswith("AAAA") else "BBBB")
    assert table.user_of(forged) is None
    assert table.user_of(f"ork_{id_a}_{key_b.split('_', 2)[2]}") is None
    assert table.user_of(key_a[:-1]) is None
    assert table.user_of("Bearer " + key_a) is None


def test_a_deleted_key_is_refused_and_limit_ops_leave_keys_alone() -> None:
    table, [(key_id, key)] = make_table("alice")
    assert not table.apply(p.SetUser("alice", None, 5))
    assert table.user_of(key) == (key_id, "alice")
    assert table.apply(p.DeleteKey(key_id))
    assert table.user_of(key) is None
    assert table.apply(p.DeleteKey(key_id))  # revoking twice is harmless


def test_the_table_is_built_from_a_snapshot() -> None:
    key_id, key = keys.new_key()
    snapshot = p.Snapshot(1, None, {}, {}, keys={key_id: ("carol", keys.hash_key(key))})
    decoded = p.decode(p.encode(snapshot))
    assert isinstance(decoded, p.Snapshot)
    assert KeyTable.from_snapshot(decoded).user_of(key) == (key_id, "carol")


def test_the_comparison_is_constant_time_and_unknown_ids_compare_too(monkeypatch) -> None:
    compared: list[tuple[str, str]] = []
    real = keys.hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(keys.hmac, "compare_digest", spy)
    table, [(_, key)] = make_table("alice")
    _, other = keys.new_key()
    assert table.user_of(other) is None  # unknown id: still hashed and compared
    assert table.user_of(key) is not None
    assert len(compared) == 2


def test_key_ops_change_no_limit() -> None:
    from output_rate_core.limits import LimitModel
    from output_rate_core.policy import Policy

    model = LimitModel(Policy(5))
    assert model.apply(p.SetKey("abcdefgh2345", "a", "0" * 64)) == set()
    assert model.apply(p.DeleteKey("abcdefgh2345")) == set()
    assert model.default == Policy(5)
