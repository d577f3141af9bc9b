"""Time grid and Euler--Maruyama kernel (appendix C.3, eqs. 36--38; docs/protocol.md).

The kernel is re-derived here independently of ``Schedule.mean``/``Schedule.std``:
eq. 36 ``m = y - gamma [(1 + eps^2) v + eps^2 y / (1 - sigma)]`` and eq. 37
``std = eps sqrt(2 gamma sigma / (1 - sigma))`` with ``gamma = sigma_n - sigma_{n+1}``.
Random test inputs use ``torch.Generator`` seed 0; all comparisons are float64 to 1e-12.
"""

import math

import pytest
import torch

from specsamp.schedule import Schedule, check_churn, shift_sigmas


@pytest.mark.parametrize("T", [3, 8, 30, 50, 100])
def test_grid_endpoints(T):
    s = Schedule.make(T, 0.3)
    assert s.sigmas.dtype == torch.float64
    assert s.sigmas.numel() == T + 1 and s.steps == T
    assert s.sigmas[0].item() == 1.0
    assert s.sigmas[T - 1].item() == pytest.approx(1e-3, abs=1e-15)
    assert s.sigmas[T].item() == 0.0
    assert torch.all(torch.diff(s.sigmas) < 0)
    # linspace(1, 0.001, T) then 0 (diffusers FlowMatchEuler grid)
    ref = [1.0 + (1e-3 - 1.0) * i / (T - 1) for i in range(T)] + [0.0]
    torch.testing.assert_close(s.sigmas, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-14)
    assert s.first_speculative == 1 and s.end_speculative == T - 1


def test_sigma_min():
    s = Schedule.make(10, 0.5, sigma_min=0.02)
    assert s.sigmas[-2].item() == pytest.approx(0.02, abs=1e-15)
    assert s.sigmas[-1].item() == 0.0


@pytest.mark.parametrize("kappa", [3.0, 0.5, 1.0])
def test_shift_eq38(kappa):
    T = 50
    base = torch.linspace(1.0, 1e-3, T, dtype=torch.float64)
    s = Schedule.make(T, 0.8, shift=kappa)
    want = kappa * base / (1.0 + (kappa - 1.0) * base)
    torch.testing.assert_close(s.sigmas[:-1], want, rtol=0, atol=1e-14)
    assert s.sigmas[0].item() == pytest.approx(1.0, abs=1e-15)  # the shift fixes 1
    assert s.sigmas[-1].item() == 0.0
    assert torch.all(torch.diff(s.sigmas) < 0)
    torch.testing.assert_close(shift_sigmas(base, kappa), want, rtol=0, atol=1e-15)
    if kappa > 1:  # SD3's kappa = 3 pushes the grid towards high noise
        assert torch.all(s.sigmas[1:-1] > base[1:])


def _eq36_mean(y, v, sig_n, sig_n1, eps):
    gamma = sig_n - sig_n1
    return y - gamma * ((1.0 + eps**2) * v + eps**2 * y / (1.0 - sig_n))


def _eq37_std(sig_n, sig_n1, eps):
    gamma = sig_n - sig_n1
    return eps * math.sqrt(2.0 * gamma * sig_n / (1.0 - sig_n))


@pytest.mark.parametrize("T,eps,shift", [(30, 0.1, 1.0), (8, 1.0, 1.0), (50, 0.8, 3.0), (3, 0.5, 1.0)])
def test_kernel_eq36_eq37(T, eps, shift):
    s = Schedule.make(T, eps, shift=shift)
    g = torch.Generator().manual_seed(0)
    b, d = 5, 7
    for n in range(1, T - 1):  # stochastic steps
        y = torch.randn(b, d, generator=g, dtype=torch.float64)
        v = torch.randn(b, d, generator=g, dtype=torch.float64)
        nn = torch.full((b,), n, dtype=torch.long)
        s0, s1 = s.sigmas[n].item(), s.sigmas[n + 1].item()
        torch.testing.assert_close(s.mean(y, v, nn), _eq36_mean(y, v, s0, s1, eps), rtol=1e-12, atol=1e-12)
        std = s.std(nn)
        assert std.dtype == torch.float64 and std.shape == (b,)
        torch.testing.assert_close(
            std, torch.full((b,), _eq37_std(s0, s1, eps), dtype=torch.float64), rtol=1e-12, atol=0
        )
        assert torch.all(std > 0)


