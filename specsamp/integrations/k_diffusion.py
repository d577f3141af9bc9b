"""k-diffusion's and ComfyUI's stochastic samplers, exact and speculative, with their calling convention.

Each function takes what its k-diffusion (or ComfyUI) namesake takes, the function ComfyUI hands to
``comfy.samplers.KSAMPLER``, and returns the same thing: ``model(x, sigma, **extra_args) -> x0`` a denoiser, ``x`` the
first state at ``sigmas[0]``, ``sigmas`` decreasing to 0. Each step is a registered kernel's Gaussian transition, run
by :func:`specsamp.integrations.kdriver.sample_with_kernel`, whose documentation gives the shared arguments (the
callback, ``extra_args``, ``stats``), the speculative options (``K``, ``L``, ``coupling``, ``budget``, ``execution``,
``seed``, ...) and the errors:

======================================  ===========================  ================================================
function                                ComfyUI sampler name         kernel
======================================  ===========================  ================================================
:func:`sample_euler_ancestral`          ``euler_ancestral``          ``euler_ancestral``; flow: ``euler_ancestral_rf``
:func:`sample_euler_ancestral_RF`       (its flow form)              ``euler_ancestral_rf`` (:mod:`specsamp.ancestral`)
:func:`sample_dpmpp_2m_sde`             ``dpmpp_2m_sde`` (+ _gpu)    ``dpmpp_2m_sde`` (:mod:`specsamp.dpmpp`)
:func:`sample_dpmpp_3m_sde`             ``dpmpp_3m_sde`` (+ _gpu)    ``dpmpp_3m_sde``
:func:`sample_ddpm`                     ``ddpm``                     ``ddpm``
:func:`sample_lcm`                      ``lcm``                      ``lcm`` (:mod:`specsamp.ancestral`)
:func:`sample_er_sde`                   ``er_sde``                   ``er_sde`` (:mod:`specsamp.ersde`)
:func:`sample_res_multistep_ancestral`  ``res_multistep_ancestral``  ``res_multistep_ancestral``
======================================  ===========================  ================================================

k-diffusion and ComfyUI are not imported: their conventions are reproduced here, their code is not used.
"""

from __future__ import annotations

from .. import arguments
from ..ancestral import LCM, EulerAncestralRF
from ..dpmpp import DPMPP2MSDE, DPMPP3MSDE, SOLVER_TYPES
from ..errors import ConfigError
from ..ersde import ERSDE, RESMultistepAncestral
from ..kernels import DDPM, EulerAncestral
from .kdriver import COORDS, _positive, is_flow, node_maxima, sample_with_kernel  # noqa: F401  (public here)


def sample_euler_ancestral(
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    eta=1.0,
    s_noise=1.0,
    noise_sampler=None,
    **speculative,
):
    """k-diffusion's Euler ancestral sampler, exact and speculative: the same law, fewer network calls.

    Each step is the ``euler_ancestral`` kernel (:class:`specsamp.kernels.EulerAncestral`); the run is
    :func:`sample_with_kernel`'s, whose documentation gives every argument, the speculative options and the errors.
    A ComfyUI flow model (``model_sampling`` CONST) runs :func:`sample_euler_ancestral_RF`, as ComfyUI's does.

    Args:
        eta: the ancestral noise's share, > 0 (k-diffusion's ``get_ancestral_step``; 1: the full ancestral step).
        s_noise: the noise's scale, > 0.

    Returns:
        ``[b, ...]`` the samples at sigma = 0, in ``x``'s dtype, shape and device: what k-diffusion returns.
    """
    if is_flow(model):  # as ComfyUI does: a flow model's ancestral step is the rectified-flow one
        return sample_euler_ancestral_RF(
            model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler, **speculative
        )
    options = {"eta": _positive("eta", eta), "s_noise": _positive("s_noise", s_noise)}
    return sample_with_kernel(
        EulerAncestral.name,
        model,
        x,
        sigmas,
        extra_args,
        callback,
        disable,
        noise_sampler,
        kernel_options=options,
        caller="sample_euler_ancestral",
        **speculative,
    )


