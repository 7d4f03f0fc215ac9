"""PrefixCache: full pages keyed by their token prefix, shared read-only, cached when freed,
evicted least recently used; and the scheduler admitting requests over it."""
import random

import pytest

from generation_service.engine.kv_cache import PageAllocator
from generation_service.engine.prefix_cache import PrefixCache
from generation_service.engine.request import RequestStatus
from generation_service.engine.scheduler import Scheduler, SlotPool, TokenBudget
from grammar_contract.spec import GrammarSpec

from tests.unit.engine.conftest import make_request

PAGE = 4


def computed(cache: PrefixCache, request, num_tokens: int | None = None):
    """Give a request pages for its tokens as if a step computed them, and key the full ones."""
    n = request.num_tokens if num_tokens is None else num_tokens
    need = -(-n // PAGE) - len(request.pages)
    request.pages += cache.allocate(need)
    request.num_cached = n
    cache.store(request)
    return request


def test_a_later_request_takes_the_full_pages_of_a_shared_prefix_read_only():
    cache = PrefixCache(PageAllocator(16), PAGE)
    a = computed(cache, make_request("a", prompt=range(1, 11)))     # 10 tokens: 2 full pages + 2
    b = make_request("b", prompt=[*range(1, 10), 99, 98])           # shares a's first 9 tokens
    assert cache.match(b, b.num_tokens - 1) == 8                    # whole pages only
    assert b.pages == a.pages[:2] and b.num_cached == 8
    assert [cache.refs(p) for p in a.pages] == [2, 2, 1]            # a's partial page is a's own
    assert cache.num_used_pages == 3


def test_a_page_is_keyed_by_everything_before_it():
    cache = PrefixCache(PageAllocator(16), PAGE)
    computed(cache, make_request("a", prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9]))
    b = make_request("b", prompt=[0, 2, 3, 4, 5, 6, 7, 8, 9])       # page 2 equal, page 1 not
    assert cache.match(b, 8) == 0 and b.pages == []


def test_the_match_leaves_the_tokens_the_row_must_compute():
    cache = PrefixCache(PageAllocator(16), PAGE)
    computed(cache, make_request("a", prompt=range(1, 9)))          # 8 tokens, 2 full pages
    same = make_request("b", prompt=range(1, 9))
    assert cache.match(same, same.num_tokens - 1) == 4              # the last page is recomputed


def test_freed_pages_stay_cached_and_are_evicted_least_recently_used_deepest_first():
    cache = PrefixCache(PageAllocator(1 + 4), PAGE)
    a = computed(cache, make_request("a", prompt=range(1, 13)))     # 3 full pages
    cache.free(a.pages)
    assert (cache.num_used_pages, cache.num_cached_pages, cache.num_free_pages) == (0, 3, 4)
    taken = cache.allocate(2)                                       # the free page, then one eviction
    assert a.pages[2] in taken and cache.num_evictions == 1
    again = make_request("again", prompt=range(1, 14))
    assert cache.match(again, 12) == 8 and again.pages == a.pages[:2]  # the prefix's head survived


def test_a_page_computed_twice_stays_private_in_the_second_request():
    cache = PrefixCache(PageAllocator(16), PAGE)
    a = computed(cache, make_request("a", prompt=range(1, 6)))
    b = computed(cache, make_request("b", prompt=range(1, 6)))      # computed side by side, no match
    cache.free(b.pages)
    assert cache.num_cached_pages == 0 and cache.num_used_pages == 2  # b's copy went back free
    cache.free(a.pages)
    assert cache.num_cached_pages == 1


def test_disabled_it_is_a_ref_counted_allocator():
    cache = PrefixCache(PageAllocator(8), PAGE, enabled=False)
    a = computed(cache, make_request("a", prompt=range(1, 10)))
    b = make_request("b", prompt=range(1, 10))
    assert cache.match(b, 8) == 0
    cache.free(a.pages)
    assert (cache.num_used_pages, cache.num_cached_pages, cache.num_free_pages) == (0, 0, 7)
    with pytest.raises(ValueError, match="freed twice"):
        cache.free(a.pages[:1])


# ---- the scheduler over the cache ------------------------------------------------------------
def scheduler(num_pages=64, chunk=8, max_batch=4, drafts=None):
    return Scheduler(PrefixCache(PageAllocator(num_pages), PAGE), PAGE, SlotPool(2 * max_batch),
                     max_batch=max_batch, max_waiting=16, budget=TokenBudget.fixed(chunk), propose_drafts=drafts)


def step(s, batch, token=7, accepted=0):
    """What the engine does after a step (lifecycle.postprocess): cache, sample, key pages."""
    for row in batch.rows:
        r = row.request
        n = min(accepted, len(row.drafts))
        r.num_cached = row.seq_len - len(row.drafts) + n if row.is_sampling else row.seq_len
        if row.is_sampling:
            r.token_ids.extend(row.drafts[:n] + [token])
            if row.drafts:
                s.trim_pages(r)
        s.store_pages(r)


