"""The driver of the k-diffusion-style samplers (:mod:`specsamp.integrations.k_diffusion`): any registered kernel run
with k-diffusion's calling convention, exact and speculative.

:func:`sample_with_kernel` takes what k-diffusion's samplers take (the function ComfyUI hands to
``comfy.samplers.KSAMPLER``): a denoiser ``model(x, sigma, **extra_args) -> x0``, the first state ``x`` at
``sigmas[0]``, a decreasing ``sigmas`` ending at 0, in the model's coordinates (variance exploding, ``x = x0 + sigma
noise``, or a flow model's ``x = (1 - sigma) x0 + sigma noise``). The steps are written on the linear path (levels
``s = sigma / (1 + sigma)``, states ``x / (1 + sigma)`` for the first; unchanged for the second), the same law; the
speculative sampler (:func:`specsamp.sampler.sample_speculative`) draws from that chain's law in fewer network calls.
What differs from k-diffusion's own loop is the source of the noise (keyed by seed, row and step, not
``torch.randn_like``) and when the callback runs (:func:`sample_with_kernel`, ``callback``).
"""

from __future__ import annotations

import torch

from .. import arguments
from ..autosample import runs_auto
from ..coupling import get_coupling
from ..drafts import get_draft
from ..errors import ConfigError
from ..models.parametrisation import GridTimesteps, Parametrised
from ..sampler import sample_speculative
from ..schedule import Schedule
from ..trees import DraftTree


def node_maxima(
    event_shape=(4, 64, 64), dtype: torch.dtype = torch.float32, available: int = 24 * 2**30, steps: int = 20
) -> tuple[int, int]:
    """The largest ``(K, L) = (m, m)`` whose uniform tree the memory estimate admits for one image
    (:func:`specsamp.arguments.check_sampler_memory`, the network's activations at its allowance): a ComfyUI node's
    maxima for ``K`` and ``L``. The defaults are one 512x512 SD1.x latent in float32 at 20 steps on a 24 GiB device
    (``(4, 4)``: 341 nodes; ``(5, 5)`` needs about 60 GiB). A larger setting or latent is refused at run time, at once,
    by the same estimate."""
    m = 1
    while True:
        try:
            arguments.check_sampler_memory(
                DraftTree.uniform(m + 1, m + 1),
                1,
                event_shape,
                dtype,
                "cpu",
                steps=steps,
                row_bytes=arguments.activation_bytes(event_shape, dtype),
                available=available,
            )
        except ConfigError:
            return m, m
        m += 1


# keyword options handed on to :func:`specsamp.sampler.sample_speculative`, and the tree search's own
PASSED_ON = ("prefetch", "evaluate_leaves", "max_batch", "warmup", "check_contract", "refine", "compile")
SEARCH = ("delta_profile", "max_width")
AUTO = ("call_cost", "host_cost", "cache", "pilot", "couplings", "budgets", "margin")
"""``auto``'s own options (:func:`specsamp.autosample.sample_auto`): taken where none of ``K``, ``L``, ``tree``,
``budget`` and ``coupling`` is given."""


COORDS = ("ve", "linear")
"""The denoisers' coordinates :func:`sample_with_kernel` takes: ``ve`` (``x = x0 + sigma noise``: k-diffusion's, and
ComfyUI's for SD1.x/SDXL) and ``linear`` (``x = (1 - sigma) x0 + sigma noise``: ComfyUI's flow models, CONST)."""


