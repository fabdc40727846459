"""The version gate and the patch table (engine_ext/vllm_compat.py)."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from engine_ext import vllm_compat
from engine_ext.plugin import register
from engine_ext.scheduler import OutputRateMixin
from engine_ext.vllm_compat import (
    ALLOW_UNSUPPORTED_ENV,
    BEAM_SEARCH_PATCHES,
    PATCHED_MARK,
    PATCHES,
    Patch,
    UnsupportedVllmError,
)
from harness.scheduler import make_scheduler
from tests.engine_ext.test_plugin import parse


class Target:
    """A stand-in owner for patches that need no vLLM."""

    def greet(self) -> str:
        return "hello"


NUM_WRAPS = {"count": 0}


def shout(original):
    NUM_WRAPS["count"] += 1

    def greet(self) -> str:
        return original(self).upper()

    return greet


TARGET = f"{__name__}:Target"


@pytest.fixture
def other_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: "0.33.1")
    monkeypatch.delenv(ALLOW_UNSUPPORTED_ENV, raising=False)


def test_the_installed_vllm_is_a_supported_one_and_its_own_row_is_used() -> None:
    import vllm

    assert vllm_compat.is_supported_vllm()
    vllm_compat.check_vllm_version()
    assert vllm_compat.release().version == vllm.__version__.split("+")[0]


def test_the_release_row_is_cheap_to_ask_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_compat.release()

    def read_metadata(name: str) -> str:
        raise AssertionError("metadata read again")

    monkeypatch.setattr(importlib.metadata, "version", read_metadata)
    assert vllm_compat.release() is vllm_compat.release()


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0", "0.32.0+cpu"])
def test_exactly_the_three_releases_are_accepted(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: version)
    monkeypatch.delenv(ALLOW_UNSUPPORTED_ENV, raising=False)
    vllm_compat.check_vllm_version()
    assert vllm_compat.release().version == version.split("+")[0]


def test_another_vllm_is_refused_with_the_supported_versions_named(other_vllm: None) -> None:
    with pytest.raises(UnsupportedVllmError) as refused:
        vllm_compat.check_vllm_version()
    message = str(refused.value)
    assert "0.32.0, 0.33.0 and 0.34.0" in message
    assert "0.33.1" in message and ALLOW_UNSUPPORTED_ENV in message


@pytest.mark.parametrize(
    ("version", "row"),
    [("0.33.1", "0.33.0"), ("0.35.0rc1", "0.34.0"), ("0.31.0", "0.32.0"), (None, "0.32.0")],
)
def test_another_version_uses_the_newest_row_not_newer_than_it(
    version: str | None, row: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: version)
    assert vllm_compat.release().version == row


def test_a_limited_server_refuses_to_start_on_another_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Parsed on the installed vLLM (the parser's module is the installed release's).
    limited, plain = parse("--default-user-output-tokens-per-second", "5"), parse()
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: "0.33.1")
    monkeypatch.delenv(ALLOW_UNSUPPORTED_ENV, raising=False)
    with pytest.raises(UnsupportedVllmError, match=r"0\.32\.0, 0\.33\.0 and 0\.34\.0"):
        AsyncEngineArgs.from_cli_args(limited).create_engine_config()
    # without limit flags the plugin stays out of the way
    AsyncEngineArgs.from_cli_args(plain).create_engine_config()


def test_the_override_runs_anyway_but_says_so(
    other_vllm: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ALLOW_UNSUPPORTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="vllm.output_rate"):
        vllm_compat.check_vllm_version()
    assert any("UNSUPPORTED vLLM" in r.getMessage() for r in caplog.records)


def test_a_patch_is_applied_once_however_often_it_is_asked(monkeypatch) -> None:
    monkeypatch.setattr(Target, "greet", Target.greet)  # restored afterwards
    patch = Patch(TARGET, "greet", f"{__name__}:shout")
    before = NUM_WRAPS["count"]
    assert vllm_compat.apply_patches([patch]) == ["Target.greet"]
    assert vllm_compat.apply_patches([patch]) == []
    assert vllm_compat.apply_patches([patch]) == []
    assert NUM_WRAPS["count"] == before + 1
    assert Target().greet() == "HELLO"


def test_on_another_vllm_only_version_independent_patches_apply(
    other_vllm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Target, "greet", Target.greet)
    internal = Patch(TARGET, "greet", f"{__name__}:shout")
    assert vllm_compat.apply_patches([internal]) == []
    assert Target().greet() == "hello"
    public = Patch(TARGET, "greet", f"{__name__}:shout", any_version=True)
    assert vllm_compat.apply_patches([public]) == ["Target.greet"]


def test_a_missing_optional_target_warns_and_a_required_one_fails(caplog) -> None:
    optional = Patch(TARGET, "no_such_method", f"{__name__}:shout", optional=True)
    with caplog.at_level(logging.WARNING, logger="vllm.output_rate"):
        assert vllm_compat.apply_patches([optional]) == []
    assert any("not found" in r.getMessage() for r in caplog.records)
    with pytest.raises(AttributeError):
        vllm_compat.apply_patches([Patch(TARGET, "no_such_method", f"{__name__}:shout")])


def test_every_vllm_patch_is_in_place_exactly_once_after_repeated_registration() -> None:
    register()
    register()
    register()
    vllm_compat.apply_patches(BEAM_SEARCH_PATCHES)
    vllm_compat.apply_patches(BEAM_SEARCH_PATCHES)
    assert vllm_compat.apply_patches(PATCHES + BEAM_SEARCH_PATCHES) == []
    for patch in PATCHES + BEAM_SEARCH_PATCHES:
        installed = getattr(vllm_compat._resolve(patch.owner), patch.attribute)
        installed = getattr(installed, "__func__", installed)
        assert getattr(installed, PATCHED_MARK, False), patch.name
        # Wrapped once: what it wraps is vLLM's own function.
        assert not getattr(installed.__wrapped__, PATCHED_MARK, False), patch.name


def test_a_patch_whose_replacement_needs_a_missing_attribute_is_refused_by_name(caplog) -> None:
    needs = Patch(TARGET, "greet", f"{__name__}:shout", requires=("greet", "no_such_helper"))
    with pytest.raises(UnsupportedVllmError, match="no_such_helper"):
        needs.apply()
    assert Target().greet() == "hello"  # nothing was patched
    optional = Patch(TARGET, "greet", f"{__name__}:shout", requires=("gone",), optional=True)
    with caplog.at_level(logging.WARNING, logger="vllm.output_rate"):
        assert optional.apply() is False
    assert "Target.greet not found" in caplog.text


def test_a_scheduler_without_an_attribute_the_adapter_relies_on_is_refused_by_name() -> None:
    scheduler = make_scheduler(user_rates={"a": 10})  # the real one has every attribute
    del scheduler.finished_req_ids
    with pytest.raises(UnsupportedVllmError, match="finished_req_ids"):
        vllm_compat.require_attributes(scheduler, vllm_compat.SCHEDULER_ATTRIBUTES, "Scheduler")


def test_every_upstream_attribute_the_adapter_declares_is_in_the_checked_list() -> None:
    # The mixin's annotations name what it reads on upstream's scheduler (for mypy);
    # the compat layer's list is what is checked at startup: one must cover the other.
    assert set(OutputRateMixin.__annotations__) <= set(vllm_compat.SCHEDULER_ATTRIBUTES)
