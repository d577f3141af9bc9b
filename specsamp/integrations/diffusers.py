"""A diffusers pipeline, sampled speculatively and exactly: :func:`speculative`.

``speculative(pipe, K, L, coupling, draft, **options)`` returns a :class:`SpeculativePipeline`, a callable that
takes the pipeline's own arguments and returns the pipeline's own output. Everything outside the sampling loop
is the pipeline's: its ``encode_prompt``, its latent shape (from the network's config and ``vae_scale_factor``),
its first latents (``randn_tensor`` from the ``generator``, as ``prepare_latents`` draws them), its VAE decoding,
safety checker and ``image_processor.postprocess``. The loop is replaced: the scheduler becomes a
:class:`~specsamp.integrations.schedulers.SchedulerPlan` (its own grid and kernel, :func:`from_scheduler`), the
network a velocity model on the linear path (:class:`~specsamp.models.parametrisation.Parametrised`, wrapped
in :class:`~specsamp.models.parametrisation.Guided` when ``guidance_scale > 1``: one call of ``[uncond; cond]``
rows, as diffusers batches it), and :func:`specsamp.sampler.sample_speculative` runs the draft tree.
The samples follow the law of the pipeline's own loop; the noise after the first latents is the sampler's keyed
noise, so the images are not the pipeline's bit for bit.

Covered: ``DDPMPipeline`` (``UNet2DModel``; ``DDIMPipeline`` too, with its ``eta``), ``StableDiffusionPipeline``
(``UNet2DConditionModel``; epsilon, v_prediction or sample) and ``StableDiffusion3Pipeline`` (flow), each under the
schedulers whose sampler its own loop is (:func:`check_loop`): ``DDPMPipeline`` and ``StableDiffusion3Pipeline`` under
``DDPMScheduler`` or ``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)``; ``StableDiffusionPipeline`` under
``DDPMScheduler`` or ``EulerAncestralDiscreteScheduler``;
``DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++")`` in ``DDPMPipeline`` and ``StableDiffusionPipeline``;
``DDIMScheduler`` in ``DDIMPipeline`` with ``eta > 0`` (other loops pass it no ``eta``, or this class does not take
theirs). ``EulerAncestralDiscreteScheduler`` in a loop that skips ``init_noise_sigma`` and ``scale_model_input``
(``DDPMPipeline``, ``StableDiffusion3Pipeline``) is another law, and the flow scheduler in ``StableDiffusionPipeline``
makes the pipeline itself fail: both are refused. Any other scheduler (deterministic DPM-Solver++, UniPC, any ODE
solver) or pipeline is refused by :func:`speculative` itself, with a :class:`~specsamp.errors.ConfigError`, before any work.

The call takes the pipeline's arguments by keyword or by position, in the order of the pipeline's own
``__call__``; the progress bar is the pipeline's (``pipe.progress_bar``, ``set_progress_bar_config``) and
counts the loop's steps, ``num_inference_steps`` in all, each once every image has committed it.
"""

from __future__ import annotations

import inspect
import math

import torch

from .. import arguments
from ..autosample import runs_auto
from ..coupling import get_coupling
from ..drafts import get_draft
from ..errors import ConfigError
from ..kernels import kernel_of_scheduler
from ..models.base import parse_dtype
from ..models.pipelines import Conditioning, encode, net_dtype_device, network_call, rows_of, velocity_model
from ..rng import MAX_SEED
from ..schedulers import SchedulerPlan, from_scheduler
from ..trees import DraftTree
from .pipeline_args import check_call, network_name

KINDS = {
    "DDIMPipeline": "ddim",
    "DDPMPipeline": "ddpm",
    "StableDiffusionPipeline": "sd",
    "StableDiffusion3Pipeline": "sd3",
}
"""The pipeline classes covered (subclasses included) and the kind each is driven as."""