def sample_with_kernel(
    kernel,
    model,
    x,
    sigmas,
    extra_args=None,
    callback=None,
    disable=None,
    noise_sampler=None,
    *,
    kernel_options=None,
    coords="ve",
    caller="sample_with_kernel",
    K=None,
    L=None,
    coupling=None,
    draft="x0",
    tree=None,
    budget=None,
    execution="tree",
    seed=None,
    stats=None,
    **options,
):
    """A k-diffusion sampler whose steps are the registered kernel ``kernel``, exact and speculative: the driver every
    ``sample_*`` function of this module calls (a new sampler is a kernel and a thin function around this one).

    Args:
        kernel: the registered kernel's name (:mod:`specsamp.kernels`): each step's Gaussian transition, written on the
            linear path, the sigmas mapped to it (``ve``: ``s = sigma / (1 + sigma)``, states ``x / (1 + sigma)``;
            ``linear``: unchanged).
        model: a k-diffusion denoiser, ``model(x [b, ...], sigma [b], **extra_args) -> x0 [b, ...]`` (ComfyUI's model
            wrapper is one). It is called with the sampler's rows: a batch of ``m`` states, any mix of the batch's
            trajectories and levels, ``sigma`` one of ``sigmas`` per row in ``x``'s dtype.
        x: ``[b, ...]`` the first states at ``sigmas[0]`` (k-diffusion: the noise times ``sigmas[0]``; ComfyUI adds
            the latent image).
        sigmas: ``[T + 1]`` decreasing noise levels, ``sigmas[-1] == 0`` and the others > 0 (``linear``: at most 1).
        extra_args: the model's keywords. A tensor whose first dimension is ``b`` is per row: each call gets the rows
            of the trajectories it evaluates. Everything else (scalars, dicts, ComfyUI's ``cond``, ``model_options``,
            ``seed``) reaches every call unchanged. Every key reaches ``model`` under its own name, whatever it is
            (``y``, ``t``, ``x``, ``sigma`` included), as k-diffusion passes them.
        callback: called once per step ``i = 0 .. T - 1``, in order, with ``{"x", "i", "sigma", "sigma_hat",
            "denoised"}`` (``sigma = sigma_hat = sigmas[i]``). A round commits several steps at once and the rows of a
            batch advance at their own pace, so step ``i`` is reported as soon as every row has committed it (several
            steps after one round). ``x`` is then the batch's state: each row at its own level, at or below
            ``sigmas[i + 1]``, in the model's coordinates; ``denoised`` each row's data prediction there, from the
            velocity its next round drafts from (the network's at that state where the round evaluated it, else a
            stand-in: under the default ``prefetch=nearest``, the nearest evaluated draft's of the same level). At
            the last step they are k-diffusion's: ``x`` the states at ``sigmas[-2]``, ``denoised`` the returned
            samples (the last step returns its data prediction). Previews and progress bars read them; they are not
            the chain's states at ``sigmas[i]``. A two-step ``sigmas`` runs no round: both steps are reported at the
            end with the returned samples.
        disable: no progress bar (tqdm's ``disable``: None hides it off a terminal).
        noise_sampler: must be None (refused otherwise: the noise is drawn by key).
        kernel_options: the kernel's options (``eta``, ``s_noise``, ...), checked by the caller.
        coords: the model's coordinates, one of :data:`COORDS`.
        caller: the public function's name, for errors.
        K, L: the uniform draft tree (``K`` children per node, ``L`` levels; 2 and 3 where only one or ``coupling`` is
            given). A one-child coupling (``rmc``) runs a chain of the same drafted-state budget ``K + ... + K^L``.
            With none of ``K``, ``L``, ``tree``, ``budget`` and ``coupling`` given, the run is ``auto``
            (:func:`specsamp.autosample.sample_auto`): the plain loop, RMC chains or D-GRS trees per root step,
            whichever its measured call cost and piloted acceptance say is fastest here; the options ``call_cost``,
            ``host_cost``, ``cache``, ``pilot`` and ``delta_profile`` are its. ``execution="path"`` or ``refine > 0``
            without a tree runs the (2, 3) D-GRS tree instead (``auto`` prices the tree execution's one call a round).
        coupling: ``dgrs`` (the default where ``K``, ``L``, ``tree`` or ``budget`` is given), ``rmc``, ``markmax``, or
            any registered coupling.
        draft: the draft (default ``x0``: the data prediction frozen at the round's root).
        tree: a :class:`specsamp.trees.DraftTree` (or ``tree(n) -> DraftTree``) in place of ``K`` and ``L``.
        budget: drafted states per round: a one-child coupling's chain length; for the others, the tree searched for
            that budget (:func:`specsamp.treesearch.optimal_tree`) from ``delta_profile``, which must then be given
            (the displacement per depth, e.g. :func:`specsamp.treesearch.deltas_from_acceptance` of an earlier run's
            acceptance).
        execution: ``tree`` (the default: every node of a round in one batched call, what saves time) or ``path``.
            Both draw the same numbers and give the same counts.
        seed: the run's seed in ``[0, 2**60)``; None: drawn from torch's global generator, so ``torch.manual_seed``
            (ComfyUI's noise preparation calls it with the node's seed) reproduces the run.
        stats: a dict filled in with the run's counts: ``result`` (:class:`specsamp.result.SampleResult`: ``nfe``,
            ``nfe_total``, ``target_rows``, ``accepts`` per row; None for a one-step ``sigmas``), ``seed``, ``steps``
            (``T``: the network calls of k-diffusion's loop), ``calls`` (the calls of ``model`` this run made, each
            ``max_batch`` split included) and ``charged_calls`` (the batched calls the protocol charges: what the tree
            execution makes, one per round and the endpoints'; the path execution makes more, one per depth walked,
            and is charged alike). A ``stats`` that is not a dict is refused before the run.
        **options: ``prefetch``, ``evaluate_leaves``, ``max_batch``, ``warmup``, ``check_contract``, ``refine``,
            ``compile`` (as :func:`specsamp.sampler.sample_speculative`), and the search's ``delta_profile`` and
            ``max_width``.

    Returns:
        ``[b, ...]`` the samples at sigma = 0, in ``x``'s dtype, shape and device: what k-diffusion returns.

    Raises:
        ConfigError: before the first call of ``model`` (:mod:`specsamp.arguments`): a ``noise_sampler``; ``x`` not a
            finite floating-point tensor on a real device; ``sigmas`` not decreasing to 0; any argument or option of
            the wrong type or range; a tree too large for the memory available (the network's activations at an
            allowance, :func:`specsamp.arguments.activation_bytes`); a ComfyUI flow model where ``coords`` is ``ve``,
            or an inpainting mask.
        ModelOutputError: (a ``ConfigError``) ``model`` returned anything but a floating-point tensor of its input's
            shape, at the first call that does.
    """
    if noise_sampler is not None:
        raise ConfigError(
            "noise_sampler is not supported: the speculative sampler draws every step's noise by key (seed, row, step), "
            "so it cannot take noise from a sampler such as BrownianTreeNoiseSampler; pass noise_sampler=None and set "
            "seed= to choose the noise."
        )
    if coords not in COORDS:
        raise arguments.refuse("coords", coords, f"must be one of {', '.join(COORDS)}")
    named = ("K", "L", "coupling", "draft", "tree", "budget", "execution", "seed", "stats")
    tree_given = any(v is not None for v in (K, L, tree, budget, coupling))
    arguments.unknown_option(caller, options, named + PASSED_ON + SEARCH + (() if tree_given else AUTO))
    arguments.function("model", model)
    x = arguments.states("x", x)
    sig = _check_sigmas(sigmas, coords)
    if coords == "ve":
        _check_model(model, caller)
    static, rows = _split_extra_args(extra_args, x.shape[0])
    arguments.model_keys(model, {**static, **rows}, "extra_args")
    arguments.function("callback", callback, optional=True)
    arguments.flag("disable", disable, optional=True)
    stats = arguments.stats(stats)
    passed = arguments.sampler_options(
        execution=execution, **{k: v for k, v in options.items() if k in PASSED_ON and k != "compile"}
    )
    passed["compile"] = options.get("compile", False)  # checked with the machine's compiler by the sampler
    T = sig.numel() - 1
    state_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    row_bytes = arguments.activation_bytes(x.shape[1:], x.dtype)  # the user's network: an allowance a row
    memory = dict(
        batch=x.shape[0],
        event_shape=x.shape[1:],
        dtype=state_dtype,
        device=x.device,
        execution=passed["execution"],
        refine=passed["refine"],
        steps=T,
        max_batch=passed["max_batch"],
        row_bytes=row_bytes,
    )
    auto = runs_auto(tree_given, passed)  # the path or sweeps: the fixed tree
    if auto:
        draft_tree = None
    else:
        coupling = "dgrs" if coupling is None else coupling
        draft_tree = arguments.draft_tree(
            get_coupling(coupling), tree, K, L, budget, max(T - 2, 1), options, memory=memory
        )
    get_draft(draft)
    seed = arguments.seed(seed)
    if T == 1:  # one step to 0 is the data prediction itself (no noise): k-diffusion's loop, one call
        return _one_step(model, x, sigmas, extra_args, callback, disable, seed, stats)

    # the model's state over the linear path's per level: 1 + sigma in ve coordinates (1 at sigma = 0), 1 in linear
    scale = 1.0 + sig if coords == "ve" else torch.ones_like(sig)
    lin = sig / scale
    lin[-1] = 0.0
    schedule = Schedule(lin, 1.0, kernel, dict(kernel_options or {}))
    levels = _user_levels(sigmas, x)

    calls = [0]

    def net(y, t, /, **per_row):  # positional-only: every key of extra_args reaches the model under its own name
        calls[0] += 1
        return model(y, t, **static, **per_row)

    target = Parametrised(
        net, "sample", coords, x.shape[1:], state_dtype, time=GridTimesteps(lin, levels), net_dtype=x.dtype
    )
    target.device = x.device
    target.cache_key = _model_name(model)  # auto's cost curve and profile are kept under the user's network
    target.row_bytes = row_bytes  # the sampler checks the tree it builds (a given one, tree(n)) against it
    init = (x.to(torch.float64) / scale[0]).to(state_dtype)
    report = _Reporter(callback, disable, sigmas, scale, lin, x.dtype, T)
    try:
        if auto:
            from ..autosample import auto_options, sample_auto

            own = {k: v for k, v in options.items() if k in AUTO or k == "delta_profile"}
            res = sample_auto(
                target,
                schedule,
                x.shape[0],
                draft=draft,
                seed=seed,
                cond=rows or None,
                init=init,
                callback=report.any,
                **auto_options({**passed, **own}),
            )
        else:
            res = sample_speculative(
                target,
                schedule,
                draft_tree,
                coupling,
                x.shape[0],
                draft=draft,
                seed=seed,
                cond=rows or None,
                init=init,
                callback=report.round,
                **passed,
            )
    except BaseException:
        report.bar.close()
        raise
    out = res.samples.to(x.dtype)
    report.finish(out)
    if stats is not None:
        endpoint_calls = int((res.nfe_total - res.nfe).max())  # step 0, and step T - 1 where a row needed a call
        charged = res.batch_nfe + endpoint_calls
        stats.update(result=res, seed=seed, steps=T, calls=calls[0], charged_calls=charged)
        if "auto" in res.extra:  # what auto chose and why; its curve's and pilot's calls, made before the run
            stats.update(auto=res.extra["auto"], setup_calls=calls[0] - charged)
    return out


