from dataclasses import replace

from generation_service.engine.grammar_link import LinkRow
from generation_service.engine.params import SpeculativeParams
from generation_service.engine.request import ForcedRun
from generation_service.engine.speculative import GrammarProposer, NgramProposer, accept_greedy, make_proposer
from grammar_contract.spec import GrammarSpec
from step_channel import FLAG_FORCED_DRAFTS

from tests.unit.engine.conftest import make_request


def test_ngram_proposes_the_continuation_of_the_latest_match():
    request = make_request(prompt=[5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6])
    # "5 6" last occurred at index 5 followed by 7, 1, 2 (latest match wins over index 0).
    assert NgramProposer().propose(request, 3) == [7, 1, 2]


def test_ngram_prefers_longer_ngrams_and_returns_nothing_without_a_match():
    request = make_request(prompt=[1, 2, 3, 9, 2, 3, 4, 1, 2, 3])
    assert NgramProposer().propose(request, 2) == [9, 2]  # "1 2 3" -> 9 (not "2 3" -> 4)
    assert NgramProposer().propose(make_request(prompt=[1, 2, 3, 4]), 4) == []


def test_a_forced_run_continues_only_the_tokens_it_was_forced_after():
    run = ForcedRun(4, (10, 11, 12))  # grammar_service: index 4 on is forced to 10 11 12
    assert run.after([1, 2, 3, 4]) == [10, 11, 12]
    assert run.after([1, 2, 3, 4, 10]) == [11, 12]     # the step sampled the run's first token
    assert run.after([1, 2, 3, 4, 9]) == []            # it sampled another: the run is off
    assert run.after([1, 2, 3, 4, 10, 11, 12]) == []   # used up
    assert run.after([1, 2, 3]) == []                  # not reached (never happens)


def test_grammar_proposer_drafts_the_forced_run_and_else_ngrams():
    request = make_request(prompt=[5, 6, 7, 1, 5, 6], num_draft_tokens=4)
    proposer = make_proposer("grammar")
    assert isinstance(proposer, GrammarProposer)
    assert proposer.propose(request, 3) == [7, 1, 5]   # no run yet: n-gram lookup
    request.forced_run = ForcedRun(6, (20, 21, 22, 23, 24))
    request.token_ids.append(20)
    assert proposer.propose(request, 3) == [21, 22, 23]
    assert proposer.propose(request, 8) == [21, 22, 23, 24]  # ends where the grammar stops forcing
    request.forced_run = ForcedRun(6, (30, 31))       # the step sampled 20, not 30: n-gram again
    assert proposer.propose(request, 2) == NgramProposer().propose(request, 2)


def test_only_constrained_grammar_proposer_rows_ask_for_forced_runs():
    grammar = GrammarSpec("regex", "a+")
    request = make_request(num_draft_tokens=2)
    request.spec = replace(request.spec, grammar=grammar, speculative=SpeculativeParams(2, "grammar"))
    request.slot, request.grammar_id = 0, 1
    assert LinkRow.sampling(request, []).flags & FLAG_FORCED_DRAFTS
    for speculative in (SpeculativeParams(2, "ngram"), SpeculativeParams(0, "grammar")):
        request.spec = replace(request.spec, speculative=speculative)
        assert not LinkRow.sampling(request, []).flags & FLAG_FORCED_DRAFTS
    request.spec = replace(request.spec, grammar=None, speculative=SpeculativeParams(2, "grammar"))
    assert not LinkRow.sampling(request, []).flags & FLAG_FORCED_DRAFTS


def test_make_proposer_rejects_unknown_names():
    assert isinstance(make_proposer("ngram"), NgramProposer)
    try:
        make_proposer("oracle")
    except ValueError as error:
        assert "oracle" in str(error)
    else:
        raise AssertionError("unknown proposer accepted")


def test_greedy_acceptance_stops_at_first_mismatch_and_adds_the_target():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]   # all accepted + bonus
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]         # correction at position 1
    assert accept_greedy([3], []) == [3]                            # plain decoding