# data tables: one line per kind reads better than one line per name
# fmt: off
ARGUMENTS = {
    "ddpm": ("batch_size", "generator", "seed", "num_inference_steps", "output_type", "return_dict"),
    "ddim": ("batch_size", "generator", "seed", "eta", "num_inference_steps", "use_clipped_model_output",
             "output_type", "return_dict"),
    "sd": ("prompt", "negative_prompt", "height", "width", "num_inference_steps", "guidance_scale",
           "num_images_per_prompt", "generator", "seed", "output_type", "return_dict", "guidance_rescale", "clip_skip"),
    "sd3": ("prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3", "height",
            "width", "num_inference_steps", "guidance_scale", "num_images_per_prompt", "generator", "seed",
            "output_type", "return_dict", "mu", "max_sequence_length", "clip_skip"),
}
"""The pipeline arguments each kind takes (plus ``seed``); their defaults are the pipeline's own."""

OPTIONS = ("tree", "execution", "prefetch", "evaluate_leaves", "max_batch", "warmup", "refine", "compile",
           "check_contract", "dtype")
AUTO = ("call_cost", "host_cost", "cache", "pilot", "couplings", "budgets", "margin", "delta_profile")
# fmt: on
"""The speculative options :func:`speculative` takes besides ``K``, ``L``, ``coupling`` and ``draft``."""

LOOP_SCALES = {"ddpm": False, "ddim": False, "sd": True, "sd3": False}
"""Whether each kind's own loop (diffusers 0.42) multiplies its first latents by ``scheduler.init_noise_sigma``
and passes the network's input through ``scheduler.scale_model_input``: ``StableDiffusionPipeline`` does both,
``DDPMPipeline`` and ``StableDiffusion3Pipeline`` neither."""

INSTEAD = {
    "ddpm": "DDPMScheduler.from_config(pipe.scheduler.config)",
    "ddim": "DDIMScheduler.from_config(pipe.scheduler.config)",
    "sd": "DDPMScheduler or EulerAncestralDiscreteScheduler (.from_config(pipe.scheduler.config))",
    "sd3": "FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)",
}
"""What a refusal of :func:`check_loop` suggests for each kind."""


def _kind(pipe) -> str:
    for cls in type(pipe).__mro__:
        if cls.__name__ in KINDS:
            return KINDS[cls.__name__]
    plain = pipe is None or isinstance(pipe, (str, int, float, bool))  # shown as the value, not its type's name
    shown = repr(pipe) if plain else repr(type(pipe).__name__)
    raise ConfigError(
        f"pipeline={shown} is not supported: speculative() drives "
        f"{', '.join(KINDS)} (and their subclasses), whose loops it reproduces; load one of them "
        "with the same components."
    )


def _defaults(pipe) -> dict:
    sig = inspect.signature(type(pipe).__call__).parameters
    return {k: p.default for k, p in sig.items() if p.default is not inspect.Parameter.empty}