def sample_dpmpp_2m_sde(
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    eta=1.0,
    s_noise=1.0,
    noise_sampler=None,
    solver_type="midpoint",
    **speculative,
):
    """k-diffusion's DPM-Solver++(2M) SDE (``sample_dpmpp_2m_sde``; ComfyUI's ``dpmpp_2m_sde`` and ``_gpu``), exact and
    speculative.

    Each step is the ``dpmpp_2m_sde`` kernel (:class:`specsamp.dpmpp.DPMPP2MSDE`), a multistep kernel whose mean reads
    the previous step's data prediction; the run is :func:`sample_with_kernel`'s, whose documentation gives every
    argument, the speculative options and the errors. k-diffusion's Brownian-tree noise is independent across steps, so
    one trajectory's law is the same with the keyed Gaussian noise used here.

    Args:
        eta: the noise's share, > 0 (0 is the deterministic DPM-Solver++(2M), where speculation is vacuous).
        s_noise: the noise's scale, > 0.
        solver_type: ``midpoint`` (the default) or ``heun``: the second-order correction's form.

    Returns:
        ``[b, ...]`` the samples at sigma = 0, in ``x``'s dtype, shape and device.
    """
    solver_type = arguments.choice("solver_type", solver_type, SOLVER_TYPES)
    options = {"eta": _positive("eta", eta), "s_noise": _positive("s_noise", s_noise), "solver_type": solver_type}
    return sample_with_kernel(
        DPMPP2MSDE.name,
        model,
        x,
        sigmas,
        extra_args,
        callback,
        disable,
        noise_sampler,
        kernel_options=options,
        caller="sample_dpmpp_2m_sde",
        **speculative,
    )


def sample_dpmpp_3m_sde(
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    eta=1.0,
    s_noise=1.0,
    noise_sampler=None,
    **speculative,
):
    """k-diffusion's DPM-Solver++(3M) SDE (``sample_dpmpp_3m_sde``; ComfyUI's ``dpmpp_3m_sde`` and ``_gpu``), exact and
    speculative: the ``dpmpp_3m_sde`` kernel (:class:`specsamp.dpmpp.DPMPP3MSDE`, reading the two previous steps' data
    predictions) run by :func:`sample_with_kernel`, whose documentation gives every argument and error.

    Args:
        eta: the noise's share, > 0.
        s_noise: the noise's scale, > 0.

    Returns:
        ``[b, ...]`` the samples at sigma = 0, in ``x``'s dtype, shape and device.
    """
    options = {"eta": _positive("eta", eta), "s_noise": _positive("s_noise", s_noise)}
    return sample_with_kernel(
        DPMPP3MSDE.name,
        model,
        x,
        sigmas,
        extra_args,
        callback,
        disable,
        noise_sampler,
        kernel_options=options,
        caller="sample_dpmpp_3m_sde",
        **speculative,
    )


def sample_ddpm(model, x, sigmas, extra_args=None, callback=None, disable=None, noise_sampler=None, **speculative):
    """ComfyUI's ``sample_ddpm`` (its ``ddpm`` sampler), exact and speculative.

    ComfyUI's step, for a variance-exploding denoiser: at ``sigma -> sigma'`` with ``a = 1 / (1 + sigma^2)``,
    ``a' = 1 / (1 + sigma'^2)``, ``alpha = a / a'``, ``eps = (x - D) / sigma`` and the variance-preserving state
    ``x / sqrt(1 + sigma^2)``, the ancestral DDPM step
    ``mu = (x_vp - (1 - alpha) eps / sqrt(1 - a)) / sqrt(alpha) + sqrt((1 - alpha)(1 - a') / (1 - a)) z`` (noise where
    ``sigma' > 0``), rescaled by ``sqrt(1 + sigma'^2)``. That is the posterior step of Ho et al. (2020) with the
    ``fixed_small`` variance on the cumulative alphas ``a`` of the caller's sigmas: the ``ddpm`` kernel
    (:class:`specsamp.kernels.DDPM`) on those levels, with no noise at the step to 0. Arguments, options, return
    value and errors: :func:`sample_with_kernel`.
    """
    return sample_with_kernel(
        DDPM.name,
        model,
        x,
        sigmas,
        extra_args,
        callback,
        disable,
        noise_sampler,
        kernel_options={"variance_type": "fixed_small", "final_noise": False},
        caller="sample_ddpm",
        **speculative,
    )