class _Reporter:
    """The callback and the progress bar: step ``i`` reported once every row has committed it."""

    def __init__(self, callback, disable, sigmas, scale, lin, dtype, T):
        self.callback, self.sigmas, self.scale, self.lin, self.dtype, self.T = callback, sigmas, scale, lin, dtype, T
        self.done, self.last = 0, None  # steps reported; the last round's (x, n) when every row was at T - 1
        from tqdm.auto import tqdm

        self.bar = tqdm(total=T, disable=disable)

    def _emit(self, upto: int, x, denoised) -> None:
        for i in range(self.done, upto):
            if self.callback is not None:
                s = self.sigmas[i]
                self.callback({"x": x, "i": i, "sigma": s, "sigma_hat": s, "denoised": denoised})
            self.bar.update(1)
        self.done = max(self.done, upto)

    def any(self, info: dict) -> None:
        """A round's report (:meth:`round`), or a plain step's (``auto`` chose the loop): step ``i`` at its state."""
        if "n" in info:
            return self.round(info)
        i = info["i"]
        if i >= self.T - 1:
            return None
        with torch.inference_mode(False):
            xl = info["x"]
            x_ve = (xl.to(torch.float64) * float(self.scale[i])).to(self.dtype)
            denoised = (xl - float(self.lin[i]) * info["v"]).to(self.dtype)
            if i == self.T - 2:
                self.last = x_ve
        self._emit(i + 1, x_ve, denoised)
        return None

    def round(self, info: dict) -> None:
        n = info["n"]
        upto = int(n.min())  # every row has committed steps 0 .. upto - 1
        if upto <= self.done and upto < self.T - 1:
            return
        with torch.inference_mode(False):  # ordinary tensors for the caller (the sampler runs in inference mode)
            xl = info["x"]
            shape = (-1,) + (1,) * (xl.ndim - 1)
            k = self.scale.to(xl.device)[n].reshape(shape)
            x_ve = (xl.to(torch.float64) * k).to(self.dtype)  # the model's coordinates
            s = self.lin.to(xl.device)[n].to(xl.dtype).reshape(shape)
            denoised = (xl - s * info["v"]).to(self.dtype)
            if upto >= self.T - 1:
                self.last = x_ve
        self._emit(min(upto, self.T - 1), x_ve, denoised)

    def finish(self, out) -> None:
        with torch.inference_mode(False):
            final = out.clone()
        x_last = self.last if self.last is not None else final
        self._emit(self.T - 1, final, final)  # only where no round reported them (a run without rounds)
        self._emit(self.T, x_last, final)
        self.bar.close()


