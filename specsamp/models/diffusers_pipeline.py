"""``model=diffusers``: any local diffusers pipeline folder as a target (``conf/model/diffusers.yaml``).

The folder is what ``save_pretrained`` writes (``model_index.json``, ``scheduler/``, ``unet/`` or
``transformer/``, ``vae/``, ``text_encoder*/``, ``tokenizer*/``), its weights as ``*.safetensors``: nothing else
is loaded (``use_safetensors=True``, local files only; a folder whose networks have no safetensors file is
refused before loading). Covered: ``DDPMPipeline``, ``StableDiffusionPipeline`` and
``StableDiffusion3Pipeline`` (:mod:`specsamp.integrations.diffusers`).

The runner asks the config for its scheduler before anything loads (:meth:`DiffusersConfig.scheduler_plan`,
which reads ``scheduler/scheduler_config.json`` only), then builds the target on that plan
(:meth:`DiffusersConfig.build`): the network as the plan's velocity model, guided when ``guidance > 1``,
decoded by the pipeline's VAE, each image's prompt for CLIP.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError
from ..kernels import KERNELS, kernel_of_scheduler, scheduler_kernels
from ..schedulers import from_scheduler, refuse
from .base import MISSING, Target, TargetConfig, check_positive
from .sd3 import ClipConfig, PromptsConfig
from .sd3.pipeline import _absent_components

PIPELINES = {"DDPMPipeline": "ddpm", "StableDiffusionPipeline": "sd", "StableDiffusion3Pipeline": "sd3"}
NETWORK_FOLDERS = ("unet", "transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _read_json(path: str, key: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"model.path={key!r} is invalid: {path} does not exist; pass a diffusers pipeline folder "
            "(what save_pretrained writes: model_index.json, scheduler/, unet/ or transformer/, ...)."
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={key!r} is invalid: {path} cannot be read as JSON ({e}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.path={key!r} is invalid: {path} holds no JSON object.")
    return data


@dataclass
class DiffusersConfig(TargetConfig):
    """``conf/model/diffusers.yaml``: a local diffusers pipeline folder, sampled with its own scheduler's kernel.

    Attributes:
        path: the pipeline folder (``save_pretrained``'s layout; weights as safetensors).
        net_dtype: dtype the networks are loaded and run in.
        guidance: classifier-free guidance scale (null: the pipeline's own default; 1 = none); text pipelines only.
        negative_prompt: the unconditional prompt (``""``: the pipelines' default).
        resolution: image side or ``[H, W]`` (null: the pipeline's default).
        max_sequence_length: T5 tokens (SD3).
        max_batch: states per network call (twice the rows under guidance); null: all at once.
        decode_chunk: latents per VAE call.
        images_per_prompt: images per prompt (noise ids ``0 .. n * images_per_prompt - 1``).
        prompts: the prompts (:class:`~specsamp.models.sd3.PromptsConfig`; ``demo`` by default).
        clip: the CLIP model of ``metrics=[clip]``.
    """

    _target_: str = "specsamp.models.diffusers_pipeline.DiffusersConfig"
    name: str = "diffusers"
    path: str = MISSING
    net_dtype: str = "float32"
    guidance: float | None = None
    negative_prompt: str = ""
    resolution: Any = None
    max_sequence_length: int = 256
    max_batch: int | None = None
    decode_chunk: int = 4
    images_per_prompt: int = 1
    prompts: PromptsConfig = field(default_factory=lambda: PromptsConfig(source="demo"))
    clip: ClipConfig = field(default_factory=ClipConfig)

    # --- what the folder says, before anything loads --------------------------------------------------
    def _file(self, *parts) -> str:
        if not isinstance(self.path, str) or self.path in ("", MISSING):
            raise ConfigError(f"model.path={self.path!r} is invalid: set it to a local diffusers pipeline folder.")
        return os.path.join(os.path.expanduser(self.path), *parts)

    def _index(self) -> dict:
        return _read_json(self._file("model_index.json"), self.path)

    def kind(self) -> str:
        """``ddpm``, ``sd`` or ``sd3``: how the folder's pipeline class is driven.

        Raises:
            ConfigError: a pipeline class that is not covered.
        """
        cls = self._index().get("_class_name")
        if cls not in PIPELINES:
            raise ConfigError(
                f"model.path={self.path!r} is invalid: its pipeline is {cls!r}; model=diffusers takes "
                f"{', '.join(PIPELINES)}."
            )
        return PIPELINES[cls]

    def check_weights(self) -> None:
        """Refuse a folder whose networks have no ``*.safetensors`` file (a pickle is never loaded)."""
        for sub, entry in self._index().items():
            if sub.startswith("_") or sub not in NETWORK_FOLDERS or not isinstance(entry, list) or entry[0] is None:
                continue
            folder = self._file(sub)
            names = os.listdir(folder) if os.path.isdir(folder) else []
            if not any(n.endswith(".safetensors") for n in names):
                pickled = [n for n in names if n.endswith(PICKLES)]
                raise ConfigError(
                    f"model.path={self.path!r} is invalid: {sub}/ has no .safetensors weights"
                    + (f" (only {', '.join(sorted(pickled))}, a pickle format that is never loaded)" if pickled else "")
                    + "; save the pipeline with save_pretrained(..., safe_serialization=True)."
                )

    def guidance_scale(self) -> float:
        """The guidance scale: ``guidance``, or the pipeline class's own default (1 for an unconditional pipeline)."""
        kind = self.kind()
        if kind == "ddpm":
            return 1.0
        w = self.guidance
        if w is None:
            import inspect

            import diffusers

            cls = getattr(diffusers, self._index()["_class_name"])
            w = inspect.signature(cls.__call__).parameters["guidance_scale"].default
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(
                f"model.guidance={self.guidance!r} is invalid: must be a finite number or null (the "
                "pipeline's default; 1 or less = no guidance)."
            )
        return float(w)

    def rows_per_state(self) -> int:
        """Network rows per state: 2 for a text pipeline under guidance (scale > 1), else 1."""
        return 2 if self.guidance_scale() > 1 else 1

    def _network_config(self) -> dict:
        sub = "transformer" if self.kind() == "sd3" else "unet"
        return _read_json(self._file(sub, "config.json"), self.path)

    def _vae_factor(self) -> int:
        return 2 ** (len(_read_json(self._file("vae", "config.json"), self.path)["block_out_channels"]) - 1)

    def event_shape(self) -> tuple[int, int, int]:
        """``(C, h, w)`` of one state: the network's channels, the resolution over the VAE factor (the network's
        ``sample_size`` by default; images themselves for ``DDPMPipeline``).

        Raises:
            ConfigError: a resolution the VAE and network cannot take.
        """
        kind, net = self.kind(), self._network_config()
        f = 1 if kind == "ddpm" else self._vae_factor()
        size = net.get("sample_size")
        default = [size, size] if isinstance(size, int) else list(size)
        res = self.resolution
        if res is None:
            res = [d * f for d in default]
        elif isinstance(res, int) and not isinstance(res, bool):
            res = [res, res]
        elif isinstance(res, (list, tuple)):
            res = list(res)
        else:
            res = None
        patch = int(net.get("patch_size") or 1)
        if (
            res is None
            or len(res) != 2
            or not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in res)
            or any(r % (f * patch) for r in res)
            or (kind == "ddpm" and res != default)
        ):
            valid = f"{default}, the network's sample size" if kind == "ddpm" else f"positive multiples of {f * patch}"
            raise ConfigError(f"model.resolution={self.resolution!r} is invalid: need null or [H, W] ({valid}).")
        return int(net["in_channels"]), res[0] // f, res[1] // f

    def scheduler_plan(self, steps: int, kernel: str | None):
        """The run's :class:`~specsamp.integrations.schedulers.SchedulerPlan`, from ``scheduler/scheduler_config.json``
        alone (no weights load).

        Args:
            steps: the run's ``steps`` (the pipeline's ``num_inference_steps``).
            kernel: None (``kernel=auto``): the folder's own scheduler class; a scheduler kernel (``ddpm``,
                ``euler_ancestral``, ``flow_stochastic``, ``ddim``, ``dpmsolver_sde``): that scheduler class built from
                the folder's scheduler config (with the kernel's ``scheduler_flags``: ``stochastic_sampling=True``,
                ``algorithm_type="sde-dpmsolver++"``). The kernel config's own keys are not read: the folder's config
                is the scheduler (DDIM steps at ``eta = 1``).

        Raises:
            ConfigError: ``kernel=em`` (a diffusers network is trained on its scheduler's timesteps, not the
                paper's grid), a kernel of the other family (a flow pipeline takes ``flow_stochastic``; a
                noise-prediction one ``ddpm`` or ``euler_ancestral``), a scheduler or option whose step is not
                reproduced (:func:`~specsamp.integrations.schedulers.from_scheduler`), a bad folder.
        """
        import diffusers

        kind = self.kind()
        config = _read_json(self._file("scheduler", "scheduler_config.json"), self.path)
        own = config.get("_class_name")
        own_kernel = kernel_of_scheduler(str(own))
        flow = kind == "sd3" or (own_kernel is not None and own_kernel.flow)
        chosen = KERNELS.get(kernel) if kernel is not None and kernel in KERNELS else None
        if kernel is None:
            cls_name = own
        elif chosen is not None and chosen.schedulers and chosen.flow == flow:
            cls_name = chosen.schedulers[0]
            config = {**config, **chosen.scheduler_flags}
        else:
            valid = " or ".join(k.name for k in scheduler_kernels() if k.flow == flow)
            raise ConfigError(
                f"kernel={kernel} is invalid with model=diffusers and this {'flow' if flow else 'noise-prediction'} "
                f"pipeline ({self.path}): its network is trained on its scheduler's own timesteps; set "
                f"kernel=auto (the folder's {own}) or kernel={valid}."
            )
        cls = getattr(diffusers, str(cls_name), None)
        if cls is None or not isinstance(cls, type):
            raise refuse(str(cls_name))
        scheduler = cls.from_config(config)
        mu = None
        if flow and config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            _, h, w = self.event_shape()
            patch = int(self._network_config().get("patch_size") or 1)
            mu = calculate_shift(
                (h // patch) * (w // patch),
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        return from_scheduler(scheduler, steps, event_ndim=3, mu=mu)

    # --- the target ------------------------------------------------------------------------------------
    def load(self, device: str):
        """The pipeline from the folder: safetensors only, local files only, networks in ``net_dtype``.

        Raises:
            ConfigError: a folder without safetensors weights or that diffusers cannot load.
        """
        import importlib.util

        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as dlog

        self.check_weights()
        kwargs = {
            "use_safetensors": True,
            "local_files_only": True,
            "low_cpu_mem_usage": importlib.util.find_spec("accelerate") is not None,
        }
        try:  # diffusers >= 0.36 renamed torch_dtype to dtype
            from diffusers.utils import deprecation_utils

            kwargs["dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"] = self.torch_dtype(
                "net_dtype"
            )
        except ImportError:
            kwargs["torch_dtype"] = self.torch_dtype("net_dtype")
        loggers = [dlog]
        try:
            from transformers.utils import logging as tlog

            loggers.append(tlog)
        except ImportError:  # pragma: no cover - an unconditional pipeline needs no transformers
            pass
        bars = [lg for lg in loggers if lg.is_progress_bar_enabled()]
        for lg in bars:  # loading bars of a few components: noise in a run's log
            lg.disable_progress_bar()
        try:
            folder = os.path.expanduser(self.path)  # components saved as null (SD3 without T5) load as None
            pipe = DiffusionPipeline.from_pretrained(folder, **{**_absent_components(folder), **kwargs})
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(
                f"model.path={self.path!r} is invalid: diffusers cannot load it with safetensors "
                f"weights ({str(e).splitlines()[0] if str(e) else type(e).__name__})."
            ) from None
        finally:
            for lg in bars:
                lg.enable_progress_bar()
        pipe.set_progress_bar_config(disable=True)
        return pipe.to(device)

    def build(self, device: str, plan=None, *, pipeline=None, prompts=None) -> Target:
        """The target on ``plan`` (:meth:`scheduler_plan`'s; the runner passes it).

        Args:
            device: where the pipeline runs.
            plan: the run's scheduler plan.
            pipeline: an already loaded pipeline of the folder (tests).
            prompts: explicit prompt strings instead of ``prompts``.

        Raises:
            ConfigError: no plan, a bad value (named ``model.<key>=<value>``), a folder that cannot be loaded.
        """
        from .pipelines import Conditioning, encode, rows_of, velocity_model
        from .sd3 import SOURCES, image_plan, load_prompts

        if plan is None:
            raise ConfigError(
                "model=diffusers is built on its scheduler's plan: call scheduler_plan(steps, kernel) "
                "first and pass build(device, plan=plan) (run.py does)."
            )
        dtype = self.torch_dtype("dtype")
        check_positive("max_batch", self.max_batch, optional=True)
        for key in ("max_sequence_length", "decode_chunk", "images_per_prompt"):
            check_positive(key, getattr(self, key))
        kind, shape, w = self.kind(), self.event_shape(), self.guidance_scale()
        if kind != "ddpm" and self.prompts.source not in SOURCES and prompts is None:
            raise ConfigError(
                f"model.prompts.source={self.prompts.source!r} is invalid: valid values are {', '.join(SOURCES)}."
            )
        clip = self.clip.load_kwargs() if kind != "ddpm" else None
        pipe = pipeline if pipeline is not None else self.load(device)
        decode = self._decoder(pipe, kind)
        if kind == "ddpm":
            model = velocity_model(pipe, kind, plan, Conditioning(), shape, 1.0, dtype)
            return Target(model, decode=decode, max_batch=self.max_batch)
        p = self.prompts
        texts = load_prompts(
            p.source, p.n, p.seed, captions_json=p.captions_json, path=p.path, prompts=prompts, n_key="n_samples"
        )
        layout = image_plan(texts, self.images_per_prompt)
        with torch.no_grad():
            cond = encode(
                pipe,
                kind,
                texts,
                [self.negative_prompt] * len(texts),
                w > 1,
                1,
                max_sequence_length=self.max_sequence_length,
            )
        model = velocity_model(pipe, kind, plan, cond, shape, w, dtype)
        prompt_index = torch.as_tensor(layout.prompt_index)

        def cond_for(ids, seed):
            if int(ids.max()) >= prompt_index.numel():
                raise ConfigError(
                    f"n_samples is invalid: the prompt plan has {prompt_index.numel()} images "
                    "(model.prompts.n x model.images_per_prompt)."
                )
            return rows_of(model, prompt_index[ids.cpu()])

        return Target(
            model,
            cond_for=cond_for,
            decode=decode,
            prompts_for=lambda ids: [layout.prompts[int(layout.prompt_index[int(i)])] for i in ids],
            clip=clip,
            max_batch=self.max_batch,
            indices=torch.as_tensor(layout.noise_id),
        )

    def _decoder(self, pipe, kind):
        """``latents [n, C, h, w] -> images [n, 3, H, W]`` float32 in ``[-1, 1]`` on the CPU, as the pipeline decodes."""
        if kind == "ddpm":
            return lambda x: x.float().clamp(-1, 1).cpu()
        vae, chunk = pipe.vae, self.decode_chunk
        scale = float(vae.config.scaling_factor)
        shift = float(getattr(vae.config, "shift_factor", None) or 0.0) if kind == "sd3" else 0.0

        def decode(x):
            out = []
            with torch.no_grad():
                for i in range(0, x.shape[0], chunk):
                    z = x[i : i + chunk].to(vae.device, torch.float32) / scale + shift
                    out.append(vae.decode(z.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1).cpu())
            return torch.cat(out)

        return decode


__all__ = ["DiffusersConfig"]
