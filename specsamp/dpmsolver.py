"""diffusers' ``DPMSolverMultistepScheduler`` with ``algorithm_type="sde-dpmsolver++"`` as a kernel with history
(DPM-Solver++ SDE, Lu et al. 2022, arXiv:2211.01095, as ``DPMSolverMultistepScheduler.step`` writes it).

The scheduler's levels are its ``sigmas`` (``s = sqrt((1 - a) / a)``, whatever spacing ``set_timesteps`` made:
Karras, exponential, beta, Lu lambdas, or the timesteps' own), with ``alpha = 1 / sqrt(1 + s^2)``,
``sigma_vp = s alpha``, ``lambda = log(alpha / sigma_vp) = -log s``. With ``h = lambda_{n+1} - lambda_n`` and
``e = 1 - exp(-2h)``, the step from ``s_n`` to ``s_{n+1}`` in the coordinates ``y = alpha x0 + sigma_vp xi`` is::

    y' = (sigma_vp' / sigma_vp) exp(-h) y + alpha' e D0 + c1 D1 [+ c2 D2] + sigma_vp' sqrt(e) z,

``m0, m1, m2`` the data predictions of this and the two earlier steps (thresholded where the config asks: what the
scheduler stores in ``model_outputs``), ``r0 = h_{n-1} / h``, ``r1 = h_{n-2} / h``:

* first order: no ``D1``, ``D2``;
* second order: ``D1 = (m0 - m1) / r0``, ``c1 = alpha' e / 2`` (``solver_type="midpoint"``) or
  ``alpha' (e / (-2h) + 1)`` (``heun``);
* third order: ``D1_0 = (m0 - m1) / r0``, ``D1_1 = (m1 - m2) / r1``, ``D1 = D1_0 + r0 / (r0 + r1) (D1_0 - D1_1)``,
  ``D2 = (D1_0 - D1_1) / (r0 + r1)``, ``c1 = alpha' (e / (-2h) + 1)``, ``c2 = alpha' ((e - 2h) / (2h)^2 - 1/2)``.

Each step's order is the scheduler's (:func:`step_orders`: ``lower_order_nums`` at the first steps,
``lower_order_final``, ``euler_at_final``, ``final_sigmas_type``). The mean is ``c_x x + c_x0 m0 + c_h m1 +
c_h2 m2`` on the linear path ``x = y / k``, ``k = alpha + sigma_vp`` (1 after the last step: the pipeline returns
``y``), a zero column where the step's order does not read that output.
"""

from __future__ import annotations

import torch

from .kernels import DataPredictionKernel, SchedulerLevels, config_value, linear_levels, refuse, register_kernel

NAME = "DPMSolverMultistepScheduler"
PREDICTIONS = ("epsilon", "sample", "v_prediction")
SOLVER_TYPES = ("midpoint", "heun")
SUPPORTED_TEXT = (
    'supported: algorithm_type="sde-dpmsolver++" with solver_order 1, 2 or 3, solver_type midpoint or heun, '
    "prediction_type epsilon, sample or v_prediction, any sigma spacing (Karras, exponential, beta, Lu lambdas), "
    "final_sigmas_type zero or sigma_min, thresholding"
)


def step_orders(
    steps: int, solver_order: int, lower_order_final: bool, euler_at_final: bool, final_zero: bool
) -> list[int]:
    """The order of each of ``steps`` steps as ``DPMSolverMultistepScheduler.step`` picks it: the first steps lower
    (``lower_order_nums``), the last first order where ``euler_at_final``, ``final_sigmas_type="zero"`` or
    ``lower_order_final`` with fewer than 15 steps, the one before it at most second order in that last case."""
    orders = []
    for i in range(steps):
        final = i == steps - 1 and (euler_at_final or (lower_order_final and steps < 15) or final_zero)
        second = i == steps - 2 and lower_order_final and steps < 15
        done = min(i, solver_order)  # lower_order_nums before step i
        if solver_order == 1 or done < 1 or final:
            orders.append(1)
        elif solver_order == 2 or done < 2 or second:
            orders.append(2)
        else:
            orders.append(3)
    return orders