def test_admission_starts_after_the_cached_prefix_and_charges_only_the_rest():
    s = scheduler(chunk=8)
    a = make_request("a", prompt=range(1, 19))
    s.add(a)
    while a.num_generated == 0:
        step(s, s.schedule())
    b = make_request("b", prompt=[*range(1, 17), 50, 51, 52])       # 16 shared tokens: 4 pages
    s.add(b)
    batch = s.schedule()
    row = next(row for row in batch.rows if row.request is b)
    assert (row.num_cached, row.input_ids) == (16, [50, 51, 52]) and row.is_sampling
    assert b.pages[:4] == a.pages[:4] and b.num_cached_prompt_tokens == 16
    assert s.cache.num_hit_tokens == 16 and s.cache.num_query_tokens == 18 + 19


def test_a_compiling_request_keeps_two_tokens_to_compute():
    s = scheduler(chunk=64)
    a = make_request("a", prompt=range(1, 10))
    s.add(a)
    step(s, s.schedule())
    b = make_request("b", prompt=range(1, 10))
    b.spec = b.spec.__class__("b", b.spec.prompt_ids, b.spec.sampling, grammar=GrammarSpec("regex", "a+"))
    s.add(b)
    row = s.schedule().rows[-1]
    assert row.request is b and row.num_cached == 4 and len(row.input_ids) == 4 and not row.is_sampling


def test_an_admission_without_room_gives_its_matched_pages_back():
    s = scheduler(num_pages=1 + 3, chunk=64)
    a = make_request("a", prompt=range(1, 10), max_new_tokens=2)    # 3 pages
    s.add(a)
    step(s, s.schedule())
    b = make_request("b", prompt=[*range(1, 9), 60, 61, 62, 63, 64])  # 2 shared pages + 2 of its own
    s.add(b)
    assert [row.request for row in s.schedule().rows] == [a]         # b does not fit beside a
    assert b.status is RequestStatus.WAITING and b.pages == [] and b.num_cached == 0
    assert [s.cache.refs(p) for p in a.pages] == [1, 1, 1] and s.cache.num_query_tokens == 9


def test_a_preempted_request_resumes_from_its_cached_pages():
    s = scheduler(num_pages=1 + 6, chunk=64, max_batch=2)
    a, b = make_request("a", prompt=range(1, 10)), make_request("b", prompt=range(20, 29))
    s.add(a)
    s.add(b)
    step(s, s.schedule())                                            # 3 pages each: the pool is full
    for _ in range(4):                                               # a needs a 4th page at 13 tokens
        step(s, s.schedule())
    assert b.status is RequestStatus.PREEMPTED
    s.remove(a)
    row = s.schedule().rows[0]
    assert row.request is b and row.num_cached == 8                  # its first two pages were still cached


def test_rejected_drafts_never_touch_a_shared_page():
    s = scheduler(chunk=64, drafts=lambda r, k: [0] * k)
    a = make_request("a", prompt=range(1, 10))
    s.add(a)
    step(s, s.schedule())
    b = make_request("b", prompt=range(1, 10), num_draft_tokens=4)
    s.add(b)
    step(s, s.schedule())
    shared = b.pages[:2]
    batch = s.schedule(max_drafts=4)
    row = next(row for row in batch.rows if row.request is b)
    assert row.drafts and row.num_cached >= 8                        # every write lands past the shared pages
    step(s, batch, accepted=0)                                       # every draft rejected: rolled back
    assert b.pages[:2] == shared and [s.cache.refs(p) for p in shared] == [2, 2]


def finish(s, request):
    """What lifecycle.finish does to the scheduler's state."""
    request.status = RequestStatus.FINISHED
    s.remove(request)
    if request.slot is not None:
        s.slots.free(request.slot)
        request.slot = None


@pytest.mark.parametrize("seed", range(6))
def test_no_page_leaks_after_a_random_mix(seed):
    """Shared prefixes, drafts accepted and rejected, preemption in a small pool, cancellation
    at any point: afterwards no page is held and every page is free or cached."""
    rng = random.Random(seed)
    s = scheduler(num_pages=1 + 12, chunk=rng.choice([4, 8, 64]), max_batch=4, drafts=lambda r, k: [3] * k)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(0, 14))] for _ in range(3)]
    live = []
    for i in range(200):
        if rng.random() < 0.5 and len(s.waiting) < 8:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
            r = make_request(f"r{i}", prompt=prompt, max_new_tokens=rng.randrange(1, 24),
                             num_draft_tokens=rng.choice([0, 2]))
            s.add(r)
            live.append(r)
        batch = s.schedule(max_drafts=2)
        step(s, batch, token=rng.randrange(1, 50), accepted=rng.randrange(0, 3))
        for r in list(live):
            if r.num_generated >= r.max_new_tokens or rng.random() < 0.05:  # finished or cancelled
                finish(s, r)
                live.remove(r)
        held = [p for r in s.running for p in r.pages]
        assert s.cache.num_used_pages == len(set(held))
        assert all(s.cache.refs(p) == held.count(p) for p in set(held))
    for r in live:
        finish(s, r)
    assert s.cache.num_hit_tokens and s.num_preemptions and s.cache.num_evictions  # the mix had all of it
    assert s.cache.num_used_pages == 0
    assert s.cache.num_free_pages == 12
    assert s.cache.allocator.num_free_pages + s.cache.num_cached_pages == 12
