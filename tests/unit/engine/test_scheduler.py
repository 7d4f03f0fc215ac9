import time

import pytest

from generation_service.engine.errors import QueueFullError
from generation_service.engine.kv_cache import PageAllocator
from generation_service.engine.late_mask import FIRST_RETRY_S, LateMask
from generation_service.engine.prefix_cache import PrefixCache
from generation_service.engine.request import RequestStatus
from generation_service.engine.scheduler import Scheduler, SlotPool, TokenBudget
from generation_service.engine.step_time import MixedStepCost, StepTime

from tests.unit.engine.conftest import make_request

PAGE = 4


def make_scheduler(num_pages=64, max_batch=4, max_waiting=8, chunk=8, alone=None, drafts=None, caching=True,
                   queued=0, token_bucket=None, step_time=None, max_step_tokens=None):
    return Scheduler(PrefixCache(PageAllocator(num_pages), PAGE, caching), PAGE, SlotPool(2 * max_batch), max_batch=max_batch,
                     max_waiting=max_waiting, budget=TokenBudget(chunk, alone or chunk, queued), propose_drafts=drafts,
                     token_bucket=token_bucket, step_time=step_time, max_step_tokens=max_step_tokens)


def complete(batch, token=7, accepted=0):
    """What the engine does after a step: cache the computed tokens, append one sampled token."""
    for row in batch.rows:
        r = row.request
        if row.is_sampling:
            r.num_cached = row.seq_len - len(row.drafts) + accepted
            r.token_ids.extend(row.drafts[:accepted] + [token])
        else:
            r.num_cached = row.seq_len


def test_chunked_prefill_then_decode_with_pages_following_the_tokens():
    s = make_scheduler(chunk=8)
    r = make_request(prompt_len=19)
    s.add(r)
    sizes = []
    while not r.is_decoding or r.num_generated < 2:
        batch = s.schedule()
        row = batch.rows[0]
        sizes.append((len(row.input_ids), row.is_sampling))
        assert len(r.pages) * PAGE >= row.seq_len
        complete(batch)
    assert sizes[:3] == [(8, False), (8, False), (3, True)]
    assert sizes[3] == (1, True)
    s.remove(r)
    assert s.cache.num_used_pages == 0


def test_budget_is_shared_and_decodes_do_not_wait_for_prefills():
    s = make_scheduler(chunk=8)
    a, b = make_request("a", 4), make_request("b", 30)
    s.add(a)
    complete(s.schedule())
    s.add(b)
    batch = s.schedule()
    assert [(row.request.request_id, len(row.input_ids)) for row in batch.rows] == [("a", 1), ("b", 8)]


def test_a_step_without_decode_rows_takes_the_larger_budget():
    s = make_scheduler(max_batch=4, chunk=8, alone=24)
    a, b = make_request("a", 40), make_request("b", 5)
    s.add(a)
    s.add(b)
    first = s.schedule()  # nothing decodes yet: a long prompt goes in large chunks
    assert [(row.request.request_id, len(row.input_ids)) for row in first.rows] == [("a", 24)]
    complete(first)
    second = s.schedule()  # still no decode row: a's rest, then b, up to 24 tokens
    assert [(row.request.request_id, len(row.input_ids)) for row in second.rows] == [("a", 16), ("b", 5)]
    complete(second)
    c = make_request("c", 30)
    s.add(c)
    third = s.schedule()  # a and b decode now: c's prefill shares the step within the small budget
    assert [(row.request.request_id, len(row.input_ids)) for row in third.rows] == [("a", 1), ("b", 1), ("c", 8)]


def test_token_budgets_must_be_ordered():
    with pytest.raises(ValueError, match="with_decode <= max_with_decode <= alone"):
        TokenBudget(16, 8)
    with pytest.raises(ValueError, match="with_decode <= max_with_decode <= alone"):
        TokenBudget(8, 16, 32)


def test_beside_decode_rows_the_budget_grows_with_the_queue_up_to_its_limit():
    """Prompts that arrive faster than the small budget prefills them would keep rows that could
    decode in the queue: a step beside decode rows takes an eighth of the waiting prompt tokens, at
    least the chunk and at most the limit."""
    s = make_scheduler(num_pages=256, max_batch=8, chunk=8, alone=64, queued=32)
    a = make_request("a", 4)
    s.add(a)
    complete(s.schedule())  # a decodes from now on
    s.add(make_request("b", 12))  # 12 waiting tokens: an eighth is under the chunk
    batch = s.schedule()
    assert [(row.request.request_id, len(row.input_ids)) for row in batch.rows] == [("a", 1), ("b", 8)]
    complete(batch)
    for name in "cdefghi":
        s.add(make_request(name, 40))  # 4 (b) + 280 waiting: an eighth is over the limit
    batch = s.schedule()
    assert sum(len(row.input_ids) for row in batch.rows if row.request is not a) == 32
    complete(batch)
    fixed = make_scheduler(num_pages=256, max_batch=8, chunk=8, alone=64)  # no limit given: the chunk
    fixed.add(make_request("a", 4))
    complete(fixed.schedule())
    for name in "cdef":
        fixed.add(make_request(name, 40))
    assert sum(len(row.input_ids) for row in fixed.schedule().rows) == 1 + 8


