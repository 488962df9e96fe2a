"""RequestFates: demoted and failed requests until released; demotions reported once."""

from __future__ import annotations

from vllm_retro.vllm.request_fates import RequestFates


def test_demoted_requests_are_dense_and_reported_once() -> None:
    fates = RequestFates()
    fates.demote("a")
    assert fates.is_dense("a") and not fates.has_failed("a") and not fates.is_dense("b")
    assert fates.take_demoted() == {"a"} and fates.take_demoted() == set()
    assert fates.is_dense("a")  # reported, still dense until released
    fates.release("a")
    assert not fates.is_dense("a")


def test_a_request_fails_once_and_is_forgotten_on_release() -> None:
    fates = RequestFates()
    assert fates.fail("a", "its index broke") and not fates.fail("a", "again")
    assert fates.has_failed("a") and fates.is_dense("a") and fates.failed() == {"a"}
    assert fates.take_demoted() == set()  # failed is not demoted
    fates.failed().add("b")  # a copy
    assert fates.failed() == {"a"}
    fates.release("a")
    assert not fates.has_failed("a") and fates.failed() == set()