def sample_euler_ancestral_RF(  # noqa: N802  (ComfyUI's name)
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    eta=1.0,
    s_noise=1.0,
    noise_sampler=None,
    **speculative,
):
    """ComfyUI's Euler ancestral sampler for flow models (``sample_euler_ancestral_RF``), exact and speculative.

    ``model`` is a flow model's denoiser: states ``x = (1 - sigma) x0 + sigma noise``, ``sigmas`` in ``(0, 1]``
    decreasing to 0 (ComfyUI's flow sigmas, SD3's and Flux's shifted ones). Each step is the ``euler_ancestral_rf``
    kernel (:class:`specsamp.ancestral.EulerAncestralRF`); the run is :func:`sample_with_kernel`'s, whose
    documentation gives every argument and error. ComfyUI scales ``s_noise`` by the model's ``noise_scale`` where
    its ``model_sampling`` has one; here ``s_noise`` is taken as given.

    Args:
        eta: the ancestral noise's share, > 0 (1: the step renoises the data prediction to the next level); a value
            whose step down falls to 0 on the grid is refused.
        s_noise: the noise's scale, > 0.

    Returns:
        ``[b, ...]`` the samples at sigma = 0, in ``x``'s dtype, shape and device.
    """
    options = {"eta": _positive("eta", eta), "s_noise": _positive("s_noise", s_noise)}
    _check_grid(EulerAncestralRF, sigmas, options, "sample_euler_ancestral_RF")
    return sample_with_kernel(
        EulerAncestralRF.name,
        model,
        x,
        sigmas,
        extra_args,
        callback,
        disable,
        noise_sampler,
        kernel_options=options,
        coords="linear",
        caller="sample_euler_ancestral_RF",
        **speculative,
    )


def sample_lcm(
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    noise_sampler=None,
    s_noise=1.0,
    s_noise_end=None,
    noise_clip_std=0.0,
    **speculative,
):
    """ComfyUI's (and k-diffusion's) LCM sampler (``sample_lcm``), exact and speculative: each step the data prediction,
    renoised to the next level by the model's own noise scaling (the ``lcm`` kernel, :class:`specsamp.ancestral.LCM`),
    for a variance-exploding denoiser or a ComfyUI flow model alike; the run is :func:`sample_with_kernel`'s.

    Args:
        s_noise, s_noise_end: the noise's scale at the first and the last step, > 0, linear between (ComfyUI's;
            ``s_noise_end=None``: ``s_noise`` throughout).
        noise_clip_std: must be 0: ComfyUI's clipped noise is not Gaussian, so no exact kernel has it.

    Returns:
        ``[b, ...]`` the samples at sigma = 0, in ``x``'s dtype, shape and device.
    """
    if noise_clip_std != 0:
        raise arguments.refuse(
            "noise_clip_std",
            noise_clip_std,
            "must be 0 (clipped noise is not Gaussian, so speculation cannot be exact)",
        )
    options = {"s_noise": _positive("s_noise", s_noise)}
    if s_noise_end is not None:
        options["s_noise_end"] = _positive("s_noise_end", s_noise_end)
    return sample_with_kernel(
        LCM.name,
        model,
        x,
        sigmas,
        extra_args,
        callback,
        disable,
        noise_sampler,
        kernel_options=options,
        coords="linear" if is_flow(model) else "ve",
        caller="sample_lcm",
        **speculative,
    )


def _check_grid(kernel, sigmas, options: dict, caller: str) -> None:
    """Build ``kernel`` on ``sigmas`` (a flow model's levels, unchecked beyond a tensor) so that an option the grid
    cannot take is refused before any call, as a ConfigError naming it."""
    import torch

    try:
        s = torch.as_tensor(sigmas).detach().to("cpu", torch.float64)
        if s.ndim != 1 or s.numel() < 2 or not bool(torch.isfinite(s).all()) or not bool((s[:-1] > 0).all()):
            return  # the driver refuses the grid itself, naming sigmas
        kernel(s, 1.0, **options)
    except (TypeError, RuntimeError):
        return
    except ValueError as e:
        raise ConfigError(f"{e} ({caller}).") from None