def test_queue_limit_raises_queue_full():
    s = make_scheduler(max_waiting=2)
    s.add(make_request("a"))
    s.add(make_request("b"))
    with pytest.raises(QueueFullError):
        s.add(make_request("c"))


def test_preemption_frees_pages_keeps_slot_and_resumes_first():
    # (no prefix cache: b would resume from a's pages, which hold the same tokens)
    s = make_scheduler(num_pages=1 + 4, max_batch=2, chunk=64, caching=False)  # 4 pages = 16 tokens in all
    a, b, c = make_request("a", 6), make_request("b", 6), make_request("c", 2)
    for r in (a, b, c):
        s.add(r)
    complete(s.schedule())  # a, b prefilled: 2 pages each, pool empty; c does not fit the batch
    assert s.cache.num_free_pages == 0 and c.status is RequestStatus.WAITING
    for _ in range(2):       # a grows to 8 tokens fine; at 9 it needs a 3rd page
        complete(s.schedule())
    batch = s.schedule()
    assert [row.request for row in batch.rows] == [a]
    assert b.status is RequestStatus.PREEMPTED and b.pages == [] and b.num_cached == 0
    assert b.slot is not None and s.waiting[0] is b
    assert s.num_preemptions == 1
    generated_b = list(b.output_ids)
    s.remove(a)              # a finishes: b resumes before c and re-prefills prompt + output
    batch = s.schedule()
    assert batch.rows[0].request is b and batch.rows[0].input_ids == b.token_ids
    assert b.output_ids == generated_b


def test_drafts_are_capped_by_max_new_tokens_and_dropped_when_pages_are_short():
    s = make_scheduler(num_pages=1 + 2, chunk=64, drafts=lambda r, k: [9] * k)
    r = make_request(prompt_len=3, max_new_tokens=3, num_draft_tokens=4)
    s.add(r)
    complete(s.schedule())
    batch = s.schedule(max_drafts=4)
    assert batch.rows[0].drafts == [9]  # 2 tokens left: 1 draft + the model's own token
    r2 = make_request(prompt_len=7, max_new_tokens=8, num_draft_tokens=4)
    s2 = make_scheduler(num_pages=1 + 2, chunk=64, drafts=lambda r, k: [9] * k)
    s2.add(r2)
    complete(s2.schedule())  # 8 tokens = 2 full pages: no room for drafts, none for more
    batch = s2.schedule(max_drafts=4)
    assert batch.is_empty or batch.rows[0].drafts == []


def test_a_compiling_request_prefills_all_but_its_last_token():
    s = make_scheduler(chunk=64)
    r = make_request(prompt_len=10)
    r.spec = r.spec.__class__(r.request_id, r.spec.prompt_ids, r.spec.sampling,
                              grammar=__import__("generation_service.engine.params", fromlist=["GrammarSpec"]).GrammarSpec("regex", "a+"))
    s.add(r)
    batch = s.schedule()
    assert len(batch.rows[0].input_ids) == 9 and not batch.rows[0].is_sampling
    complete(batch)
    assert s.schedule().is_empty
    r.grammar_id = 3
    batch = s.schedule()
    assert batch.rows[0].input_ids == [10] and batch.rows[0].is_sampling