def check_loop(pipe, kind: str) -> None:
    """Refuse a pipeline whose own loop, under its scheduler, is not that scheduler's sampler.

    Euler ancestral is a sampler of the scaled state only where the loop applies ``init_noise_sigma`` and
    ``scale_model_input`` (:data:`LOOP_SCALES`); ``FlowMatchEulerDiscreteScheduler`` has no ``init_noise_sigma``,
    so a loop that applies it fails, and with dynamic shifting its grid needs a ``mu`` that only the SD3 loop
    passes. DDPM's ``init_noise_sigma`` is 1 and its ``scale_model_input`` the identity, so every loop is its sampler.

    Raises:
        ConfigError: one paragraph naming the pipeline, the scheduler, what the loop does and what to use instead.
    """
    sch, name, pname = pipe.scheduler, type(pipe.scheduler).__name__, type(pipe).__name__
    kernel = kernel_of_scheduler(name)
    if kernel is not None and kernel.scaling_loop is True and not LOOP_SCALES[kind]:
        raise ConfigError(
            f"scheduler={name!r} is refused with pipeline={pname!r}: {pname}'s own loop neither multiplies its first "
            "latents by scheduler.init_noise_sigma nor passes the network's input through scheduler.scale_model_input "
            "(diffusers warns that it should), so pipe(...) is not the Euler ancestral sampler and its images follow "
            f"another law, which speculative() does not reproduce. Instead use {INSTEAD[kind]} with {pname}, or Euler "
            "ancestral in a pipeline whose loop applies both (StableDiffusionPipeline)."
        )
    if kernel is not None and kernel.scaling_loop is False and LOOP_SCALES[kind]:
        raise ConfigError(
            f"scheduler={name!r} is refused with pipeline={pname!r}: {pname}'s own loop multiplies its first latents "
            f"by scheduler.init_noise_sigma, which {name} does not have, so pipe(...) itself fails and there is no "
            f"law to reproduce. Instead use {INSTEAD[kind]} with {pname}, or the flow scheduler in a flow pipeline "
            "(StableDiffusion3Pipeline)."
        )
    if kernel is not None and (kernel.name == "ddim") != (kind == "ddim"):  # DDIM's eta: only DDIMPipeline's is taken
        why = {
            "ddim": f"its own loop passes eta to scheduler.step, which {name} does not take, so pipe(...) itself fails",
            "sd": "its own loop hands DDIMScheduler.step the pipeline's eta, which speculative() takes from DDIMPipeline only",
        }.get(
            kind, "its own loop passes DDIMScheduler.step no eta: pipe(...) is the deterministic DDIM sampler (eta=0)"
        )
        raise ConfigError(
            f"scheduler={name!r} is refused with pipeline={pname!r}: {why}. Instead use DDIMPipeline with "
            + ("DDIMScheduler (eta > 0)." if kind == "ddim" else f"eta > 0, or another scheduler ({INSTEAD[kind]}).")
        )
    get = sch.config.get if hasattr(sch.config, "get") else lambda k, d=None: getattr(sch.config, k, d)
    if kernel is not None and kernel.flow and kind != "sd3" and get("use_dynamic_shifting", False):
        raise ConfigError(
            f"scheduler={name!r} with use_dynamic_shifting=True is refused with pipeline={pname!r}: {pname}'s own "
            "loop calls scheduler.set_timesteps without the shift mu, which this scheduler then needs, so pipe(...) "
            "itself fails and there is no law to reproduce. Instead set use_dynamic_shifting=False (a fixed shift) or "
            "use StableDiffusion3Pipeline, which computes mu from the image size."
        )


def _is_default(value, default) -> bool:
    """``value`` is the parameter's ``default``: the same object, or an equal number, string or list of them."""
    if value is default:
        return True
    plain = (int, float, str, list, tuple)
    if (
        isinstance(value, bool)
        or isinstance(default, bool)
        or not (isinstance(value, plain) and isinstance(default, plain))
    ):
        return False
    try:
        return bool(value == default)
    except (TypeError, ValueError, RuntimeError):  # an element whose == is not a truth value
        return False


def _positional(pipe) -> list[str]:
    """The names of the pipeline's ``__call__`` parameters that a call may give by position, in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [k for k, p in inspect.signature(type(pipe).__call__).parameters.items() if p.kind in kinds][1:]


def _check_int(key: str, value, lo: int = 1) -> int:
    return arguments.integer(key, value, lo)


def _scheduler_mu(pipe, latent_shape, mu):
    """The flow scheduler's shift as ``StableDiffusion3Pipeline`` computes it from the image size."""
    cfg = pipe.scheduler.config
    if mu is not None or not cfg.get("use_dynamic_shifting", False):
        return mu
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

    patch = pipe.transformer.config.patch_size
    seq = (latent_shape[-2] // patch) * (latent_shape[-1] // patch)
    return calculate_shift(
        seq,
        cfg.get("base_image_seq_len", 256),
        cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5),
        cfg.get("max_shift", 1.16),
    )


