import dataclasses

import pytest

from generation_service.engine.events import OutputEvent, TokenLogprob


def test_a_token_event_built_fast_is_an_ordinary_frozen_event():
    logprobs = (TokenLogprob(7, -0.5, ((7, -0.5), (9, -1.5))),)
    fast, plain = OutputEvent.of_tokens((7,), "a", logprobs), OutputEvent((7,), "a", logprobs)
    assert fast == plain and repr(fast) == repr(plain) and hash(fast) == hash(plain)
    assert dataclasses.asdict(fast) == dataclasses.asdict(plain)
    assert not fast.is_final and fast.guarantee is None and fast.usage is None and fast.error is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.text = "b"