def test_kernel_matches_score_form():
    # the kernel of eqs. 36-37: mean = x + (sigma_{n+1} - sigma_n)(v - eps^2 g^2 s / 2), s = -(x + (1 - sigma) v) / sigma,
    # g^2 = 2 sigma / (1 - sigma)
    s = Schedule.make(20, 0.6)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    v = torch.randn(4, 3, generator=g, dtype=torch.float64)
    for n in range(1, 19):
        sig, sig1 = s.sigmas[n].item(), s.sigmas[n + 1].item()
        score = -(x + (1 - sig) * v) / sig
        g2 = 2 * sig / (1 - sig)
        want = x + (sig1 - sig) * (v - 0.6**2 * g2 * score / 2)
        torch.testing.assert_close(s.mean(x, v, torch.full((4,), n)), want, rtol=1e-12, atol=1e-12)


def test_endpoints_are_deterministic_euler():
    T = 12
    s = Schedule.make(T, 0.7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    v = torch.randn(3, 5, generator=g, dtype=torch.float64)
    for n in (0, T - 1):
        nn = torch.full((3,), n)
        assert torch.all(s.std(nn) == 0)
        euler = x + (s.sigmas[n + 1] - s.sigmas[n]) * v
        torch.testing.assert_close(s.mean(x, v, nn), euler, rtol=0, atol=1e-15)
    # the first step from sigma = 1 lands at x - gamma v, the last lands at sigma = 0
    torch.testing.assert_close(s.mean(x, v, torch.zeros(3, dtype=torch.long)), x - (1 - s.sigmas[1]) * v)


def test_mixed_step_indices_and_dtype():
    # one call with rows at different steps, including both endpoints; float32 states stay float32
    T = 6
    s = Schedule.make(T, 0.9)
    g = torch.Generator().manual_seed(0)
    n = torch.tensor([0, 1, 3, 4, 5])
    x = torch.randn(5, 2, 2, generator=g, dtype=torch.float64)
    v = torch.randn(5, 2, 2, generator=g, dtype=torch.float64)
    out = s.mean(x, v, n)
    std = s.std(n)
    for i, k in enumerate(n.tolist()):
        s0, s1 = s.sigmas[k].item(), s.sigmas[k + 1].item()
        if k in (0, T - 1):
            want, want_std = x[i] + (s1 - s0) * v[i], 0.0
        else:
            want, want_std = _eq36_mean(x[i], v[i], s0, s1, 0.9), _eq37_std(s0, s1, 0.9)
        torch.testing.assert_close(out[i], want, rtol=1e-12, atol=1e-12)
        assert std[i].item() == pytest.approx(want_std, rel=1e-12, abs=0)
    out32 = s.mean(x.float(), v.float(), n)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out, rtol=1e-5, atol=1e-5)


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [2, 1, 0, -4, 2.5, 30.0, True])
def test_bad_steps(steps):
    with pytest.raises(ValueError, match=r"steps=.*>= 3"):
        Schedule.make(steps, 0.5)


@pytest.mark.parametrize("eps", [0, 0.0, 1.5, -0.1, float("nan"), True, "0.5"])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match=r"eps=.*\(0, 1\]"):
        Schedule.make(10, eps)
    with pytest.raises(ValueError, match="eps="):
        check_churn(eps)


def test_eps_one_is_valid():
    assert Schedule.make(5, 1).eps == 1.0
    assert check_churn(1.0) == 1.0


@pytest.mark.parametrize("shift", [0.0, -1.0, -3])
def test_bad_shift(shift):
    with pytest.raises(ValueError, match=r"shift=.*> 0"):
        Schedule.make(10, 0.5, shift=shift)


@pytest.mark.parametrize("sigma_min", [0.0, 1.0, -0.1, 1.5])
def test_bad_sigma_min(sigma_min):
    with pytest.raises(ValueError, match="sigma_min="):
        Schedule.make(10, 0.5, sigma_min=sigma_min)