def _model_name(model) -> str:
    """The user's network as ``auto`` caches it: the class of ``model`` and of the network it wraps (ComfyUI's and
    k-diffusion's wrappers keep it as ``inner_model``), so two networks of one architecture share a cost curve."""
    inner = getattr(model, "inner_model", None)
    own = model if hasattr(model, "__qualname__") else type(model)  # a function by its own name, else its class
    name = f"{getattr(own, '__module__', '')}.{own.__qualname__}"
    return name if inner is None else f"{name}({_model_name(inner)})"


def _one_step(model, x, sigmas, extra_args, callback, disable, seed, stats):
    from tqdm.auto import tqdm

    sigma = _user_levels(sigmas, x)[0]
    with tqdm(total=1, disable=disable) as bar:
        denoised = arguments.network_output(model(x, sigma * x.new_ones([x.shape[0]]), **(extra_args or {})), x.shape)
        if callback is not None:
            callback({"x": x, "i": 0, "sigma": sigmas[0], "sigma_hat": sigmas[0], "denoised": denoised})
        bar.update(1)
    if stats is not None:
        stats.update(result=None, seed=seed, steps=1, calls=1, charged_calls=1)
    return denoised.to(x.dtype)


def _check_sigmas(sigmas, coords: str = "ve") -> torch.Tensor:
    """``sigmas`` as float64 on the CPU; ConfigError unless 1-D, finite, decreasing, positive and ending at 0 (and
    at most 1 in ``linear`` coordinates)."""
    try:
        s = torch.as_tensor(sigmas).detach().to("cpu", torch.float64).clone()
    except (TypeError, ValueError, RuntimeError):
        s = None
    why = None
    if s is None or s.ndim != 1:
        why = "it must be a 1-D tensor of noise levels"
    elif s.numel() < 2:
        why = "it needs at least two levels (one step)"
    elif not bool(torch.isfinite(s).all()):
        why = "it has a value that is not finite"
    elif float(s[-1]) != 0.0:
        why = f"it ends at {float(s[-1])!r}: the sampler ends at 0 (k-diffusion's append_zero)"
    elif not bool((s[:-1] > 0).all()) or not bool((s[1:] < s[:-1]).all()):
        why = "it must decrease strictly, every level but the last > 0"
    elif coords == "linear" and float(s[0]) > 1.0:
        why = f"it starts at {float(s[0])!r}: a flow model's levels lie in [0, 1]"
    if why:
        shown = (
            sigmas.tolist()
            if isinstance(sigmas, torch.Tensor) and sigmas.numel() <= 8
            else f"a {type(sigmas).__name__}" + (f" of shape {tuple(sigmas.shape)}" if hasattr(sigmas, "shape") else "")
        )
        raise ConfigError(f"sigmas={shown} is invalid: {why}.")
    return s