def sample_er_sde(
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    s_noise=1.0,
    noise_sampler=None,
    noise_scaler=None,
    max_stage=3,
    **speculative,
):
    """ComfyUI's ER-SDE solver (``sample_er_sde``; its ``er_sde`` sampler and the ``SamplerER_SDE`` node's ER-SDE and
    reverse-time SDE forms, by their ``noise_scaler``), exact and speculative: each step the ``er_sde`` kernel
    (:class:`specsamp.ersde.ERSDE`, reading the two previous steps' data predictions), for a variance-exploding
    denoiser or a ComfyUI flow model alike; the run is :func:`sample_with_kernel`'s. A flow model's first level 1 is
    moved to its ``model_sampling.percent_to_sigma(1e-4)``, as ComfyUI does (the state ``x`` is kept).

    Args:
        s_noise: the noise's scale, > 0.
        noise_scaler: ``phi(lambda)``, a function of a float64 tensor (None: ComfyUI's default
            ``lambda (exp(lambda^0.3) + 10)``); refused where a step would have no noise (the ODE form).
        max_stage: 1, 2 or 3: the highest stage (order) used.

    Returns:
        ``[b, ...]`` the samples at sigma = 0, in ``x``'s dtype, shape and device.
    """
    if isinstance(max_stage, bool) or max_stage not in (1, 2, 3):
        raise arguments.refuse("max_stage", max_stage, "must be 1, 2 or 3")
    arguments.function("noise_scaler", noise_scaler, optional=True)
    options = {"s_noise": _positive("s_noise", s_noise), "max_stage": int(max_stage), "noise_scaler": noise_scaler}
    flow = is_flow(model)
    if flow:
        sigmas = _offset_first_sigma(model, sigmas)
    _check_grid(ERSDE, _linear_levels(sigmas, flow), options, "sample_er_sde")
    return sample_with_kernel(
        ERSDE.name,
        model,
        x,
        sigmas,
        extra_args,
        callback,
        disable,
        noise_sampler,
        kernel_options=options,
        coords="linear" if flow else "ve",
        caller="sample_er_sde",
        **speculative,
    )


def sample_res_multistep_ancestral(
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    eta=1.0,
    s_noise=1.0,
    noise_sampler=None,
    **speculative,
):
    """ComfyUI's ancestral RES multistep (``sample_res_multistep_ancestral``), exact and speculative: each step the
    ``res_multistep_ancestral`` kernel (:class:`specsamp.ersde.RESMultistepAncestral`, reading the previous step's data
    prediction); for a ComfyUI flow model the update in its own coordinates, as ComfyUI runs it. The run is
    :func:`sample_with_kernel`'s.

    Args:
        eta: the ancestral noise's share, > 0 (0 is ComfyUI's deterministic ``res_multistep``).
        s_noise: the noise's scale, > 0.

    Returns:
        ``[b, ...]`` the samples at sigma = 0, in ``x``'s dtype, shape and device.
    """
    flow = is_flow(model)
    options = {"eta": _positive("eta", eta), "s_noise": _positive("s_noise", s_noise), "flow": flow}
    _check_grid(RESMultistepAncestral, _linear_levels(sigmas, flow), options, "sample_res_multistep_ancestral")
    return sample_with_kernel(
        RESMultistepAncestral.name,
        model,
        x,
        sigmas,
        extra_args,
        callback,
        disable,
        noise_sampler,
        kernel_options=options,
        coords="linear" if flow else "ve",
        caller="sample_res_multistep_ancestral",
        **speculative,
    )


def _linear_levels(sigmas, flow: bool):
    """The caller's ``sigmas`` on the linear path (a flow model's unchanged; else ``sigma / (1 + sigma)``), or
    ``sigmas`` itself where it is no tensor of levels (the driver refuses it, naming it)."""
    import torch

    try:
        s = torch.as_tensor(sigmas).detach().to("cpu", torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return sigmas
    return s if flow else s / (1.0 + s)


def _offset_first_sigma(model, sigmas):
    """ComfyUI's ``offset_first_sigma_for_snr``: a flow model's first level at or above 1 becomes
    ``model_sampling.percent_to_sigma(1e-4)``; ConfigError where the model has no such method."""
    import torch

    try:
        s = torch.as_tensor(sigmas).detach().clone()
    except (TypeError, ValueError, RuntimeError):
        return sigmas
    if s.ndim != 1 or s.numel() < 2 or not float(s[0]) >= 1.0:
        return sigmas
    sampling = model.inner_model.inner_model.model_sampling
    if not callable(getattr(sampling, "percent_to_sigma", None)):
        raise ConfigError(
            f"sigmas[0]={float(s[0])!r} is invalid for this flow model: ER-SDE needs a first level below 1, and "
            "ComfyUI takes it from model_sampling.percent_to_sigma(1e-4), which this model does not have."
        )
    s[0] = float(sampling.percent_to_sigma(1e-4))
    return s