def test_prefill_fills_the_token_bucket_a_step_pays_for():
    """A graph step of n tokens costs its bucket's slots: while prompts wait, the padding up to
    the bucket is prefilled instead."""
    s = make_scheduler(num_pages=256, max_batch=8, chunk=8, alone=64, token_bucket=lambda n: -(-n // 16) * 16)
    a = make_request("a", 4)
    s.add(a)
    complete(s.schedule())  # a decodes: 1 token + the chunk's 8 = 9, in a bucket of 16
    s.add(make_request("b", 40))
    batch = s.schedule()
    assert [(row.request.request_id, len(row.input_ids)) for row in batch.rows] == [("a", 1), ("b", 15)]


def test_a_step_beside_decode_rows_stays_within_the_largest_mixed_graph():
    """A step past the runner's largest mixed graph runs eagerly, many times slower: while
    decode rows share the step, the queued budget stops there (never below the chunk);
    alone, a prompt takes the whole budget."""
    def loaded(max_step_tokens):
        s = make_scheduler(num_pages=1024, max_batch=8, chunk=8, alone=256, queued=128,
                           max_step_tokens=max_step_tokens)
        for name in "ab":
            s.add(make_request(name, 4))
        complete(s.schedule())  # a and b decode from now on
        for name in "cdefgh":
            s.add(make_request(name, 200))  # 1,200 waiting: an eighth is over the limit of 128
        return s

    def step(s):
        batch = s.schedule()
        return batch.num_tokens, sum(len(row.input_ids) for row in batch.rows if not row.is_decode)

    assert step(loaded(None)) == (2 + 128, 128)
    assert step(loaded(64)) == (64, 62)
    assert step(loaded(9)) == (2 + 8, 8)  # the chunk beside decode rows holds whatever the limit
    idle = make_scheduler(num_pages=1024, max_batch=8, chunk=8, alone=256, queued=128, max_step_tokens=64)
    idle.add(make_request("z", 200))
    assert step(idle) == (200, 200)


def test_a_step_beside_decode_rows_stays_within_its_time_cap():
    """Each decode row waits for the whole step: while prompts queue, a step that decode rows
    share grows only as far as `stretch` plain decode steps allow, bucket included, and never
    below the chunk; before any decode step was timed, and without decode rows, nothing caps."""
    cost = MixedStepCost(fixed_s=0.004, per_token_s=0.0001, decode_s=0.006)  # t slots: 4 ms + 0.1 ms each
    step_time = StepTime(cost, stretch=2.0)
    bucket = lambda n: -(-n // 16) * 16  # noqa: E731

    def loaded():
        s = make_scheduler(num_pages=1024, max_batch=8, chunk=8, alone=256, queued=128, token_bucket=bucket,
                           step_time=step_time)
        a = make_request("a", 4)
        s.add(a)
        complete(s.schedule())  # a decodes from now on
        for name in "bcdefgh":
            s.add(make_request(name, 200))  # 1,400 waiting: an eighth is over the limit of 128
        return s, a

    def prefill(batch):
        return sum(len(row.input_ids) for row in batch.rows if not row.is_decode)

    s, a = loaded()
    assert step_time.max_step_tokens(1) is None and prefill(s.schedule()) == 144 - 1  # not timed: the limit, filled
    step_time.observe_decode(0.0045, num_rows=8)  # a decode step of another batch: still no cap for 1 row
    s, a = loaded()
    assert step_time.max_step_tokens(1) is None and prefill(s.schedule()) == 144 - 1
    step_time.observe_decode(0.0045, num_rows=1)  # 2 x 4.5 ms holds 50 slots: bucket 48 = a's token + 47
    assert step_time.max_step_tokens(1) == 50
    s, a = loaded()
    batch = s.schedule()
    assert prefill(batch) == 47 and bucket(batch.num_tokens) <= 50
    step_time._decode_s[1] = 0.0036  # decode steps got faster: 2 x 3.6 ms holds 32 slots
    s, a = loaded()
    assert prefill(s.schedule()) == 31
    step_time._decode_s[1] = 0.002  # under the fixed cost: no room, yet the chunk still goes in
    s, a = loaded()
    assert prefill(s.schedule()) == 8
    idle = make_scheduler(num_pages=1024, max_batch=8, chunk=8, alone=256, queued=128, token_bucket=bucket,
                          step_time=step_time)
    idle.add(make_request("z", 200))
    assert prefill(idle.schedule()) == 200  # no decode row: the budget alone, uncapped


def test_step_time_follows_the_recent_decode_steps_of_each_batch_size_and_refuses_a_stretch_under_one():
    step_time = StepTime(MixedStepCost(0.004, 0.0001, 0.006), stretch=2.5)
    step_time.observe_decode(0.006, num_rows=64)
    for _ in range(60):
        step_time.observe_decode(0.010, num_rows=61)  # the load changed: the mean follows within a few dozen steps
    assert abs(step_time.decode_s(64) - 0.010) < 0.0001 and step_time.decode_s(33) == step_time.decode_s(64)
    assert step_time.max_step_tokens(64) == int((2.5 * step_time.decode_s(64) - 0.004) / 0.0001)
    step_time.observe_decode(0.002, num_rows=1)  # an idle server's 1-row steps: their own mean
    assert step_time.decode_s(1) == 0.002 and abs(step_time.decode_s(64) - 0.010) < 0.0001
    assert step_time.max_step_tokens(128) is None  # no 128-row decode step ran: every such step is mixed
    assert MixedStepCost(0.004, 0.0001, 0.006).chunk(max_tokens=4096, granule=16) == 48  # 6 ms of tokens
    assert MixedStepCost(0.004, 0.0001, 0.006).tokens_within(0.003) == 0
    with pytest.raises(ValueError, match="stretch must be >= 1"):
        StepTime(MixedStepCost(0.004, 0.0001, 0.006), stretch=0.5)


def test_continuing_rows_come_first_and_nothing_is_preempted_beside_them():
    """A chained step's decode rows (their tokens still on the GPU) lead the batch; a running
    request that needs a page held by them waits instead of preempting them."""
    from generation_service.engine.scheduler import ScheduledRow

    def setup():
        s = make_scheduler(num_pages=3, max_batch=4, chunk=8)  # 2 usable pages of 4 tokens
        d, a = make_request("d", 4), make_request("a", 3)
        s.add(d)
        s.add(a)
        complete(s.schedule())        # d: 4 tokens, a: 3, a page each; d's next token needs a page
        return s, d, a

    s, d, a = setup()
    s.schedule()                      # no chain: d's page preempts a, the newest
    assert a.status is RequestStatus.PREEMPTED and s.num_preemptions == 1
    s, d, a = setup()
    a.num_cached = a.num_tokens       # chained: a's token of the step in flight is unread
    continuing = [ScheduledRow(a, a.num_tokens, [-1], is_sampling=True)]
    batch = s.schedule(continuing=continuing)
    assert batch.rows == continuing and a.status is RequestStatus.RUNNING and s.num_preemptions == 0


def test_a_late_row_sits_out_while_its_next_mask_is_likely_filled_and_comes_back_when_due():
    s = make_scheduler(chunk=8)
    a, b = make_request("a", 4), make_request("b", 4)
    s.add(a)
    s.add(b)
    complete(s.schedule())
    a.late_mask = LateMask()
    a.late_mask.late(time.monotonic())  # late, no fill time learnt: back after FIRST_RETRY_S
    assert [row.request.request_id for row in s.schedule().rows] == ["b"]
    time.sleep(FIRST_RETRY_S)
    assert [row.request.request_id for row in s.schedule().rows] == ["a", "b"]
    a.late_mask.fill_s = 0.050  # learnt: its fills take about 50 ms
    a.late_mask.sampled(time.monotonic())  # a token now: its next fill runs
    assert a.sits_out(time.monotonic())
    assert [row.request.request_id for row in s.schedule().rows] == ["b"]
    s.mask_lead_s = 0.060  # steps whose forward takes 60 ms: this one reads masks after it is due
    assert [row.request.request_id for row in s.schedule().rows] == ["a", "b"]
    s.mask_lead_s = 0.0
    a.late_mask.due_s = time.monotonic()
    assert [row.request.request_id for row in s.schedule().rows] == ["a", "b"]


def test_a_late_masks_due_time_follows_its_fill_time_and_backs_off_before_it_is_known():
    mask, now = LateMask(), 100.0
    mask.late(now)
    mask.late(now + FIRST_RETRY_S)  # late again: twice as long
    assert not mask.is_due(now + 2.9 * FIRST_RETRY_S) and mask.is_due(now + 3 * FIRST_RETRY_S)
    mask.late(now + 0.040)
    now += 0.060
    mask.sampled(now)  # its fill took 40-60 ms
    assert abs(mask.fill_s - 0.050) < 1e-9 and not mask.is_due(now + 0.044) and mask.is_due(now + 0.045)
    for _ in range(30):  # fills of 50 ms, looked at when due: late, or ready
        looked = now + (mask.due_s - now)
        while looked - now < 0.050:
            mask.late(looked)
            looked = mask.due_s
        now = looked
        mask.sampled(now)
    assert 0.045 < mask.fill_s < 0.065  # bracketed: no growth from the time it sat out


def test_a_late_row_whose_fills_got_fast_is_back_in_decode_graphs_within_a_few_tokens():
    """A fast grammar's fill that once queued behind a slow row's was late: ready at every first
    look since, it must not keep sitting out at the pace of that wait."""
    mask, now, forward_s = LateMask(), 100.0, 0.001
    mask.late(now)
    mask.sampled(now + 0.044, forward_s)  # its fill waited 44 ms once
    now += 0.044
    for token in range(1, 20):
        now = mask.due_s + forward_s  # it joins a step when due; the mask is read a forward later
        if not mask.sampled(now, forward_s):
            break
    assert token <= 8, token
    assert mask.fill_s < forward_s


def test_a_row_slow_at_every_fill_keeps_sitting_out():
    mask, now, forward_s = LateMask(), 100.0, 0.001
    mask.late(now)
    assert mask.sampled(now + 0.040, forward_s)
    now += 0.040
    for _ in range(40):  # fills of 40 ms, looked at when due: late, or ready
        looked = mask.due_s + forward_s
        while looked - now < 0.040:
            mask.late(looked)
            looked = mask.due_s + forward_s
        now = looked
        assert mask.sampled(now, forward_s)
        assert 0.015 < mask.fill_s < 0.060