class SpeculativePipeline:
    """A diffusers pipeline's ``__call__`` with the sampling loop replaced by the speculative sampler.

    Call it with the pipeline's own arguments, by keyword or by position in the order of the pipeline's
    ``__call__`` (its defaults apply; an argument not listed here is accepted only at the pipeline's default, so
    ``sp("a cat", 512, 512, 30, None, None, 7.5)`` works; ``seed`` is keyword-only): ``DDPMPipeline``: ``batch_size``,
    ``generator``, ``num_inference_steps``, ``output_type``, ``return_dict``; ``StableDiffusionPipeline``: also
    ``prompt``, ``negative_prompt``, ``height``, ``width``, ``guidance_scale``, ``num_images_per_prompt``,
    ``clip_skip`` (``guidance_rescale`` must stay 0); ``StableDiffusion3Pipeline``: also ``prompt_2``, ``prompt_3``,
    ``negative_prompt_2``, ``negative_prompt_3``, ``mu``, ``max_sequence_length``. ``seed`` (an integer) keys the
    sampler's noise; without it the seed is drawn from ``generator`` after the first latents (from torch's global
    generator when there is none, so ``torch.manual_seed`` reproduces a run).

    Returns the pipeline's output (``ImagePipelineOutput``, ``StableDiffusionPipelineOutput``,
    ``StableDiffusion3PipelineOutput``; ``output_type`` as the pipeline takes it) with the run's
    :class:`~specsamp.result.SampleResult` as its attribute ``speculative`` (``nfe``, ``nfe_total``,
    ``target_rows``, ``speedup``, per-depth ``attempts``/``accepts``; ``samples`` are the final latents). With
    ``return_dict=False``, the pipeline's tuple; the result is then :attr:`last` (also set otherwise).

    The progress bar is ``pipe.progress_bar(total=num_inference_steps)``, as the pipeline's own loop shows it; it
    stands at the steps the slowest image has committed and ends at ``num_inference_steps``.

    Raises:
        ConfigError: more positional arguments than the pipeline's ``__call__`` takes, an argument given both by
            position and by keyword, an argument this class does not take at a value other than the pipeline's
            default, a bad value; a scheduler swapped in since :func:`speculative` that it would refuse
            (:func:`check_loop`). All before any network call.
    """

    def __init__(self, pipe, tree, coupling, draft, options: dict):
        self.pipe, self.kind = pipe, _kind(pipe)
        check_loop(pipe, self.kind)
        self.tree, self.coupling, self.draft = tree, coupling, draft  # tree: a DraftTree, tree(n), or (K, L)
        self.dtype = parse_dtype(options.pop("dtype", "float32"), "dtype")
        self.options = options
        self.defaults = _defaults(pipe)
        self.positional = _positional(pipe)
        self.last = None

    def __call__(self, *args, **kwargs):
        kwargs = self._bind(args, kwargs)
        unknown = sorted(set(kwargs) - set(ARGUMENTS[self.kind]))
        if unknown:
            raise ConfigError(
                f"{unknown[0]}={arguments.describe(kwargs[unknown[0]])} is not supported by the speculative "
                f"{type(self.pipe).__name__}: it takes {', '.join(ARGUMENTS[self.kind])}."
            )
        a = check_call({k: kwargs.get(k, self.defaults.get(k)) for k in ARGUMENTS[self.kind]})
        with torch.no_grad():  # as the pipeline's own __call__
            return getattr(self, f"_{self.kind}")(a)

    def _bind(self, args: tuple, kwargs: dict) -> dict:
        """The positional arguments named as the pipeline's ``__call__`` names them, in its order, merged with
        ``kwargs``; what Python would answer with a ``TypeError`` is a :class:`ConfigError` here. An argument the
        speculative pipeline does not take is dropped where its value is the pipeline's default (it changes
        nothing in the pipeline's loop: ``timesteps=None`` passed on the way to ``guidance_scale``)."""
        name, takes = type(self.pipe).__name__, ARGUMENTS[self.kind]
        if len(args) > len(self.positional):
            raise ConfigError(
                f"{len(args)} positional arguments were given, and {name}'s __call__ takes at most "
                f"{len(self.positional)} ({', '.join(self.positional)}); pass the others by keyword."
            )
        for i, (key, value) in enumerate(zip(self.positional, args)):
            if key in kwargs:
                raise ConfigError(
                    f"{key} is given twice, as positional argument {i + 1} ({arguments.describe(value)}) and by "
                    f"keyword ({arguments.describe(kwargs[key])}); give it once."
                )
            if key not in takes and not _is_default(value, self.defaults.get(key, inspect.Parameter.empty)):
                raise ConfigError(
                    f"positional argument {i + 1} is {name}'s {key}={arguments.describe(value)}, which the "
                    f"speculative {name} takes only at its default "
                    f"({arguments.describe(self.defaults.get(key))}): it takes "
                    f"{', '.join(k for k in takes if k != 'seed')}, and seed by keyword only."
                )
        given = {**dict(zip(self.positional, args)), **kwargs}
        return {
            k: v
            for k, v in given.items()
            if k in takes or not _is_default(v, self.defaults.get(k, inspect.Parameter.empty))
        }

    # --- the parts every kind shares -----------------------------------------------------------------
    def _plan(self, steps, latent_shape, mu=None, guided: bool = False, **step) -> tuple[SchedulerPlan, object]:
        """The scheduler's plan for ``steps`` and the round's tree within its speculative steps, refused (before any
        network call) where the sampler's states for ``latent_shape`` cannot fit."""
        check_loop(self.pipe, self.kind)  # the scheduler may have been replaced since speculative()
        plan = from_scheduler(
            self.pipe.scheduler,
            steps,
            event_ndim=len(latent_shape) - 1,
            mu=_scheduler_mu(self.pipe, latent_shape, mu) if self.kind == "sd3" else None,
            **step,  # DDIMPipeline's eta and use_clipped_model_output
        )
        horizon = max(plan.schedule.steps - 2, 1)
        if self.tree == "auto":  # chosen per call (specsamp.autosample), sized there by the same estimate
            return plan, "auto"
        given = not isinstance(self.tree, tuple)
        K, L = (None, None) if given else self.tree
        net_dtype, device = net_dtype_device(self.pipe.unet if self.kind != "sd3" else self.pipe.transformer)
        memory = dict(
            batch=latent_shape[0],
            event_shape=latent_shape[1:],
            dtype=self.dtype,
            device=device,
            execution=self.options["execution"],
            refine=self.options.get("refine", 0),
            steps=plan.schedule.steps,
            max_batch=self.options.get("max_batch"),
            row_bytes=arguments.activation_bytes(latent_shape[1:], net_dtype),
            rows_per_state=2 if self.kind not in ("ddpm", "ddim") and guided else 1,
        )
        tree = arguments.draft_tree(
            get_coupling(self.coupling), self.tree if given else None, K, L, None, horizon, {}, memory=memory
        )
        if isinstance(tree, DraftTree):  # tree(n) is sized by the sampler once built
            arguments.check_sampler_memory(tree.restrict(horizon), **memory)
        return plan, tree

    def _noise(self, shape, generator, dtype, device):
        from diffusers.utils.torch_utils import randn_tensor

        return randn_tensor(shape, generator=generator, device=device, dtype=dtype)

    def _seed(self, seed, generator) -> int:
        if seed is not None:
            return seed  # checked by _check_call
        g = generator[0] if isinstance(generator, list) else generator
        return int(torch.randint(0, MAX_SEED + 1, (1,), generator=g, device=g.device if g is not None else "cpu"))

    def _sample(self, model, plan: SchedulerPlan, tree, noise, cond, seed):
        from ..sampler import sample_speculative

        m, T = noise.shape[0], plan.schedule.steps
        init = noise.to(self.dtype) * plan.init_scale
        bar = self.pipe.progress_bar(total=T)  # the pipeline's loop: one tick per step
        done = [0]

        def progress(info):
            if getattr(bar, "disable", False):
                return  # no device sync for a hidden bar
            # the slowest image has committed steps 0 .. upto - 1 (auto's plain loop: one step at a time)
            upto = int(info["n"].min()) if "n" in info else info["step"]
            if upto > done[0]:
                bar.update(upto - done[0])
                done[0] = upto

        with bar:
            if tree == "auto":
                from ..autosample import auto_options, sample_auto

                model.cache_key = network_name(self.pipe, self.kind)
                opts = auto_options(self.options)
                res = sample_auto(
                    model,
                    plan.schedule,
                    m,
                    draft=self.draft,
                    seed=seed,
                    cond=cond,
                    init=init,
                    callback=progress,
                    **opts,
                )
            else:
                res = sample_speculative(
                    model,
                    plan.schedule,
                    tree,
                    self.coupling,
                    m,
                    draft=self.draft,
                    seed=seed,
                    cond=cond,
                    init=init,
                    callback=progress,
                    **self.options,
                )
            bar.update(T - done[0])  # the last step
        self.last = res
        return res

    def _finish(self, output, res):
        if isinstance(output, tuple):
            return output
        output.speculative = res
        return output

    # --- the pipelines -------------------------------------------------------------------------------
    def _ddim(self, a):
        return self._ddpm(a)

    def _ddpm(self, a):
        pipe = self.pipe
        b = _check_int("batch_size", a["batch_size"])
        size = pipe.unet.config.sample_size
        shape = (b, pipe.unet.config.in_channels, *((size, size) if isinstance(size, int) else size))
        step = {k: a[k] for k in ("eta", "use_clipped_model_output") if k in a}
        if step:  # DDIMPipeline: as its loop hands them to DDIMScheduler.step
            arguments.number("eta", step["eta"])
            step["use_clipped_model_output"] = bool(step["use_clipped_model_output"])
        plan, tree = self._plan(a["num_inference_steps"], shape, **step)
        net_dtype, device = net_dtype_device(pipe.unet)
        noise = self._noise(shape, a["generator"], net_dtype, device)
        seed = self._seed(a["seed"], a["generator"])
        model = velocity_model(pipe, "ddpm", plan, Conditioning(), shape[1:], 1.0, self.dtype)
        res = self._sample(model, plan, tree, noise, None, seed)
        image = (res.samples.to(net_dtype) / 2 + 0.5).clamp(0, 1)
        if a["output_type"] != "pt":
            image = image.cpu().permute(0, 2, 3, 1).numpy()
            if a["output_type"] == "pil":
                image = pipe.numpy_to_pil(image)
        pipe.maybe_free_model_hooks()
        from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

        return self._finish((image,) if not a["return_dict"] else ImagePipelineOutput(images=image), res)

    def _guidance(self, a) -> float:
        w = a["guidance_scale"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise arguments.refuse("guidance_scale", w, "must be a finite number (1 or less: no guidance)")
        return float(w)

    def _batch(self, a) -> int:
        p = a["prompt"]
        if isinstance(p, str):
            return 1
        if isinstance(p, list) and p and all(isinstance(s, str) for s in p):
            return len(p)
        raise arguments.refuse("prompt", p, "must be a string or a non-empty list of strings")

    def _hw(self, a, default_side: int) -> tuple[int, int]:
        h, w = a["height"] or default_side, a["width"] or default_side
        f = self.pipe.vae_scale_factor
        for key, v in (("height", h), ("width", w)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % f:
                raise arguments.refuse(key, v, f"must be a positive multiple of the VAE factor {f}")
        return h, w

    def _text_sample(self, a, kind: str, shape, w: float, n: int, planned: tuple, **encode_kw):
        """A text pipeline's prompts encoded, its noise drawn as the pipeline draws it, and the speculative run:
        ``(SampleResult, encoded prompts)``."""
        pipe, (plan, tree) = self.pipe, planned
        c = encode(pipe, kind, a["prompt"], a["negative_prompt"], w > 1, n, clip_skip=a["clip_skip"], **encode_kw)
        noise = self._noise(shape, a["generator"], c.embeds.dtype, pipe._execution_device)
        seed = self._seed(a["seed"], a["generator"])
        model = velocity_model(pipe, kind, plan, c, shape[1:], w, self.dtype)
        return self._sample(model, plan, tree, noise, rows_of(model, torch.arange(shape[0])), seed), c

    def _sd(self, a):
        pipe = self.pipe
        if a["guidance_rescale"]:
            raise ConfigError(
                f"guidance_rescale={arguments.describe(a['guidance_rescale'])} is not supported: the speculative pipeline "
                "reproduces plain classifier-free guidance only; set guidance_rescale=0."
            )
        if pipe.unet.config.time_cond_proj_dim is not None:
            raise ConfigError(
                "unet.config.time_cond_proj_dim is set (a guidance-embedded, LCM-style network): its "
                "scheduler is not one of the exact kernels; use a plain UNet2DConditionModel."
            )
        b, w, n = self._batch(a), self._guidance(a), _check_int("num_images_per_prompt", a["num_images_per_prompt"])
        size = pipe.unet.config.sample_size
        side = (size if isinstance(size, int) else size[0]) * pipe.vae_scale_factor
        h, wd = self._hw(a, side)
        f = pipe.vae_scale_factor
        shape = (b * n, pipe.unet.config.in_channels, h // f, wd // f)
        device = pipe._execution_device
        res, c = self._text_sample(a, "sd", shape, w, n, self._plan(a["num_inference_steps"], shape, guided=w > 1))
        embeds = c.embeds
        latents = res.samples.to(embeds.dtype)
        if a["output_type"] != "latent":
            image = pipe.vae.decode(
                latents / pipe.vae.config.scaling_factor, return_dict=False, generator=a["generator"]
            )[0]
            image, nsfw = pipe.run_safety_checker(image, device, embeds.dtype)
        else:
            image, nsfw = latents, None
        denorm = [True] * image.shape[0] if nsfw is None else [not x for x in nsfw]
        image = pipe.image_processor.postprocess(image, output_type=a["output_type"], do_denormalize=denorm)
        pipe.maybe_free_model_hooks()
        from diffusers.pipelines.stable_diffusion import StableDiffusionPipelineOutput

        out = (
            (image, nsfw)
            if not a["return_dict"]
            else StableDiffusionPipelineOutput(images=image, nsfw_content_detected=nsfw)
        )
        return self._finish(out, res)

    def _sd3(self, a):
        pipe = self.pipe
        b, w, n = self._batch(a), self._guidance(a), _check_int("num_images_per_prompt", a["num_images_per_prompt"])
        h, wd = self._hw(a, pipe.default_sample_size * pipe.vae_scale_factor)
        f = pipe.vae_scale_factor
        shape = (b * n, pipe.transformer.config.in_channels, h // f, wd // f)
        res, c = self._text_sample(
            a,
            "sd3",
            shape,
            w,
            n,
            self._plan(a["num_inference_steps"], shape, a["mu"], w > 1),
            max_sequence_length=a["max_sequence_length"],
            extra={k: a[k] for k in ("prompt_2", "prompt_3", "negative_prompt_2", "negative_prompt_3")},
        )
        embeds = c.embeds
        latents = res.samples.to(embeds.dtype)
        if a["output_type"] == "latent":
            image = latents
        else:
            z = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
            image = pipe.image_processor.postprocess(
                pipe.vae.decode(z, return_dict=False)[0], output_type=a["output_type"]
            )
        pipe.maybe_free_model_hooks()
        from diffusers.pipelines.stable_diffusion_3 import StableDiffusion3PipelineOutput

        return self._finish((image,) if not a["return_dict"] else StableDiffusion3PipelineOutput(images=image), res)


def speculative(
    pipe, K: int | None = None, L: int | None = None, coupling: str | None = None, draft: str = "x0", **options
) -> SpeculativePipeline:
    """``pipe`` with its sampling loop run by the exact speculative sampler (:class:`SpeculativePipeline`).

    Args:
        pipe: a ``DDPMPipeline``, ``StableDiffusionPipeline`` or ``StableDiffusion3Pipeline`` whose scheduler is
            ``DDPMScheduler``, ``EulerAncestralDiscreteScheduler`` or ``FlowMatchEulerDiscreteScheduler`` with
            ``stochastic_sampling=True``, and whose own loop is that scheduler's sampler (:func:`check_loop`: not
            Euler ancestral in ``DDPMPipeline`` or ``StableDiffusion3Pipeline``, not the flow scheduler in
            ``StableDiffusionPipeline``).
        K, L: the uniform draft tree (``K`` children per node, ``L`` levels; 2 and 3 where only one, ``coupling``,
            ``execution="path"`` or ``refine`` is given); a one-child coupling (``rmc``) runs the chain of the same
            drafted-state budget ``K + ... + K^L`` (``K=1, L=62``: a chain of 62). With none of ``K``, ``L``,
            ``coupling`` and ``tree``, each call runs ``auto`` (:func:`specsamp.autosample.sample_auto`): the
            plain loop, RMC chains or D-GRS trees per root step, whichever the measured cost of the pipeline's network
            and the piloted acceptance say is fastest; its options ``call_cost``, ``host_cost``, ``cache``, ``pilot``
            and ``delta_profile`` are then taken. ``last.extra["auto"]`` records the choice.
        coupling: ``dgrs`` (the default with a tree), ``rmc``, ``markmax`` or any registered coupling.
        draft: ``x0`` (the data prediction frozen at the root), ``velocity``, ... (:mod:`specsamp.drafts`).
        **options: ``tree`` (a :class:`~specsamp.trees.DraftTree` or a callable per root step, instead of ``K``,
            ``L``), ``execution`` (``tree``, the default: a round's nodes in one batched call; or ``path``),
            ``prefetch``, ``evaluate_leaves``,
            ``max_batch``, ``warmup``, ``refine``, ``compile``, ``check_contract`` (as
            :func:`~specsamp.sampler.sample_speculative` takes them) and ``dtype`` of the sampler's states
            (``float32``; the network runs in its own dtype).

    Raises:
        ConfigError: a pipeline, scheduler or scheduler option whose loop is not reproduced exactly (one paragraph
            naming the kernels there are), an unknown option, coupling or draft, a tree the coupling does not
            take; all before any work.
    """
    _kind(pipe)
    try:  # the scheduler's own check: a grid of a few steps is enough to refuse what is not reproduced
        from_scheduler(pipe.scheduler, 3, mu=1.0)
    except ConfigError as e:
        if not str(e).startswith("num_inference_steps="):
            raise
    tree = options.get("tree")
    auto = runs_auto((K, L, coupling, tree) != (None, None, None, None), options)
    named = ("K", "L", "coupling", "draft") + OPTIONS + (AUTO if auto else ())
    arguments.unknown_option("speculative()", options, named)
    options.pop("tree", None)
    coupling = "dgrs" if coupling is None else coupling
    c = get_coupling(coupling)
    get_draft(draft)
    K, L = 2 if K is None else K, 3 if L is None else L
    if auto:
        tree = "auto"
    elif tree is None:  # the (K, L) tree, built per call within its speculative steps (a one-child coupling: the chain
        tree = (arguments.integer("K", K), arguments.integer("L", L))  # of its budget K + ... + K^L, as run.py's)
    else:
        arguments.draft_tree(c, tree, None, None, None, 1, {})  # its type and widths, now
    options.setdefault("execution", "tree")  # every node of a round in one batched call: what saves time
    passed = {k: options[k] for k in OPTIONS if k in options and k not in ("dtype", "compile")}
    checked = arguments.sampler_options(**passed)
    options.update({k: checked[k] for k in passed})
    arguments.flag("compile", options.get("compile", False))
    parse_dtype(options.get("dtype", "float32"), "dtype")
    return SpeculativePipeline(pipe, tree, coupling, draft, dict(options))


__all__ = [
    "KINDS",
    "Conditioning",
    "SpeculativePipeline",
    "check_loop",
    "encode",
    "network_call",
    "rows_of",
    "speculative",
    "velocity_model",
]
