"""Exact minimum of time-dependent keys sigma * (A_i - t) / B_i (B_i > 0) as the clock advances:
a kinetic tournament tree with slope-dominance pruning (the queue structure of lars and kairos).

Owns `KineticLineTree` only; `policies.common` re-exports it.
"""

from __future__ import annotations

import math
from typing import Hashable

INF = math.inf


class KineticLineTree:
    """Items are lines v_i(t) = sigma * (A_i - t) / B_i; `top(t)` returns the id with the least
    v_i(t), ties broken by a per-item tie key (arrival order), for non-decreasing t.

    A tournament tree over leaf slots: every internal node keeps the winner of its subtree as of
    its last check and a "melt" time until which that winner is guaranteed (its claim). Why the
    answer is exact:
    - Two lines cross at most once, and line i loses ground to line w for ever iff it falls no
      faster: s_i >= s_w with s = sigma * B (v falls at rate 1 / s).
    - A node whose winner w (from child d) beat the loser child c at time t claims w until the
      earlier of d's melt and, if some line of c falls faster than w (min s over c < s_w), the
      crossing of w with c's winner and c's own melt. If no line in c falls faster (min s over c
      >= s_w, kept per node), nothing in c can ever overtake w: the claim is d's melt alone and c
      is not watched at all, so its internal order changes ("certificate failures") are never
      processed while they cannot matter. This is the pruning that keeps a query cheap.
    - A claim is trusted only while melt > now. `top` re-derives the expired claims from the
      root down (each node once however many of its events passed); insert/delete re-derive the
      leaf-to-root path and stop as soon as a node's (winner, melt, min s) come out unchanged.
      Re-deriving a node needs both children's claims, except that an expired child c is left
      expired when it is dominated (`_dominated`): nothing in c falls faster than the other
      child's winner w and a lower bound on c's minimum (c's exact minimum when last derived,
      moved at the fastest rate in c) is above w(t) by more than any rounding, so again no
      line of c can ever reach w.
    - Comparisons at time t are done by cross-multiplication (no division), so integer-valued
      inputs compare exactly; only crossing times are divided, and a node is re-checked no later
      than the rounded crossing.
    Leaf slots are allocated by slope: slots are laid out sorted by s in runs per slope bucket
    (1/8 octave of B) with spare slots inside each run, so subtrees hold similar slopes and the
    dominance test above prunes whole subtrees; the layout only affects speed, never the answer.
    Cost: O(log n) per insert/delete and per query, plus the re-checks of nodes whose claims
    expired and are still watched.
    """

    BUCKETS_PER_OCTAVE = 8

    def __init__(self, sign: int = 1, capacity: int = 64) -> None:
        self.sign = 1 if sign >= 0 else -1
        self._t = -INF
        self._slot: dict[Hashable, int] = {}
        self._solo: tuple | None = None     # see `_place_solo`
        self._layout([], 64 if capacity < 64 else capacity, -INF)

    def __len__(self) -> int:
        return len(self._slot) + (self._solo is not None)

    def __contains__(self, item_id: Hashable) -> bool:
        return item_id in self._slot or (self._solo is not None and self._solo[0] == item_id)

    # ---- the lone item, kept out of the arrays ---------------------------------------------------
    # A queue that is empty between requests sees each one inserted and popped again, and both
    # walk the whole leaf-to-root path. An item inserted into an empty tree whose slots are all
    # spare therefore waits in `_solo` as (id, a, b, tie, t): `top` answers it (a lone line wins
    # with no expiring claim), removing it just drops it, and any other operation first places
    # it with exactly the calls `insert` would have made at its time t. The arrays then hold
    # what they would have held, and a tree the lone item left untouched differs from one it
    # passed through only in dead entries (claim times of empty nodes, a freed slot's line):
    # the spare slot goes back to the end of `_spare`, where it came from.
    def _place_solo(self) -> None:
        item_id, a, b, tie, t = self._solo
        self._solo = None
        i = self._alloc(b)
        self._put(i, item_id, a, b, tie)
        self._update_path(i, t)

    # ---- slope-ordered slot layout -------------------------------------------------------------
    def _bucket(self, b: float) -> int:
        if 0.0 < b < INF:
            return math.floor(math.log2(b) * self.BUCKETS_PER_OCTAVE)
        return -(1 << 30)           # zero, infinite or NaN work: one bucket of their own

    def _layout(self, items: list, cap: int, t: float) -> None:
        """Place [(id, a, b, tie)] sorted by s = sign * b, bucket runs each followed by a share
        of the free slots proportional to the bucket's size; rebuild every node at t (O(cap))."""
        sign = self.sign
        items.sort(key=lambda it: sign * it[2])
        self._cap = cap
        self._win = [-1] * (2 * cap)
        self._melt = [INF] * (2 * cap)
        self._smin = [INF] * (2 * cap)
        self._tl = [-INF] * (2 * cap)       # when each node's claim was last derived
        self._a = [0.0] * cap
        self._b = [1.0] * cap
        self._s = [INF] * cap
        self._tie: list = [None] * cap
        self._id: list = [None] * cap
        self._slotkey: list = [None] * cap
        self._free: dict = {}
        self._spare: list[int] = []
        self._slot = {}
        n = len(items)
        extra = cap - n
        pos = j = 0
        while j < n:
            key = self._bucket(items[j][2])
            k = j
            while k < n and self._bucket(items[k][2]) == key:
                k += 1
            for item_id, a, b, tie in items[j:k]:
                self._put(pos, item_id, a, b, tie)
                pos += 1
            room = (k - j) * extra // n
            if room:
                self._free.setdefault(key, []).extend(range(pos + room - 1, pos - 1, -1))
                for i in range(pos, pos + room):
                    self._slotkey[i] = key
                pos += room
            j = k
        self._spare = list(range(cap - 1, pos - 1, -1))
        for nd in range(cap - 1, 0, -1):
            self._recompute(nd, t)

    def _put(self, i: int, item_id: Hashable, a: float, b: float, tie) -> None:
        b = float(b)
        self._a[i], self._b[i], self._tie[i], self._id[i] = float(a), b, tie, item_id
        self._s[i] = s = self.sign * b
        leaf = i + self._cap
        self._win[leaf], self._melt[leaf], self._smin[leaf] = i, INF, s
        self._slot[item_id] = i

    def _alloc(self, b: float) -> int | None:
        key = self._bucket(b)
        free = self._free
        for k in (key, key - 1, key + 1, key - 2, key + 2):
            lst = free.get(k)
            if lst:
                i = lst.pop()
                if not lst:
                    del free[k]
                return i
        if self._spare:
            return self._spare.pop()
        for k, lst in free.items():
            i = lst.pop()
            if not lst:
                del free[k]
            return i
        return None

    def _release(self, i: int) -> None:
        key = self._slotkey[i]
        if key is None:
            self._spare.append(i)
        else:
            self._free.setdefault(key, []).append(i)

    def _items(self) -> list:
        if self._solo is not None:
            self._place_solo()
        a, b, tie, ids = self._a, self._b, self._tie, self._id
        return [(ids[i], a[i], b[i], tie[i]) for i in self._slot.values()]

    # ---- tournament ----------------------------------------------------------------------------
    def _recompute(self, n: int, t: float) -> None:
        """Re-derive node n's claim at time t; both children's claims must hold at t."""
        # Hot path (every level of every update): comparisons inlined.
        win, melt, smin = self._win, self._melt, self._smin
        self._tl[n] = t
        c = 2 * n
        l, r = win[c], win[c + 1]
        sl, sr = smin[c], smin[c + 1]
        smin[n] = sl if sl < sr else sr
        if l < 0 or r < 0:
            if l < 0:
                win[n], melt[n] = r, melt[c + 1]
            else:
                win[n], melt[n] = l, melt[c]
            return
        a, b = self._a, self._b
        al, bl, ar, br = a[l], b[l], a[r], b[r]
        x, y = (al - t) * br, (ar - t) * bl
        if x == y:
            l_first = self._tie[l] < self._tie[r]
        else:
            l_first = (x < y) if self.sign > 0 else (x > y)
        if not l_first:          # from here on: l, al, bl, child c = the winner's side
            l, al, bl, r, ar, br = r, ar, br, l, al, bl
            c, sr = c + 1, sl
        s = self._s
        sw = s[l]
        if sr >= sw:             # no line of the loser's subtree falls faster: never overtakes
            win[n], melt[n] = l, melt[c]
            return
        m, mlo = melt[c], melt[c ^ 1]
        if mlo < m:
            m = mlo
        if s[r] < sw:            # the loser's winner itself overtakes the winner at tc
            tc = (al * br - ar * bl) / (br - bl)
            if tc <= t:           # rounding: re-check strictly later so a query makes progress
                tc = math.nextafter(t, INF)
            if tc < m:
                m = tc
        win[n], melt[n] = l, m

    def _refresh(self, n: int, t: float) -> None:
        """Re-derive the expired claim of internal node n at t, recursing only into expired
        children that could still hold the minimum (see `_dominated`)."""
        cap, melt, win = self._cap, self._melt, self._win
        l, r = 2 * n, 2 * n + 1
        el, er = l < cap and melt[l] <= t, r < cap and melt[r] <= t
        if el and er:           # settle the more promising side first, then maybe skip the other
            p, c = (l, r) if self._bound(l, t) <= self._bound(r, t) else (r, l)
            self._refresh(p, t)
        elif el or er:
            p, c = (r, l) if el else (l, r)
        else:
            self._recompute(n, t)
            return
        w = win[p]
        if w >= 0 and self._dominated(c, w, t):
            sp, sc = self._smin[p], self._smin[c]
            win[n], melt[n], self._smin[n] = w, melt[p], sp if sp < sc else sc
            self._tl[n] = t
            return
        self._refresh(c, t)
        self._recompute(n, t)

    def _bound(self, c: int, t: float) -> float:
        """A lower bound on node c's minimum at t (c's exact minimum when last derived, moved
        at the fastest rate under c); only orders the search, so rounding does not matter."""
        w, tc, sc = self._win[c], self._tl[c], self._smin[c]
        if w < 0 or sc == 0.0 or not -INF < tc <= t:
            return -INF
        return self.sign * (self._a[w] - tc) / self._b[w] - (t - tc) / sc

    def _now(self, t: float) -> float:
        if t < self._t:      # clocks never go back; tolerate a caller passing a stale time
            return self._t
        self._t = t
        return t

    def _dominated(self, c: int, w: int, t: float) -> bool:
        """True if no line under node c (whose claim may have expired) can ever reach line w
        from time t on: nothing under c falls faster than w, and a lower bound on c's minimum
        at t (its exact minimum when last derived, moved at the fastest rate under c) is above
        w(t) by more than any rounding. Lets an update keep an unwatched subtree unwatched."""
        sc, s = self._smin[c], self._s
        if not sc >= s[w] or sc == 0.0:
            return False
        a, b, sign = self._a, self._b, self.sign
        wc, tc = self._win[c], self._tl[c]
        if wc < 0 or not -INF < tc <= t:
            return False
        lb = sign * (a[wc] - tc) / b[wc] - (t - tc) / sc
        vw = sign * (a[w] - t) / b[w]
        scale = ((abs(a[wc]) + abs(tc)) / abs(b[wc]) + (t - tc) / abs(sc)
                 + (abs(a[w]) + abs(t)) / abs(b[w]))
        return lb - vw > 1e-12 * scale

    def _update_path(self, i: int, t: float) -> None:
        # Hot path (every insert and delete, ~log2(cap) levels): `_recompute` inlined with the
        # arrays bound once per call -- the same operations in the same order, so the same claims.
        win, melt, smin, tl = self._win, self._melt, self._smin, self._tl
        a, b, s, tie = self._a, self._b, self._s, self._tie
        pos = self.sign > 0
        n = i + self._cap
        while n > 1:
            c = n ^ 1
            if melt[c] <= t and self._skip_expired(n, c, t):
                n >>= 1
                continue
            n >>= 1
            w0, m0, s0 = win[n], melt[n], smin[n]
            tl[n] = t                       # ---- _recompute(n, t)
            c = 2 * n
            l, r = win[c], win[c + 1]
            sl, sr = smin[c], smin[c + 1]
            sn = sl if sl < sr else sr
            smin[n] = sn
            if l < 0:
                w, m = r, melt[c + 1]
            elif r < 0:
                w, m = l, melt[c]
            else:
                al, bl, ar, br = a[l], b[l], a[r], b[r]
                x, y = (al - t) * br, (ar - t) * bl
                if x == y:
                    l_first = tie[l] < tie[r]
                else:
                    l_first = (x < y) if pos else (x > y)
                if not l_first:
                    l, al, bl, r, ar, br = r, ar, br, l, al, bl
                    c, sr = c + 1, sl
                w = l
                sw = s[l]
                if sr >= sw:
                    m = melt[c]
                else:
                    m, mlo = melt[c], melt[c ^ 1]
                    if mlo < m:
                        m = mlo
                    if s[r] < sw:
                        tc = (al * br - ar * bl) / (br - bl)
                        if tc <= t:
                            tc = math.nextafter(t, INF)
                        if tc < m:
                            m = tc
            win[n], melt[n] = w, m          # ---- end of _recompute
            if m0 > t and w == w0 and m == m0 and sn == s0:
                return          # the claim above does not depend on anything that changed

    def _skip_expired(self, p: int, c: int, t: float) -> bool:
        """Sibling c of the fresh node p has an expired claim: if c is dominated by p's winner,
        set their parent's claim from p alone and return True; else bring c up to date."""
        w = self._win[p]
        if w >= 0 and self._dominated(c, w, t):
            n, smin = p >> 1, self._smin
            sp, sc = smin[p], smin[c]
            self._win[n], self._melt[n], smin[n] = w, self._melt[p], sp if sp < sc else sc
            self._tl[n] = t
            return True
        self._refresh(c, t)
        return False

    # ---- public API ----------------------------------------------------------------------------
    def rebuild(self, items, t: float) -> None:
        """Replace the contents with [(id, a, b, tie)] in O(n log n) (one sort, bottom-up)."""
        items = list(items)
        cap = 64
        while cap < len(items) + len(items) // 4:     # a quarter spare, spread over the buckets
            cap *= 2
        self._t = t
        self._solo = None
        self._layout(items, cap, t)

    def reset_intercepts(self, items, t: float) -> None:
        """Give stored lines new intercepts [(id, a)] (slopes and tie keys unchanged), then
        re-derive every claim at t in O(n): `rebuild` without a new layout."""
        if self._solo is not None:
            self._place_solo()
        a, slot = self._a, self._slot
        for item_id, new_a in items:
            a[slot[item_id]] = float(new_a)
        self._t = t
        for nd in range(self._cap - 1, 0, -1):
            self._recompute(nd, t)

    def insert(self, item_id: Hashable, a: float, b: float, tie, t: float) -> None:
        solo = self._solo
        if solo is not None:
            if solo[0] == item_id:
                self.delete(item_id, t)
            else:
                self._place_solo()
        if item_id in self._slot:
            self.delete(item_id, t)
        t = self._now(t)
        if not self._slot and not self._free and self._spare:
            self._solo = (item_id, a, b, tie, t)      # empty, slots all spare: see `_place_solo`
            return
        i = self._alloc(b)
        if i is None:                 # full: lay everything out again in twice the slots
            items = self._items()
            items.append((item_id, a, b, tie))
            self._layout(items, 2 * self._cap, t)
            return
        self._put(i, item_id, a, b, tie)
        self._update_path(i, t)

    def delete(self, item_id: Hashable, t: float) -> bool:
        solo = self._solo
        if solo is not None and solo[0] == item_id:
            self._solo = None
            self._now(t)
            return True
        i = self._slot.pop(item_id, None)
        if i is None:
            return False
        t = self._now(t)
        leaf = i + self._cap
        self._win[leaf], self._melt[leaf], self._smin[leaf] = -1, INF, INF
        self._id[i] = self._tie[i] = None
        self._s[i] = INF
        self._release(i)
        self._update_path(i, t)
        return True

    def top(self, t: float) -> Hashable | None:
        t = self._now(t)
        if self._solo is not None:
            return self._solo[0]
        if self._melt[1] <= t:
            self._refresh(1, t)
        w = self._win[1]
        return None if w < 0 else self._id[w]

    def pop(self, t: float) -> Hashable | None:
        """Remove and return the winner at time t (None when empty)."""
        item = self.top(t)
        if item is not None:
            self.delete(item, t)
        return item
