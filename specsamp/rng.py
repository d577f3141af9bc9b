"""Counter-based random numbers keyed by (seed, trajectory, step, node, stream).

Every random number the samplers use is a pure function of a key, not of the order in which
numbers were drawn. So a trajectory's samples do not depend on the batch it ran in, on how many
workers a sweep used, or on whether the ``tree`` or the ``path`` execution materialised the node:
the node with the same key gets the same noise in both.

The generator is SplitMix64 (Steele, Lea and Flood, 2014) applied to a running hash of the key
and the element index, with Box--Muller for normals. All integer arithmetic is on ``torch.int64``
(two's complement wraps like ``uint64``); outputs are ``float64``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """Return the int64 with the same bits as the uint64 constant ``c``."""
    c &= _MASK64
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)

# Named streams, so that different uses of the same node key never share numbers. The index goes
# into the top STREAM_BITS bits of the first word (see :func:`base_key`), so it must stay below
# 2**STREAM_BITS; append new streams, never renumber (that would change every committed number).
STREAMS = {
    "init": 1,  # initial noise at sigma = 1
    "step": 2,  # Euler--Maruyama noise of the standard sampler
    "draft": 3,  # noise of a drafted child
    "verify": 4,  # uniforms of the coupling at a parent node
    "label": 5,  # class labels of conditional image models
}
STREAM_BITS = 4
SEED_BITS = 64 - STREAM_BITS
MAX_SEED = (1 << SEED_BITS) - 1  # valid seeds: 0 <= seed <= MAX_SEED (2**60 - 1)

_ONE = 0x3FF0000000000000  # the bits of the float64 1.0 (its mantissa bits are 0)
_CHUNK = 1 << 15  # elements per in-place block of :func:`uniform` and :func:`normal` (cache sized)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 bit patterns (a bijection of 64-bit words).

    Args:
        x: int64 tensor, any shape.

    Returns:
        int64 tensor of the same shape.
    """
    return _mix64_(x + _GOLDEN, torch.empty_like(x))


def _mix64_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """``mix64(z - GOLDEN)`` computed in place in ``z`` (``tmp``: scratch of the same shape)."""
    for shift, mult in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp &= (1 << (64 - shift)) - 1
        z ^= tmp
        if mult is not None:
            z *= mult
    return z


def fold(key: torch.Tensor, *parts: torch.Tensor | int) -> torch.Tensor:
    """Hash further integers into a key, elementwise with broadcasting: ``h <- mix64(h ^ p)``.

    Each step is a bijection of ``h`` for a fixed part (and of the part for a fixed ``h``), so a chain
    of folds never merges two keys that differ in one part only; two keys that differ in earlier
    parts meet only if their 64-bit hashes happen to differ by exactly ``p ^ p'``, a chance of about
    ``2**-64`` per pair with no structure that small inputs could hit.

    Args:
        key: int64 tensor of keys.
        *parts: int64 tensors or Python ints to absorb, in order.

    Returns:
        int64 tensor, the broadcast shape of ``key`` and ``parts``.
    """
    h = key
    for p in parts:
        if isinstance(p, int):
            p = _signed(p)
        h = mix64(h ^ p)
    return h


def base_key(seed: int, index: torch.Tensor | Sequence[int], stream: str, device=None) -> torch.Tensor:
    """Keys for trajectories ``index`` of a run with ``seed`` in a named stream.

    The first word packs the stream's index into the top :data:`STREAM_BITS` bits and the seed into
    the rest, so distinct ``(seed, stream)`` pairs give distinct words, and ``mix64`` (a bijection)
    keeps them distinct; the trajectory index is then folded in (:func:`fold`). Seeds and streams
    are never combined by XOR of two free inputs.

    Args:
        seed: run seed, an integer in ``[0, MAX_SEED]``.
        index: trajectory indices, shape ``[n]``.
        stream: one of :data:`STREAMS`.
        device: torch device of the result.

    Returns:
        int64 tensor ``[n]``.

    Raises:
        ValueError: unknown stream, or a seed outside ``[0, MAX_SEED]``.
    """
    if stream not in STREAMS:
        raise ValueError(f"stream={stream!r} is not one of {sorted(STREAMS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r} is invalid: must be an integer in [0, {MAX_SEED}] (2**{SEED_BITS} - 1)")
    idx = torch.as_tensor(index, dtype=torch.int64, device=device)
    word = _signed((STREAMS[stream] << SEED_BITS) | seed)
    return fold(mix64(torch.full_like(idx, word)), idx)


