"""The inheritance rule (LimitModel.resolve): each field the user's own value, else its
tier's, else the default's, else the built-in one."""

from __future__ import annotations

from output_rate_core.limits import DEFAULT, OVERRIDE, TIER, LimitModel
from output_rate_core.policy import NO_POLICY, Policy


def rate_of(own: int | None, tier: str | None, tier_rate: int | None, default: int | None):
    model = LimitModel(Policy(default), {} if tier is None else {tier: Policy(tier_rate)})
    effective = model.resolve(tier, Policy(own))
    return effective.rate, effective.source


def test_override_then_tier_then_default() -> None:
    assert rate_of(7, "pro", 100, 20) == (7, OVERRIDE)
    assert rate_of(None, "pro", 100, 20) == (100, TIER)
    assert rate_of(None, "pro", None, 20) == (None, TIER)  # an unlimited tier
    assert rate_of(None, None, None, 20) == (20, DEFAULT)
    assert rate_of(None, None, None, None) == (None, DEFAULT)


def test_a_tier_missing_from_the_model_is_an_unlimited_tier_that_sets_nothing() -> None:
    model = LimitModel(Policy(20, "engine", "shadow"))
    effective = model.resolve("gone", NO_POLICY)
    assert (effective.rate, effective.source) == (None, TIER)
    assert (effective.scope, effective.enforcement) == ("engine", "shadow")


def test_scope_and_enforcement_inherit_own_then_tier_then_default_then_built_in() -> None:
    model = LimitModel(
        Policy(scope="engine", enforcement="shadow"),
        {"pro": Policy(100, "fleet", "enforce"), "plain": Policy(100)},
    )
    own = Policy(scope="engine", enforcement="shadow")
    assert model.resolve("pro", own).scope == "engine"  # its own
    assert model.resolve("pro", own).enforcement == "shadow"
    assert model.resolve("pro", NO_POLICY).scope == "fleet"  # its tier's
    assert model.resolve("pro", NO_POLICY).enforcement == "enforce"
    assert model.resolve("plain", NO_POLICY).scope == "engine"  # the tier sets none
    assert model.resolve("plain", NO_POLICY).enforcement == "shadow"
    assert model.resolve(None, NO_POLICY).scope == "engine"  # the default's
    built_in = LimitModel().resolve(None, NO_POLICY)
    assert (built_in.rate, built_in.scope, built_in.enforcement) == (None, "fleet", "enforce")
    assert LimitModel().unconfigured == built_in


def test_effective_resolves_the_users_record() -> None:
    model = LimitModel(
        Policy(20), {"pro": Policy(100, "engine")}, {"a": ("pro", Policy(enforcement="shadow"))}
    )
    assert model.effective("a") == model.resolve("pro", Policy(enforcement="shadow"))
    assert model.effective("nobody") == model.unconfigured
    assert model.members == {"pro": {"a"}}


def test_the_ceiling_inherits_like_the_rate_and_borrows_nothing_at_or_below_it() -> None:
    model = LimitModel(
        Policy(20, ceiling=100), {"pro": Policy(50, ceiling=300), "flat": Policy(50)}
    )
    assert model.resolve(None, NO_POLICY).ceiling == 100  # the default's
    assert model.resolve("pro", NO_POLICY).ceiling == 300  # its tier's
    assert model.resolve("pro", Policy(ceiling=400)).ceiling == 400  # its own
    assert model.resolve("flat", NO_POLICY).ceiling == 100  # the tier sets none
    # An override above the inherited ceiling: nothing left to borrow.
    assert model.resolve(None, Policy(150)).ceiling is None
    assert model.resolve(None, Policy(100)).ceiling is None
    # Unlimited users borrow nothing either.
    assert LimitModel(Policy(None, ceiling=100)).resolve(None, NO_POLICY).ceiling is None
    # No ceiling anywhere: the rate is a hard limit.
    assert LimitModel(Policy(20)).resolve(None, NO_POLICY).ceiling is None
