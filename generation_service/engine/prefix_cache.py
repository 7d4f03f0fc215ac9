"""PrefixCache: the KV pages as requests hold them, and full pages kept for the next request.

Automatic prefix caching. A page whose every token has K/V computed by a finished step is
*keyed* by the token ids before and in it: ``key_i = blake2b(key_{i-1} || token ids of page i)``.
Requests whose token ids agree on their first n full pages have the same first n keys, so a
request admitted later finds the pages an earlier one computed (`match`) and starts with
``num_cached = n * page_size``: its prefill is a row with a cached prefix, which every forward
already attends over through the page table.

Why a hash chain of pages, not a radix tree of tokens: the page is the unit of storage, and a
request writes its own tokens after its prefix, so a hit on part of a page would have to copy
that page first. With whole pages a lookup is one dict probe per page, nothing is split or
merged, and eviction frees one page at a time. The digest is a 128-bit cryptographic one: a
client cannot craft a prompt whose key collides with another prompt's (Python's own hash of
ints is not randomised) and read or spoil the K/V behind it.

Page states (every allocatable page is in exactly one):
- free: in the allocator;
- held: ref count >= 1, listed in the `pages` of that many requests; keyed or not;
- cached: ref count 0, keyed, in the LRU; handed out again by `match`, or evicted (oldest
  first) by `allocate` once the allocator has no free page left.

Invariant: a keyed page never changes. A request writes K/V only at positions >= its
num_cached, and a page is keyed (`store`) or shared (`match`) only when all its positions lie
below the num_cached of every request holding it; a request's last, partial page is never
keyed, so it is its own, and a speculative rollback (`Scheduler.trim_pages`) frees only pages
past num_cached. Grammar state is not cached: it lives in grammar_service per request.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from hashlib import blake2b

from generation_service.engine.kv_cache import PageAllocator
from generation_service.engine.request import Request

KEY_BYTES = 16


class PrefixCache:
    """Ref-counted pages over a PageAllocator; full pages kept and found by key when enabled.

    Disabled, it is a plain ref-counted allocator: nothing is keyed, freed pages go straight
    back to the allocator and `match` finds nothing."""

    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.is_enabled = enabled
        self._refs = [0] * allocator.num_pages
        self._key_of: dict[int, bytes] = {}     # keyed page -> its key
        self._page_of: dict[bytes, int] = {}    # key -> the page holding that prefix
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently freed first
        self.num_used_pages = 0       # held by at least one request
        self.num_query_tokens = 0     # tokens of admitted requests looked up (`count_lookup`)
        self.num_hit_tokens = 0       # ...of which found cached
        self.num_evictions = 0

    # ---- counts --------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Pages of the KV cache, the dummy page included (as `PageAllocator.num_pages`)."""
        return self.allocator.num_pages

    @property
    def num_cached_pages(self) -> int:
        """Keyed pages that no request holds: reusable by `match`, evictable by `allocate`."""
        return len(self._lru)

    @property
    def num_free_pages(self) -> int:
        """Pages `allocate` can hand out: free ones and cached ones (by evicting them)."""
        return self.allocator.num_free_pages + len(self._lru)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def refs(self, page: int) -> int:
        return self._refs[page]

    # ---- holding and freeing -----------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free_pages

    def allocate(self, n: int) -> list[int]:
        """`n` private pages (ref count 1): free ones first, then the least recently used cached."""
        if not self.can_allocate(n):
            raise RuntimeError(f"cannot allocate {n} pages: {self.num_free_pages} free or cached")
        fresh = min(n, self.allocator.num_free_pages)
        pages = self.allocator.allocate(fresh)
        pages += [self._evict() for _ in range(n - fresh)]
        for page in pages:
            self._refs[page] = 1
        self.num_used_pages += n
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page. Unheld keyed pages become cached, most recently
        used last in the order of a request's pages reversed: its deepest page is evicted
        first, its first (the most shared) last."""
        for page in reversed(pages):
            refs = self._refs[page]
            if refs < 1:
                raise ValueError(f"page {page} freed twice")
            self._refs[page] = refs - 1
            if refs == 1:
                self.num_used_pages -= 1
                if page in self._key_of:
                    self._lru[page] = None
                else:
                    self.allocator.free([page])

    def _hold(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._lru[page]
            self.num_used_pages += 1
        self._refs[page] += 1

    def _evict(self) -> int:
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self.num_evictions += 1
        return page

    # ---- the prefix ----------------------------------------------------------------------------
    def match(self, request: Request, max_tokens: int) -> int:
        """Give a request that holds no pages the keyed pages of its longest cached prefix of at
        most `max_tokens` tokens (whole pages), held for it; sets its num_cached to their tokens
        and returns that."""
        assert not request.pages and request.num_cached == 0, "match a request that holds no pages"
        if not self.is_enabled:
            return 0
        pages = []
        for i in range(max(max_tokens, 0) // self.page_size):
            page = self._page_of.get(self._key(request, i))
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._hold(page)
        request.pages = pages
        request.num_stored_pages = len(pages)
        request.num_cached = len(pages) * self.page_size
        return request.num_cached

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """An admission looked up `num_tokens` tokens and found `num_hit_tokens` cached."""
        if self.is_enabled:
            self.num_query_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def store(self, request: Request) -> None:
        """Key the request's pages that its computed tokens filled since the last call. A page
        whose prefix another page holds already stays private (freed as unkeyed)."""
        num_full = request.num_cached // self.page_size
        if not self.is_enabled or num_full <= request.num_stored_pages:
            return
        for i in range(request.num_stored_pages, num_full):
            page = request.pages[i]
            if page in self._key_of:
                continue  # matched from the cache
            key = self._key(request, i)
            if key not in self._page_of:
                self._page_of[key] = page
                self._key_of[page] = key
        request.num_stored_pages = num_full

    def _key(self, request: Request, index: int) -> bytes:
        """The key of the request's page `index`, a full page of its token ids (memoised on the
        request: its token ids only grow, so its keys never change)."""
        keys, size = request.page_keys, self.page_size
        while len(keys) <= index:
            i = len(keys)
            digest = blake2b(keys[-1] if keys else b"", digest_size=KEY_BYTES)
            digest.update(array("q", request.token_ids[i * size:(i + 1) * size]).tobytes())
            keys.append(digest.digest())
        return keys[index]
