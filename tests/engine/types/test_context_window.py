"""The context's arithmetic: the engine's fit check, the prompt's budget beside a reply and the
reply's room after a prompt, which the engine, the endpoint and the FIM routes all use."""

from __future__ import annotations

import pytest

from app.engine.types.context_window import check_fits, prompt_budget, reply_room
from app.engine.types.errors import RequestError


def test_prompt_budget_leaves_max_tokens_or_one_token() -> None:
    assert prompt_budget(256, 8) == 248
    assert prompt_budget(256, None) == 255


def test_reply_room_cuts_max_tokens_to_what_the_context_leaves() -> None:
    assert reply_room(256, 250, 20) == 6
    assert reply_room(256, 10, 20) == 20
    assert reply_room(256, 300, 20) == 20  # the prompt alone is over: the engine's check says so
    assert reply_room(0, 10, 20) == 20  # an unknown context cuts nothing
    assert reply_room(256, 10, None) is None


def test_check_fits_gives_max_tokens_or_all_that_is_left() -> None:
    assert check_fits(10, 20, 256, 1024) == 20
    assert check_fits(10, None, 256, 1024) == 246
    assert check_fits(10, None, 256, 100) == 90  # a pool smaller than the context


@pytest.mark.parametrize(("num_prompt", "max_tokens", "pool", "param", "words"), [
    (256, None, 1024, "prompt", "the context holds 256"),
    (100, None, 100, "prompt", "the KV pool holds 100"),
    (250, 20, 1024, "max_tokens", "= 270 exceeds the context length 256"),
    (50, 100, 128, "max_tokens", "can never fit the KV pool of 128 tokens"),
])
def test_check_fits_names_what_does_not_fit(num_prompt: int, max_tokens: int | None, pool: int, param: str,
                                            words: str) -> None:
    with pytest.raises(RequestError, match=words) as info:
        check_fits(num_prompt, max_tokens, 256, pool)
    assert info.value.param == param
