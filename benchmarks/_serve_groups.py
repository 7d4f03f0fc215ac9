"""What serve.py's workloads send beyond prompts: the constrained workloads' schema, the feature
requests' tools; and its workload groups beyond the closed loops: prefix caching on and off
(`--plan prefix`), ordinary requests beside tools and reasoning (`features`), grammar-forced
drafts at one user (`forced`), with their plans and the ratios each group reports."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from benchmarks._harness import log
from benchmarks._serve_load import BenchTool, Workload
from benchmarks._serve_summary import fmt_ratio, side_ratios


# Bounded fields: every document completes well inside 128 tokens of the Tekken vocabulary.
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
    "name": {"type": "string", "minLength": 3, "maxLength": 24},
    "status": {"enum": ["new", "open", "blocked", "done"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 6},
    "active": {"type": "boolean"}},
    "required": ["id", "name", "status", "tags", "scores", "active"], "additionalProperties": False}

# Tools of the feature requests: bounded arguments, so a call completes under any model.
TOOLS = (BenchTool("get_weather", "The current weather of a city.", json.dumps({
    "type": "object", "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})),
    BenchTool("create_ticket", "Open a ticket with these fields.", json.dumps(SCHEMA)))


@dataclass(frozen=True)
class PrefixPlan:
    """The prefix-caching workloads (serve.py's docstring, 2b.), each run with the cache on and off."""

    shared_len: int        # the shared system prompt
    tail_len: int          # each request's own part after it
    new_tokens: int
    concurrency: int
    turn_prompt_len: int   # multi-turn: the first turn's prompt
    turns: int
    unshared: tuple[int, int, int]  # (prompt, new tokens, concurrency) with no prefix shared


PREFIX_PLAN = PrefixPlan(2048, 64, 128, 16, 1024, 4, (512, 128, 16))


@dataclass(frozen=True)
class FeaturesPlan:
    """Ordinary requests alone and beside requests with tools and reasoning (serve.py's docstring, 2c.)."""

    prompt_len: int
    new_tokens: int            # of each ordinary request
    concurrency: int           # ordinary users
    feature_concurrency: int   # users of each feature workload
    feature_max_tokens: int    # of a feature request (the reasoning span's budget on top)
    reasoning_budget: int


FEATURES_PLAN = FeaturesPlan(512, 128, 16, 4, 192, 32)


# `--plan forced` (issue 26): one user at a time, documents the grammar mostly forces, greedy, without
# speculation and with each proposer (prompt tokens, drafts per step)
FORCED_PLAN = (64, 4)


def prefix_workloads(plan: PrefixPlan, prompts: dict, schema: str, common: dict, run, tag: str) -> dict[str, dict]:
    """The shared-prefix, multi-turn and unshared workloads on one server; summaries by kind."""
    shared = prompts[plan.shared_len][0]
    shared_prompts = [shared + tail for tail in prompts[plan.tail_len]]
    c, (unshared_len, unshared_new, unshared_c) = plan.concurrency, plan.unshared
    return {
        "shared_prefix": run(Workload(
            f"shared-prefix {plan.shared_len}+{plan.tail_len}/{plan.new_tokens} c={c} ({tag})",
            plan.shared_len + plan.tail_len, plan.new_tokens, concurrency=c, json_schema=schema, ignore_eos=False,
            unique_at=plan.shared_len, **common), shared_prompts),
        "multi_turn": run(Workload(
            f"multi-turn {plan.turn_prompt_len}+{plan.turns}x({plan.new_tokens}+{plan.tail_len}) c={c} ({tag})",
            plan.turn_prompt_len, plan.new_tokens, concurrency=c, turns=plan.turns, turn_tokens=plan.tail_len,
            **common), prompts[plan.turn_prompt_len]),
        "unshared": run(Workload(f"unshared {unshared_len}/{unshared_new} c={unshared_c} ({tag})", unshared_len,
                                 unshared_new, concurrency=unshared_c, **common), prompts[unshared_len]),
    }


def feature_workloads(plan: FeaturesPlan, prompts: list[list[int]], texts: list[str], schema: str, common: dict,
                      run_together, lengths: dict[str, list[int]]) -> dict[str, dict]:
    """The ordinary workload alone, beside the feature workloads, beside their plain counterparts,
    alone again; the ordinary requests' ratios."""
    c, fc = plan.concurrency, plan.feature_concurrency

    def ordinary(tag: str) -> tuple[Workload, list]:
        return Workload(f"ordinary {plan.prompt_len}/{plan.new_tokens} c={c} ({tag})", plan.prompt_len,
                        plan.new_tokens, concurrency=c, **common), prompts

    def feature(name: str, prompt_set: list, **kw) -> tuple[Workload, list]:
        return Workload(f"{name} {plan.prompt_len}/{plan.feature_max_tokens} c={fc}", plan.prompt_len,
                        plan.feature_max_tokens, concurrency=fc, ignore_eos=False, **kw, **common), prompt_set

    featured = [feature("tools-auto", texts, tools=TOOLS, tool_choice="auto"),
                feature("tools-required", texts, tools=TOOLS, tool_choice="required"),
                feature(f"reasoning-{plan.reasoning_budget}+schema", prompts, json_schema=schema,
                        reasoning_budget=plan.reasoning_budget)]
    alone = run_together([ordinary("alone")])[0]
    beside = run_together([ordinary("beside features")] + featured)[0]
    plain = [(dataclasses.replace(w, name=f"plain-matched ({w.name})", tool_choice="none", json_schema=None,
                                  reasoning_budget=None, ignore_eos=True,
                                  max_tokens_list=lengths[w.name] or [w.max_tokens]),
              ps) for w, ps in featured]  # the same prompts and output lengths, no feature in use
    beside_plain = run_together([ordinary("beside plain")] + plain)[0]
    again = run_together([ordinary("alone again")])[0]
    return {"beside_features_over_alone": side_ratios(beside, alone),
            "beside_features_over_beside_plain": side_ratios(beside, beside_plain),
            "alone_again_over_alone": side_ratios(again, alone)}


def forced_workloads(prompt_len: int, drafts: int, prompts: dict, common: dict, run) -> dict:
    """Concurrency 1 over a schema whose documents the grammar mostly forces (long keys, enums, a const:
    benchmarks/forced_drafts.py's), greedy: without speculation, with grammar-forced drafts and with
    n-gram drafts. Per proposer: output tok/s over no speculation, drafts accepted / proposed, the
    documents' validation. (That greedy documents are the same with drafts as without is
    forced_drafts.py's check: here each request's prompt spells its own number.)"""
    from benchmarks.forced_drafts import SCHEMAS
    schema = json.dumps(SCHEMAS["shipment"])
    summaries = {}
    for proposer in ("none", "grammar", "ngram"):
        workload = Workload(f"forced-structure {prompt_len}/96 c=1 drafts {proposer}", prompt_len, 96, concurrency=1,
                            json_schema=schema, ignore_eos=False, num_draft_tokens=0 if proposer == "none" else drafts,
                            proposer="ngram" if proposer == "none" else proposer, **common)
        summaries[proposer] = run(workload)
    base = summaries["none"]["output_tokens_per_s"]
    ratios = {proposer: {"over_no_speculation": s["output_tokens_per_s"] / base if base else None,
                         "drafts_accepted": s["engine"]["num_draft_tokens_accepted"],
                         "drafts_proposed": s["engine"]["num_draft_tokens_proposed"],
                         "itl_p50_ms": s["itl_p50_ms"], "valid": s["validation"]}
              for proposer, s in summaries.items()}
    for proposer, r in ratios.items():
        log(f"  forced structure, {proposer}: x{fmt_ratio(r['over_no_speculation'])} output tok/s, drafts "
            f"{r['drafts_accepted']:.0f}/{r['drafts_proposed']:.0f}, ITL p50 {r['itl_p50_ms']:.1f} ms")
    return ratios
