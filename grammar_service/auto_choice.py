"""`auto`'s choice of backend for one grammar: rank the backends on the schema, no compile.

The rule (docs/guarantees.md, "`auto`: one rule, and its price"): the backend that enforces
more of the schema, then the one that compiles faster. What each backend enforces comes from
its analysis (grammar_service/guarantees.py for llguidance, backends/xgrammar_unenforced.py for
xgrammar); backend_choice.py applies the choice, time-boxing a slow pick that a fast fallback
can replace.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from grammar_contract.report import UnenforcedKeyword
from grammar_service.guarantees import llguidance_report

# `auto`: the backend that enforces more of the schema, then the one that compiles faster.
# Listed fastest compile first, measured over 35 real schemas on 2 cores: llguidance median
# 23 ms / max 147 ms at 32k, xgrammar 587 ms / 26 s. The price on a tie: llguidance's mask fills
# are slower (p50 71 us against xgrammar's 37 us per token at 32k), paid every step;
# docs/guarantees.md.
AUTO_CANDIDATES = ("llguidance", "xgrammar")


@dataclass(frozen=True)
class AutoChoice:
    """`auto`'s pick for one grammar; `fallbacks` are tried in order if its compile fails.
    `fast_fallback`: a fallback known to compile the schema that compiles faster than the pick
    ("" for none), so the pick's compile may be time-boxed (grammar_service/backend_choice.py)."""

    backend: str
    unenforced: tuple[UnenforcedKeyword, ...]
    reason: str
    fallbacks: tuple[str, ...] = ()
    fast_fallback: str = ""


@dataclass(frozen=True)
class Candidate:
    backend: str
    unenforced: tuple[UnenforcedKeyword, ...]
    error: str = ""          # known up front not to compile (llguidance says so in ms)
    speed_rank: int = 0      # 0 = compiles in ms; higher = slower (xgrammar: seconds on big schemas)


_SAME_GAP = {"then": "if", "else": "if", "maxProperties": "minProperties", "maxLength": "minLength",
             "minContains": "contains", "maxContains": "contains"}


def num_gaps(unenforced: tuple[UnenforcedKeyword, ...]) -> int:
    """Distinct (pointer, keyword) gaps; if/then/else and min/max pairs count once, so that
    analyses that list them differently compare fairly."""
    return len({(u.pointer, _SAME_GAP.get(u.keyword, u.keyword)) for u in unenforced})


def rank(candidates: list[Candidate]) -> AutoChoice:
    """The candidate that compiles, then enforces the most, then compiles fastest."""
    usable = [c for c in candidates if not c.error]
    if not usable:
        first = min(candidates, key=lambda c: c.speed_rank)
        return AutoChoice(first.backend, first.unenforced, "auto: no backend compiles this schema" + "".join(
            f"; {c.backend}: {c.error}" for c in candidates), ())
    ordered = sorted(usable, key=lambda c: (num_gaps(c.unenforced), c.speed_rank))
    best, rest = ordered[0], ordered[1:]
    if len(ordered) == 1:
        why = "the only backend that compiles this schema" + "".join(
            f"; {c.backend}: {c.error}" for c in candidates if c.error)
    elif num_gaps(best.unenforced) < num_gaps(rest[0].unenforced):
        why = (f"enforces more of the schema ({num_gaps(best.unenforced)} gap(s), "
               f"{rest[0].backend}: {num_gaps(rest[0].unenforced)})")
    else:
        why = f"enforces as much as {rest[0].backend} ({num_gaps(best.unenforced)} gap(s)) and compiles faster"
    faster = [c.backend for c in rest if c.speed_rank < best.speed_rank]
    if faster:
        why += f"; {faster[0]} serves if its compile runs past the time box"
    return AutoChoice(best.backend, best.unenforced, f"auto chose {best.backend}: {why}",
                      tuple(c.backend for c in rest), faster[0] if faster else "")


def choose_backend(spec, backend_for: Callable[[str], object], default: str = "xgrammar") -> AutoChoice:
    """`auto` for one GrammarSpec: rank the backends on this schema (no compile needed).

    Non-JSON-Schema kinds go to `default`. `backend_for(name)` returns a GrammarBackend; a
    backend that is not installed (ValueError / ImportError) is left out.
    """
    if spec.kind != "json_schema":
        return AutoChoice(default, (), f"auto chose {default}: default backend for {spec.kind}",
                          tuple(b for b in AUTO_CANDIDATES if b != default))
    candidates = []
    for speed_rank, name in enumerate(AUTO_CANDIDATES):
        try:
            backend = backend_for(name)
        except (ValueError, ImportError):
            continue
        if name == "llguidance":
            from grammar_service.backends.llguidance import json_options, unsupported
            from grammar_service.schema_drafts import as_drafted

            error, unenforced = unsupported(spec), ()
            if not error:
                error, unenforced = llguidance_report(as_drafted(spec.text), json_options(spec))
            candidates.append(Candidate(name, unenforced, error, speed_rank))
        else:
            candidates.append(Candidate(name, tuple(backend.unenforced_keywords(spec)), "", speed_rank))
    if not candidates:
        raise ValueError("no grammar backend is installed")
    return rank(candidates)
