"""What a caller asks of the engine: sampling, stop conditions, constraint, speculation.

Frozen dataclasses validated in __post_init__; the gRPC servicer builds them from the proto
and maps `ValueError` to INVALID_ARGUMENT with the message unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from grammar_contract.spec import GrammarSpec


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    seed: int | None = None           # same seed + same request = same output, whatever the batch
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # never streamed past; the match itself is not returned
    ignore_eos: bool = False
    num_logprobs: int = 0             # top-n logprobs per generated token, 0 = none
    # logits processing (engine/logit_processing.py), OpenAI / vLLM semantics; neutral by default
    frequency_penalty: float = 0.0    # minus penalty x times the token was generated
    presence_penalty: float = 0.0     # minus penalty once the token was generated
    repetition_penalty: float = 1.0   # tokens of prompt or output: positive logits / p, negative x p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids unique
    min_p: float = 0.0                # drop tokens below min_p x the top token's probability
    min_tokens: int = 0               # EOS, stop_token_ids and stop_strings held back until reached

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.num_logprobs <= 20:
            raise ValueError(f"num_logprobs must be in [0, 20], got {self.num_logprobs}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10] (1 = off), got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        self._check_logit_bias()
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], "
                             f"got {self.min_tokens}")

    def _check_logit_bias(self) -> None:
        token_ids = [token for token, _ in self.logit_bias]
        if len(set(token_ids)) != len(token_ids):
            raise ValueError("logit_bias names a token id twice")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    # cached (frozen: the answers never change): the mixed steps' sampler asks every row every step
    @cached_property
    def uses_filters(self) -> bool:
        """top-k or top-p act (they never do when greedy)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def uses_penalties(self) -> bool:
        """Some penalty reads the token history (the prompt and the output so far)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @cached_property
    def is_plain_greedy(self) -> bool:
        """The token is the argmax of the raw logits: greedy, nothing processes them, no logprobs."""
        return self.is_greedy and not self.num_logprobs and not self.uses_logit_processing

    @cached_property
    def uses_logit_processing(self) -> bool:
        """Some step of engine/logit_processing.py changes this request's logits. min_p never
        changes a greedy pick, so it counts only when sampling."""
        return (self.uses_penalties or bool(self.logit_bias) or self.min_tokens > 0
                or (self.min_p > 0.0 and not self.is_greedy))


@dataclass(frozen=True)
class SpeculativeParams:
    num_draft_tokens: int = 0  # 0 = no speculation for this request
    proposer: str = "ngram"    # "ngram" (prompt lookup), "grammar" (tokens the grammar forces) or
                               # "self" (the model's calibrated draft layers, engine/self_drafts.py)

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    grammar: GrammarSpec | None = None
    speculative: SpeculativeParams = field(default_factory=SpeculativeParams)
    deadline: float | None = None         # time.monotonic() after which the request fails
    # False: special tokens stay in the streamed text (a tool-call format whose marker is one,
    # such as Mistral's [TOOL_CALLS], is parsed from the text)
    skip_special_tokens: bool = True
    trace_context: dict[str, str] | None = None  # W3C traceparent etc., for spans in the engine

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty: give prompt text, token ids or chat messages")

    @property
    def is_constrained(self) -> bool:
        return self.grammar is not None
