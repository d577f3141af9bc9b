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

# Named streams, so that different uses of the same node key never share numbers.
STREAMS = {
    "init": 1,  # initial noise at sigma = 1
    "step": 2,  # Euler--Maruyama noise of the standard sampler
    "draft": 3,  # noise of a drafted child
    "verify": 4,  # uniforms of the coupling at a parent node
    "label": 5,  # class labels of conditional image models
}


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    out = x >> s
    out &= (1 << (64 - s)) - 1
    return out


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 bit patterns (a bijection of 64-bit words).

    Args:
        x: int64 tensor, any shape.

    Returns:
        int64 tensor of the same shape.
    """
    z = x + _GOLDEN  # the only allocation besides the shifted temporaries; the rest is in place
    z ^= _srl(z, 30)
    z *= _MIX1
    z ^= _srl(z, 27)
    z *= _MIX2
    z ^= _srl(z, 31)
    return z


def fold(key: torch.Tensor, *parts: torch.Tensor | int) -> torch.Tensor:
    """Hash further integers into a key, elementwise with broadcasting.

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

    Args:
        seed: run seed (any Python int).
        index: trajectory indices, shape ``[n]``.
        stream: one of :data:`STREAMS`.
        device: torch device of the result.

    Returns:
        int64 tensor ``[n]``.

    Raises:
        ValueError: unknown stream.
    """
    if stream not in STREAMS:
        raise ValueError(f"stream={stream!r} is not one of {sorted(STREAMS)}")
    idx = torch.as_tensor(index, dtype=torch.int64, device=device)
    return fold(torch.full_like(idx, _signed(seed)), STREAMS[stream], idx)


def uniform(keys: torch.Tensor, m: int) -> torch.Tensor:
    """``m`` uniforms in the open interval (0, 1) per key.

    Args:
        keys: int64 tensor ``[*k]``.
        m: numbers per key.

    Returns:
        float64 tensor ``[*k, m]``; entry ``[..., j]`` depends only on the key and ``j``.
    """
    j = torch.arange(m, dtype=torch.int64, device=keys.device)
    h = fold(keys.unsqueeze(-1), j)
    top = _srl(h, 12).to(torch.float64)  # 52 random bits: (top + 0.5) 2^-52 is exact and < 1
    return (top + 0.5) * (2.0**-52)


def normal(keys: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Standard normals of event shape ``shape`` per key (Box--Muller).

    Args:
        keys: int64 tensor ``[*k]``.
        shape: event shape.

    Returns:
        float64 tensor ``[*k, *shape]``.
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    half = (numel + 1) // 2
    u = uniform(keys, 2 * half)
    u1, u2 = u[..., :half], u[..., half:]
    r = torch.sqrt(-2.0 * torch.log(u1))
    theta = (2.0 * torch.pi) * u2
    z = torch.cat([r * torch.cos(theta), r * torch.sin(theta)], dim=-1)[..., :numel]
    return z.reshape(*keys.shape, *shape)


class KeyedRows:
    """Per-row uniforms for a coupling, drawn from counter-based keys.

    Each call to :meth:`uniform` returns fresh numbers: the call count is folded into the key, so a
    coupling that asks for ``K`` acceptance uniforms and then one residual uniform gets independent
    numbers, and row ``i`` depends only on ``keys[i]``.

    Args:
        keys: int64 tensor ``[n]``, one key per parent node.
    """

    def __init__(self, keys: torch.Tensor):
        self.keys = keys
        self._calls = 0

    def uniform(self, m: int) -> torch.Tensor:
        """Return float64 uniforms ``[n, m]`` in (0, 1)."""
        self._calls += 1
        return uniform(fold(self.keys, self._calls), m)


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