def _user_levels(sigmas, x) -> torch.Tensor:
    """The caller's own ``sigmas`` in ``x``'s dtype, as k-diffusion hands them to the model (``sigmas[i] * s_in``)."""
    return torch.as_tensor(sigmas).detach().to("cpu").to(x.dtype)[:-1]


def is_flow(model) -> bool:
    """Whether ``model`` is a ComfyUI flow model (its ``inner_model.inner_model.model_sampling`` a CONST: SD3, Flux),
    whose states are ``(1 - sigma) x0 + sigma noise``, as ComfyUI's samplers test it."""
    inner = getattr(getattr(model, "inner_model", None), "inner_model", None)
    sampling = getattr(inner, "model_sampling", None)
    return sampling is not None and any(c.__name__ == "CONST" for c in type(sampling).__mro__)


def _check_model(model, caller: str = "sample_euler_ancestral") -> None:
    """Refuse a ComfyUI flow model (``model_sampling`` CONST) where the sampler takes variance-exploding denoisers."""
    if is_flow(model):
        raise ConfigError(
            f"model is a flow model (model_sampling CONST: SD3, Flux): {caller} takes variance-exploding "
            "denoisers (SD1.x, SDXL), and a flow model's step is another; use it with those, or use "
            "sample_euler_ancestral (which runs ComfyUI's flow form for it), sample_lcm, sample_er_sde or "
            "sample_res_multistep_ancestral."
        )


def _split_extra_args(extra_args, b: int) -> tuple[dict, dict]:
    """``(static, rows)``: the keywords every call gets unchanged, and the per-row tensors (first dimension ``b``)."""
    if extra_args is None:
        return {}, {}
    if not isinstance(extra_args, dict):
        raise ConfigError(f"extra_args is a {type(extra_args).__name__}: it must be a dict of the model's keywords.")
    if extra_args.get("denoise_mask") is not None:
        raise ConfigError(
            "extra_args['denoise_mask'] is not supported: ComfyUI's inpainting wrapper blends the batch's "
            "own latent rows into every call, and a speculative call evaluates other rows; sample "
            "without a mask."
        )
    rows = {k: v for k, v in extra_args.items() if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == b}
    return {k: v for k, v in extra_args.items() if k not in rows}, rows


def _positive(name: str, value) -> float:
    """A sampler's noise option (``eta``, ``s_noise``, ...) as a finite float > 0 (:func:`specsamp.arguments.number`)."""
    extra = " (eta=0 is the deterministic sampler, where speculation is vacuous)" if name == "eta" else ""
    return arguments.number(name, value, positive=True, note=extra)
