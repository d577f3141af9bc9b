"""``drafts.DraftHistory``: the draft's records as one object; its batch operations equal the reference pushes.

Deterministic: 5 rows, 3 slots, events ``(2, 3)``, records from ``torch.Generator`` seed 0; equalities are
bitwise (every operation is a copy or a selection).
"""

from __future__ import annotations

import torch

from specsamp.drafts import DraftHistory

M, H, E = 5, 3, (2, 3)


def _filled(seed: int = 0) -> tuple[DraftHistory, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    h = DraftHistory.empty(torch.zeros(M, *E, dtype=torch.float64), H)
    for step in range(2):
        h.push(
            torch.arange(M),
            torch.randn(M, *E, generator=g, dtype=torch.float64),
            torch.full((M,), step),
            torch.randn(M, *E, generator=g, dtype=torch.float64),
        )
    return h, g


def test_empty_history_marks_every_slot_empty():
    h = DraftHistory.empty(torch.ones(M, *E), H)
    assert h.slots == H and torch.all(h.n == -1) and torch.all(h.x0 == 0) and torch.all(h.x == 0)
    assert h.x0.shape == (M, H, *E) and h.n.dtype == torch.long


def test_push_shifts_back_and_writes_in_front():
    h, _ = _filled()
    assert torch.equal(h.n, torch.tensor([[1, 0, -1]] * M))
    before = h.clone()
    rows = torch.tensor([0, 3])
    h.push(
        rows,
        torch.full((2, *E), 7.0, dtype=torch.float64),
        torch.tensor([5, 5]),
        torch.zeros(2, *E, dtype=torch.float64),
    )
    assert torch.equal(h.n[rows], torch.tensor([[5, 1, 0]] * 2))
    assert torch.equal(h.x0[rows, 1:], before.x0[rows, :-1])
    others = torch.tensor([1, 2, 4])
    assert torch.equal(h.x0[others], before.x0[others]) and torch.equal(h.n[others], before.n[others])


def test_prepend_equals_count_pushes_per_row():
    h, g = _filled()
    fresh = DraftHistory(
        torch.randn(M, H, *E, generator=g, dtype=torch.float64),
        torch.randint(2, 9, (M, H), generator=g),
        torch.randn(M, H, *E, generator=g, dtype=torch.float64),
    )
    count = torch.tensor([[0], [1], [2], [3], [1]])
    got = h.prepend(DraftHistory(fresh.x0.reshape(M, H, -1), fresh.n, fresh.x.reshape(M, H, -1)), count)
    want = h.clone()
    for r in range(M):  # fresh slot 0 is the most recent: push the oldest first
        for s in reversed(range(int(count[r]))):
            want.push(torch.tensor([r]), fresh.x0[r, s][None], fresh.n[r, s][None], fresh.x[r, s][None])
    for a, b in zip((got.x0, got.n, got.x), (want.x0, want.n, want.x)):
        assert torch.equal(a, b)


def test_take_put_and_where_select_rows():
    h, _ = _filled()
    rows = torch.tensor([4, 1])
    part = h.take(rows)
    part.push(
        torch.arange(2),
        torch.ones(2, *E, dtype=torch.float64),
        torch.tensor([9, 9]),
        torch.ones(2, *E, dtype=torch.float64),
    )
    assert torch.equal(h.n[rows], torch.tensor([[1, 0, -1]] * 2))  # take copies
    merged = h.clone()
    merged.put(rows, part)
    assert torch.equal(merged.n[rows, 0], torch.tensor([9, 9])) and torch.equal(merged.n[0], h.n[0])
    keep = torch.tensor([True, False, True, True, False])
    sel = h.where(keep, merged)
    assert torch.equal(sel.n, torch.where(keep[:, None], h.n, merged.n))
    assert torch.equal(sel.x0, torch.where(keep[:, None, None, None], h.x0, merged.x0))


def test_a_history_without_states_carries_none():
    h = DraftHistory(torch.zeros(2, 2, 3), torch.full((2, 2), -1))
    h.push(torch.tensor([0]), torch.ones(1, 3), torch.tensor([4]), torch.ones(1, 3))
    assert h.x is None and int(h.n[0, 0]) == 4 and h.take(torch.tensor([1])).x is None
