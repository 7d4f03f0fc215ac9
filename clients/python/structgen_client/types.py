"""Typed results of the client (plain dataclasses; the proto stays an implementation detail)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class UnenforcedKeyword:
    keyword: str
    pointer: str
    reason: str = ""


@dataclass(frozen=True)
class Guarantee:
    """What a constraint guarantees; first chunk of a constrained stream."""
    backend: str
    unenforced: tuple[UnenforcedKeyword, ...] = ()
    compile_ms: float = 0.0
    cache_hit: bool = False
    # where the grammar refuses some valid forms (property order...); outputs still match
    restricted: tuple[UnenforcedKeyword, ...] = ()

    @property
    def is_fully_enforced(self) -> bool:
        return not self.unenforced


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    cached_prompt_tokens: int = 0   # of prompt_tokens, found in the server's prefix cache


@dataclass(frozen=True)
class Validation:
    """The output checked against the full JSON Schema; errors are (json pointer, message).

    `status`: "valid", "invalid", "not_run" (the server could not validate; `valid` is False),
    or "" from a server that predates the field."""
    valid: bool
    errors: tuple[tuple[str, str], ...] = ()
    status: str = ""
    num_errors: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Chunk:
    """One streamed message: the new tokens and text; the last one has `finish_reason`."""
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    guarantee: Guarantee | None = None
    finish_reason: str | None = None   # "stop_token", "stop_string", "max_tokens", "grammar_complete"
    usage: Usage | None = None
    validation: Validation | None = None
    request_id: str = ""

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Completion:
    """A whole completion, as `generate_text` returns it."""
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None = None
    guarantee: Guarantee | None = None
    validation: Validation | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    request_id: str = ""

    @classmethod
    def from_chunks(cls, chunks) -> "Completion":
        text, ids, logprobs = [], [], []
        last, guarantee = Chunk(), None
        for chunk in chunks:
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            guarantee = guarantee or chunk.guarantee
            last = chunk
        return cls("".join(text), tuple(ids), last.finish_reason, last.usage, guarantee,
                   last.validation, tuple(logprobs), last.request_id)


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str
    max_prompt_tokens: int
    max_new_tokens_limit: int
    default_max_tokens: int
    max_grammar_bytes: int
    max_message_bytes: int
    max_batch: int
    max_draft_tokens: int
    constraint_kinds: tuple[str, ...] = field(default=())
    prefix_caching: bool = False    # the server reuses KV pages of prompt prefixes it computed before


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_kv_pages_used: int
    num_slots_used: int
    num_grammar_matchers: int
    grammar_available: bool
    num_kv_pages_total: int = 0
    num_finished: int = 0
    num_tokens_generated: int = 0
    num_draft_tokens_proposed: int = 0
    num_draft_tokens_accepted: int = 0
    num_kv_pages_cached: int = 0    # kept by the prefix cache for reuse, held by no request

    @property
    def is_idle(self) -> bool:
        """No request holds anything: queue, slots, KV pages and grammar matchers all free
        (pages the prefix cache keeps for reuse are held by no request)."""
        return not (self.num_waiting or self.num_running or self.num_kv_pages_used
                    or self.num_slots_used or self.num_grammar_matchers)