@register_kernel("dpmsolver_sde")
class DPMSolverSDE(DataPredictionKernel):
    """DPM-Solver++ SDE as ``DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++")`` steps (module
    docstring). Order ``solver_order``: the mean reads the data predictions of ``solver_order - 1`` earlier steps.

    Options: ``solver_order`` (1 to 3), ``solver_type`` (``midpoint``, ``heun``), ``orders`` (each step's order,
    default :func:`step_orders` with ``lower_order_final=True`` and a final step to 0), ``final_sigma`` (the
    scheduler's last sigma: 0, or ``sigma_min`` for ``final_sigmas_type="sigma_min"``), ``threshold``.
    """

    columns = ("c_x", "c_x0", "c_h", "c_h2", "sigma", "std", "lsnr")
    schedulers = (NAME,)
    scheduler_note = 'DPMSolverMultistepScheduler with algorithm_type="sde-dpmsolver++"'
    scheduler_flags = {"algorithm_type": "sde-dpmsolver++"}
    reads_shift = False

    @classmethod
    def read_scheduler(cls, sch, steps: int, *, event_ndim: int = 3, mu=None, **options) -> SchedulerLevels:
        checks = (
            ("algorithm_type", "dpmsolver++", lambda v: v == "sde-dpmsolver++", "is deterministic or not reproduced"),
            ("solver_order", 2, lambda v: v in (1, 2, 3), "is not 1, 2 or 3"),
            ("solver_type", "midpoint", lambda v: v in SOLVER_TYPES, "is not midpoint or heun"),
            ("prediction_type", "epsilon", lambda v: v in PREDICTIONS, "is not epsilon, sample or v_prediction"),
            ("variance_type", None, lambda v: v is None, "(a learned variance) depends on the state"),
            ("use_flow_sigmas", False, lambda v: not v, "(flow sigmas) is not reproduced"),
        )
        for key, default, ok, why in checks:
            value = config_value(sch, key, default)
            if not ok(value):
                raise refuse(NAME, f"{key}={value!r} {why} ({SUPPORTED_TEXT})")
        sch.set_timesteps(steps)
        sig = sch.sigmas.to(torch.float64)
        s = linear_levels(sig[:-1] / (1.0 + sig[:-1]))
        final_sigma = float(sig[-1])
        order = int(config_value(sch, "solver_order"))
        opts = {
            "solver_order": order,
            "solver_type": config_value(sch, "solver_type"),
            "orders": step_orders(
                steps,
                order,
                bool(config_value(sch, "lower_order_final", True)),
                bool(config_value(sch, "euler_at_final", False)),
                config_value(sch, "final_sigmas_type", "zero") == "zero",
            ),
            "final_sigma": final_sigma,
            "event_ndim": event_ndim,
        }
        if config_value(sch, "thresholding", False):
            opts["threshold"] = (
                float(config_value(sch, "dynamic_thresholding_ratio")),
                float(config_value(sch, "sample_max_value")),
            )
        k0 = float((1.0 + sig[0]) / (1.0 + sig[0] ** 2).sqrt())  # alpha + sigma_vp at the first level
        return SchedulerLevels(
            s, opts, sch.timesteps.clone(), "vp", config_value(sch, "prediction_type", "epsilon"), 1.0 / k0
        )

    def __init__(
        self,
        sigmas,
        eps,
        solver_order: int = 2,
        solver_type: str = "midpoint",
        orders=None,
        final_sigma: float = 0.0,
        **options,
    ):
        super().__init__(sigmas, eps, **options)
        if solver_order not in (1, 2, 3) or solver_type not in SOLVER_TYPES:
            raise ValueError(
                f"solver_order={solver_order!r}, solver_type={solver_type!r}: need 1, 2 or 3 and midpoint or heun"
            )
        self.order, self.solver_type = int(solver_order), solver_type
        self.orders = list(orders) if orders is not None else step_orders(self.steps, self.order, True, False, True)
        if len(self.orders) != self.steps or max(self.orders) > self.order or min(self.orders) < 1:
            raise ValueError(f"orders={self.orders!r}: need {self.steps} orders in [1, {self.order}]")
        self.final_sigma = float(final_sigma)

    def sigmas_ve(self) -> torch.Tensor:
        """float64 ``[T + 1]``: the scheduler's sigmas ``s`` (the last one ``final_sigma``)."""
        s = self.sigmas / (1.0 - self.sigmas)
        s[-1] = self.final_sigma
        return s

    def level_scale(self) -> torch.Tensor:
        s = self.sigmas / (1.0 - self.sigmas)
        return (1.0 + s) / (1.0 + s * s).sqrt()  # alpha + sigma_vp; 1 at the grid's final 0

    def columns64(self, device) -> dict[str, torch.Tensor]:
        s = self.sigmas_ve().to(device)
        alpha = 1.0 / (1.0 + s * s).sqrt()
        svp = s * alpha
        s0, s1 = s[:-1], s[1:]
        last = s1 == 0  # a step to sigma 0: y' = m0 (h infinite)
        one = torch.ones_like(s0)
        h = torch.where(last, one, torch.log(s0) - torch.log(torch.where(last, one, s1)))
        h_prev = torch.cat([one[:1], torch.log(s[:-2]) - torch.log(s[1:-1])])  # h_{n-1}; step 0 never reads it
        h_prev2 = torch.cat([one[:2], h_prev[1:-1]])  # h_{n-2}
        e = -torch.expm1(-2.0 * h)
        a1 = alpha[1:]
        A = torch.where(last, 0 * one, svp[1:] / svp[:-1] * torch.exp(-h))
        B = torch.where(last, one, a1 * e)
        S = torch.where(last, 0 * one, svp[1:] * e.sqrt())
        r0, r1 = h_prev / h, h_prev2 / h
        heun = a1 * (e / (-2.0 * h) + 1.0)
        c2nd = 0.5 * B if self.solver_type == "midpoint" else heun
        c3rd = a1 * ((e - 2.0 * h) / (2.0 * h) ** 2 - 0.5)
        # third order: D1_0 = (m0 - m1) / r0 weighs u, D1_1 = (m1 - m2) / r1 weighs w
        u = heun * (1.0 + r0 / (r0 + r1)) + c3rd / (r0 + r1)
        w = -heun * r0 / (r0 + r1) - c3rd / (r0 + r1)
        order = torch.tensor(self.orders, device=device)
        zero = 0 * one
        m0 = torch.where(order == 1, B, torch.where(order == 2, B + c2nd / r0, B + u / r0))
        m1 = torch.where(order == 1, zero, torch.where(order == 2, -c2nd / r0, -u / r0 + w / r1))
        m2 = torch.where(order == 3, -w / r1, zero)
        k = self.level_scale().to(device)
        return {
            "c_x": A * k[:-1] / k[1:],
            "c_x0": m0 / k[1:],
            "c_h": m1 / k[1:],
            "c_h2": m2 / k[1:],
            "sigma": self.sigmas.to(device)[:-1],
            "std": S / k[1:],
        }

    def record(self, x: torch.Tensor, out: torch.Tensor, c: dict) -> torch.Tensor:
        return self.clip_x0(x - c["sigma"] * out)

    def mean(self, x: torch.Tensor, out: torch.Tensor, c: dict, history: tuple | None = None) -> torch.Tensor:
        d = self.record(x, out, c)
        if self.order == 1:
            return c["c_x"] * x + c["c_x0"] * d
        p1 = d if history is None else history[0]  # None (a draft): the first-order form
        if self.order == 2:
            return c["c_x"] * x + c["c_x0"] * d + c["c_h"] * p1
        p2 = d if history is None else history[1]
        return c["c_x"] * x + c["c_x0"] * d + c["c_h"] * p1 + c["c_h2"] * p2