def _blocks(keys: torch.Tensor, width: int):
    """Split the flat keys into row blocks of about ``_CHUNK`` elements of ``width`` (one block on GPUs)."""
    flat = keys.reshape(-1)
    rows = flat.numel() if flat.device.type != "cpu" else max(1, _CHUNK // max(width, 1))
    for a in range(0, flat.numel(), rows):
        yield a, flat[a : a + rows]


def _uniform_block(k: torch.Tensor, j: torch.Tensor, words: torch.Tensor, tmp: torch.Tensor, out: torch.Tensor):
    """Write ``uniform(k, m)`` into ``out [r, m]`` float64, using int64 scratch ``words`` and ``tmp``."""
    torch.bitwise_xor(k[:, None], j[None], out=words)
    words += _GOLDEN
    _mix64_(words, tmp)
    torch.bitwise_right_shift(words, 12, out=tmp)  # 52 random bits: (top + 0.5) 2^-52 is exact and < 1
    tmp &= (1 << 52) - 1
    tmp |= _ONE  # the float64 1 + top 2^-52 ...
    torch.sub(
        tmp.view(torch.float64), 1.0 - 2.0**-53, out=out
    )  # ... minus 1 - 2^-53, exactly (Sterbenz): (top + 0.5) 2^-52


def uniform(keys: torch.Tensor, m: int) -> torch.Tensor:
    """``m`` uniforms in the open interval (0, 1) per key.

    Entry ``j`` of key ``k`` is ``(top52(mix64(k ^ j)) + 1/2) 2^-52``. The work is done in place on
    cache-sized blocks of keys; the numbers do not depend on the blocking.

    Args:
        keys: int64 tensor ``[*k]``.
        m: numbers per key.

    Returns:
        float64 tensor ``[*k, m]``; entry ``[..., j]`` depends only on the key and ``j``.
    """
    out = torch.empty(keys.numel(), m, dtype=torch.float64, device=keys.device)
    j = torch.arange(m, dtype=torch.int64, device=keys.device)
    for a, k in _blocks(keys, m):
        words = torch.empty(k.numel(), m, dtype=torch.int64, device=keys.device)
        _uniform_block(k, j, words, torch.empty_like(words), out[a : a + k.numel()])
    return out.reshape(*keys.shape, m)


def normal(
    keys: torch.Tensor, shape: Sequence[int], dtype: torch.dtype = torch.float64, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Standard normals of event shape ``shape`` per key (Box--Muller on :func:`uniform`).

    With ``numel(shape) = N`` and ``h = ceil(N / 2)``, the key's uniforms ``u = uniform(key, 2h)``
    give ``r = sqrt(-2 log u[:h])``, ``theta = 2 pi u[h:]``, and the event is the first ``N`` entries
    of ``[r cos(theta), r sin(theta)]``, computed in float64 and then cast to ``dtype``. The work is
    blocked and in place (about 16 ns per number on one CPU core); the numbers do not depend on the
    blocking, on the other keys, or on ``dtype`` beyond the final rounding.

    Args:
        keys: int64 tensor ``[*k]``.
        shape: event shape.
        dtype: dtype of the result.
        out: optional contiguous tensor of ``keys.numel() * numel(shape)`` elements to write into
            (its dtype wins over ``dtype``); saves one copy when the caller owns the buffer.

    Returns:
        tensor ``[*k, *shape]`` of ``dtype`` (a view of ``out`` when given).
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    half = (numel + 1) // 2
    dev = keys.device
    if out is None:
        out = torch.empty(keys.numel(), numel, dtype=dtype, device=dev)
    else:
        out = out.view(keys.numel(), numel)
    j = torch.arange(2 * half, dtype=torch.int64, device=dev)
    scratch = None
    for a, k in _blocks(keys, 2 * half):
        r = k.numel()
        if scratch is None or scratch[0].shape[0] != r:
            scratch = (
                torch.empty(r, 2 * half, dtype=torch.int64, device=dev),
                torch.empty(r, 2 * half, dtype=torch.int64, device=dev),
                torch.empty(r, 2 * half, dtype=torch.float64, device=dev),
                torch.empty(r, half, dtype=torch.float64, device=dev),
            )
        words, tmp, u, trig = scratch
        _uniform_block(k, j, words, tmp, u)
        rad, theta = u[:, :half], u[:, half:]
        rad.log_()
        rad *= -2.0
        rad.sqrt_()
        theta *= 2.0 * torch.pi
        o = out[a : a + r]
        torch.cos(theta, out=trig)
        torch.mul(trig, rad, out=o[:, :half])  # float64 products, rounded once to the output's dtype
        torch.sin(theta, out=trig)
        if numel == 2 * half:
            torch.mul(trig, rad, out=o[:, half:])
        else:
            trig *= rad
            o[:, half:] = trig[:, : numel - half]
    return out.reshape(*keys.shape, *shape)


class KeyedRows:
    """Per-row uniforms for a coupling, drawn from counter-based keys.

    Each call to :meth:`uniform` returns fresh numbers: the call count is folded into the key, so a
    coupling that asks for ``K`` acceptance uniforms and then one residual uniform gets independent
    numbers, and row ``i`` depends only on ``keys[i]``: call ``c`` (from 1) returns
    ``uniform(fold(keys, c), m)``.

    Args:
        keys: int64 tensor ``[n]``, one key per parent node, or a function of no argument returning it
            (called at most once, and only when a call is not served by ``drawn``).
        drawn: optional pre-drawn numbers, a sequence whose entry ``c - 1`` is float64 ``[n, W_c]``
            ``uniform(fold(keys, c), W_c)`` (e.g. gathered from a per-run table, :func:`uniform_table`);
            call ``c`` with ``m <= W_c`` returns its first ``m`` columns (contiguous), any other call is drawn
            from the keys. The numbers are the same either way (entry ``j`` depends only on the key and ``j``).
    """

    def __init__(self, keys, drawn=None):
        self._keys = keys
        self._drawn = drawn
        self._calls = 0

    @property
    def keys(self) -> torch.Tensor:
        """int64 ``[n]`` the rows' keys."""
        if callable(self._keys):
            self._keys = self._keys()
        return self._keys

    def uniform(self, m: int) -> torch.Tensor:
        """Return float64 uniforms ``[n, m]`` in (0, 1)."""
        self._calls += 1
        if self._drawn is not None and self._calls <= len(self._drawn):
            d = self._drawn[self._calls - 1]
            if m == d.shape[1]:
                return d
            if m < d.shape[1]:
                return d[:, :m].contiguous()
        return uniform(fold(self.keys, self._calls), m)


def uniform_table(keys: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """The numbers :class:`KeyedRows` ``(keys)`` gives on its first ``len(widths)`` calls, drawn at once.

    Args:
        keys: int64 tensor ``[*k]``.
        widths: ``W_c`` per call ``c = 1, 2, ...``.

    Returns:
        list of float64 tensors ``[*k, W_c]``: entry ``c - 1`` is ``uniform(fold(keys, c), W_c)``, bit for bit
        (one fold and one draw for every call together: the integer arithmetic is elementwise and exact).
    """
    calls = torch.arange(1, len(widths) + 1, dtype=torch.int64, device=keys.device)
    folded = fold(keys[..., None], calls)  # [*k, C]
    u = uniform(folded, max(widths))  # [*k, C, W]
    return [u[..., c, :w].contiguous() for c, w in enumerate(widths)]


class GeneratorRows:
    """Per-row uniforms from a ``torch.Generator`` (or the global generator when ``None``).

    Args:
        n: number of rows.
        device: device of the result.
        generator: optional ``torch.Generator``.
    """

    def __init__(self, n: int, device, generator: torch.Generator | None = None):
        self.n, self.device, self.generator = n, device, generator

    def uniform(self, m: int) -> torch.Tensor:
        """Return float64 uniforms ``[n, m]`` in (0, 1)."""
        u = torch.rand(self.n, m, dtype=torch.float64, device=self.device, generator=self.generator)
        # torch.rand is in [0, 1): move an exact 0 inside the interval.
        return u.clamp_min(2.0**-60)


# The speculative round's keyed numbers, stated once for both layouts and the per-run tables. A round of row
# (trajectory) i at root step n has the key fold(k_i, n) per stream (``draft``, ``verify``); node v of its tree
# has fold(fold(k_i, n), v). A node's draft noise and its verification uniforms are functions of that key alone,
# so the sparse and dense layouts, and the tables drawn once per run, give the same numbers.


def round_keys(stream_keys: torch.Tensor, steps) -> torch.Tensor:
    """The keys of rounds: ``fold(k, n)`` of a row's stream key ``k`` and the round's root step ``n`` (broadcast)."""
    return fold(stream_keys, steps)


def node_keys(keys_of_round: torch.Tensor, nodes) -> torch.Tensor:
    """The keys of a round's nodes: ``fold(key of the round, v)`` (broadcast, as :func:`fold`)."""
    return fold(keys_of_round, nodes)


def draft_noise(
    keys: torch.Tensor, event, dtype: torch.dtype = torch.float64, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The draft noise ``z ~ N(0, I)`` of nodes from their keys (:func:`node_keys` of the ``draft`` stream), in
    the states' ``dtype`` (or into ``out``): a child is its parent's proposal mean plus ``std z``."""
    return normal(keys, event, dtype=dtype, out=out)


def verify_widths(num_children) -> tuple[int, int]:
    """The widths of a verification's first two calls of :class:`KeyedRows` that a round draws at once: ``K_max``
    (at least 1) and 1, D-GRS's acceptance and residual uniforms (the reflection coupling reads the first)."""
    return max(int(max(num_children)), 1), 1


def verify_uniforms(keys: torch.Tensor, widths) -> list[torch.Tensor]:
    """The verification uniforms of nodes from their keys (:func:`node_keys` of the ``verify`` stream), the
    first ``len(widths)`` calls at once (:func:`uniform_table`); a verification reads them through
    :class:`KeyedRows` ``(keys, drawn)``, which draws any further call from the keys."""
    return uniform_table(keys, widths)
