from generation_service.engine.speculative import NgramProposer, accept_greedy, make_proposer

from tests.unit.engine.conftest import make_request


def test_ngram_proposes_the_continuation_of_the_latest_match():
    request = make_request(prompt=[5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6])
    # "5 6" last occurred at index 5 followed by 7, 1, 2 (latest match wins over index 0).
    assert NgramProposer().propose(request, 3) == [7, 1, 2]


def test_ngram_prefers_longer_ngrams_and_returns_nothing_without_a_match():
    request = make_request(prompt=[1, 2, 3, 9, 2, 3, 4, 1, 2, 3])
    assert NgramProposer().propose(request, 2) == [9, 2]  # "1 2 3" -> 9 (not "2 3" -> 4)
    assert NgramProposer().propose(make_request(prompt=[1, 2, 3, 4]), 4) == []


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
