"""SD3 adapter: an analytic velocity behind the transformer's signature checks every change of variables
exactly; tiny randomly initialised diffusers networks (built offline from configs) run the whole path."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("diffusers")

from helpers import two_sample_pvalues  # noqa: E402

from specsamp.errors import ConfigError  # noqa: E402
from specsamp.models.gmm import GaussianMixture  # noqa: E402
from specsamp.models.sd3 import (  # noqa: E402
    TIMESTEP_SCALE,
    SD3Config,
    SD3UnavailableError,
    SD3Velocity,
    decode_latents,
    load_sd3,
)
from specsamp.sampler import sample_speculative, sample_standard  # noqa: E402
from specsamp.schedule import Schedule  # noqa: E402
from specsamp.trees import DraftTree  # noqa: E402

SHAPE = (2, 4, 4)  # analytic latent: C x H x W, d = 32


class GMMTransformer(torch.nn.Module):
    """SD3's call signature around an exact velocity, keyed on the text embeddings.

    Data law given embeddings: ``x0 = y + s u`` with ``y`` from a fixed Gaussian mixture, ``u`` a fixed
    unit vector and ``s = pooled[:, 0] + encoder_hidden_states[:, 0, 0]``. On the linear path,
    ``x - (1 - sigma) s u`` follows the mixture's path, so ``v(x) = v_gmm(x - (1 - sigma) s u) - s u``.
    ``sigma = timestep / 1000`` (SD3's convention). Records the batch size of every call.
    """

    def __init__(self, joint_dim=6, pooled_dim=3):
        super().__init__()
        d = math.prod(SHAPE)
        self.gmm = GaussianMixture(dim=d, components=3, layout_seed=5, dtype=torch.float64)
        g = torch.Generator().manual_seed(11)
        u = torch.randn(d, generator=g, dtype=torch.float64)
        self.register_buffer("u", u / u.norm())
        self.config = SimpleNamespace(
            in_channels=SHAPE[0],
            patch_size=2,
            sample_size=SHAPE[1],
            pos_embed_max_size=None,
            joint_attention_dim=joint_dim,
            pooled_projection_dim=pooled_dim,
        )
        self.batch_sizes = []

    @property
    def dtype(self):
        return torch.float64

    @property
    def device(self):
        return self.u.device

    def velocity(self, x, sigma, s):
        """Exact velocity ``[b, *SHAPE]`` at float64 ``sigma [b]`` with shifts ``s [b]``."""
        xf = x.reshape(x.shape[0], -1).double()
        xp = xf - (1 - sigma)[:, None] * s[:, None] * self.u
        return (self.gmm(xp, sigma) - s[:, None] * self.u).reshape(x.shape)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, return_dict=True):
        assert timestep.dtype == torch.float32
        self.batch_sizes.append(hidden_states.shape[0])
        s = pooled_projections[:, 0].double() + encoder_hidden_states[:, 0, 0].double()
        v = self.velocity(hidden_states, timestep.double() / 1000.0, s).to(hidden_states.dtype)
        return (v,) if not return_dict else SimpleNamespace(sample=v)


def _tables(shifts, joint_dim=6, pooled_dim=3, seq=3):
    """Embedding tables whose shift ``s`` is ``shifts[i]`` for row ``i``, split between the two inputs."""
    n = len(shifts)
    g = torch.Generator().manual_seed(7)
    emb = torch.randn(n, seq, joint_dim, generator=g, dtype=torch.float64)
    pooled = torch.randn(n, pooled_dim, generator=g, dtype=torch.float64)
    s = torch.as_tensor(shifts, dtype=torch.float64)
    emb[:, 0, 0] = 0.4 * s
    pooled[:, 0] = 0.6 * s
    return emb, pooled


def _gmm_model(guidance, shifts=(1.0, -0.8)):
    net = GMMTransformer()
    emb, pooled = _tables(shifts)
    nemb, npooled = _tables([0.0])
    model = SD3Velocity(net, emb, pooled, nemb, npooled, guidance=guidance, dtype=torch.float64)
    return model, net, (emb, pooled, nemb, npooled)


def test_guided_velocity_exact():
    """v_u + w (v_c - v_u) with sigma passed as timestep = 1000 sigma, in one call of 2b rows."""
    w = 4.0
    model, net, (emb, pooled, nemb, npooled) = _gmm_model(w)
    assert model.event_shape == SHAPE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, *SHAPE, generator=g, dtype=torch.float64)
    sigma = torch.tensor([0.9, 0.5, 0.2, 0.01], dtype=torch.float64)
    prompt = torch.tensor([0, 1, 1, 0])
    v = model(x, sigma, prompt=prompt)
    assert net.batch_sizes == [8]  # one transformer call, [uncond; cond]
    # reference: SD3 sees sigma through a float32 timestep, like diffusers' pipeline
    sig = (sigma.float() * TIMESTEP_SCALE).double() / 1000.0
    s_c = torch.tensor([1.0, -0.8], dtype=torch.float64)[prompt]
    v_c = net.velocity(x, sig, s_c)
    v_u = net.velocity(x, sig, torch.zeros(4, dtype=torch.float64))
    ref = v_u + w * (v_c - v_u)
    torch.testing.assert_close(v, ref, rtol=1e-12, atol=1e-12)
    # per-row embeddings give the same, and the negative table is shared
    v_rows = model(x, sigma, prompt_embeds=emb[prompt], pooled_prompt_embeds=pooled[prompt])
    torch.testing.assert_close(v_rows, ref, rtol=1e-12, atol=1e-12)
    # guidance 1: the conditional velocity alone, one call of b rows
    plain, net1, _ = _gmm_model(1.0)
    torch.testing.assert_close(plain(x, sigma, prompt=prompt), v_c, rtol=1e-12, atol=1e-12)
    assert net1.batch_sizes == [4]
    # what the samplers charge to target_rows per state: the guided call's two rows, or one
    assert model.rows_per_state == 2 and plain.rows_per_state == 1


def test_diffusers_timestep_and_sign_convention():
    """Pin the facts the adapter relies on: timesteps = 1000 sigma and the Euler step x + (s' - s) v."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(num_inference_steps=5)
    torch.testing.assert_close(sched.timesteps, sched.sigmas[:-1] * TIMESTEP_SCALE)
    x, v = torch.randn(1, *SHAPE), torch.randn(1, *SHAPE)
    out = sched.step(v, sched.timesteps[1], x, return_dict=False)[0]
    s0, s1 = sched.sigmas[1], sched.sigmas[2]
    torch.testing.assert_close(out, x + (s1 - s0) * v)


def test_speculative_matches_standard_law_under_guidance():
    """D-GRS on the (2, 2) tree, tree execution, reproduces the guided standard sampler's law.

    Seeds 1 (standard) and 2 (speculative), 300 trajectories each, half per prompt; T = 8, eps = 0.8,
    shift 3, guidance 4. Two-sample KS, each p > 1e-3: per prompt on the projection onto ``u`` (the
    direction guidance acts along), and on 3 fixed random projections of all samples. Power check: the
    same statistic separates guidance 4 from guidance 3 (p < 1e-6).
    """
    from scipy import stats

    model, net, _ = _gmm_model(4.0)
    sched = Schedule.make(8, 0.8, shift=3.0)
    m = 300
    cond = {"prompt": torch.arange(m) % 2}
    std = sample_standard(model, sched, m, seed=1, cond=cond)
    spec = sample_speculative(model, sched, DraftTree.uniform(2, 2), "dgrs", m, execution="tree", seed=2, cond=cond)
    assert torch.isfinite(spec.samples).all()
    assert spec.nfe.double().mean() < sched.steps - 2  # speculation accepted something

    def along_u(res, k):
        return (res.samples[k::2].reshape(m // 2, -1).double() @ net.u).numpy()

    for k in (0, 1):
        assert stats.ks_2samp(along_u(std, k), along_u(spec, k)).pvalue > 1e-3
    for p in two_sample_pvalues(std.samples, spec.samples, directions=3, seed=0):
        assert p > 1e-3
    weaker = sample_standard(_gmm_model(3.0)[0], sched, m, seed=3, cond=cond)
    assert stats.ks_2samp(along_u(std, 0), along_u(weaker, 0)).pvalue < 1e-6
    # the conditioning reaches the velocity: the prompts pull the samples apart along u
    assert along_u(spec, 0).mean() - along_u(spec, 1).mean() > 2.0


# ----------------------------------------------------------------------------------------------
# Tiny real networks


def _tiny_transformer():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=8,
        pos_embed_max_size=8,
        dual_attention_layers=(0,),  # the SD3.5 block type
        qk_norm="rms_norm",
    ).eval()


def _tiny_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
        scaling_factor=1.5305,  # SD3's values
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


@pytest.fixture(scope="module")
def tiny():
    return _tiny_transformer(), _tiny_vae()


def _embeds(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, 16, generator=g), torch.randn(n, 8, generator=g)


def test_tiny_sd3_speculative_generation(tiny):
    transformer, vae = tiny
    calls = []
    handle = transformer.register_forward_hook(lambda mod, args, kwargs_out=None: calls.append(1))
    try:
        emb, pooled = _embeds(2)
        nemb, npooled = _embeds(1, seed=1)
        model = SD3Velocity(transformer, emb, pooled, nemb, npooled, guidance=7.0)
        assert model.event_shape == (4, 8, 8) and model.dtype == torch.float32
        sched = Schedule.make(6, 0.8, shift=3.0)
        cond = {"prompt": torch.tensor([0, 1])}
        res = sample_speculative(model, sched, DraftTree.uniform(2, 2), "dgrs", 2, execution="tree", cond=cond)
        assert res.samples.shape == (2, 4, 8, 8) and torch.isfinite(res.samples).all()
        # one NFE = one transformer call: step 0, the speculative calls, and at most one final call
        assert res.batch_nfe + 1 <= len(calls) == model.calls <= res.batch_nfe + 2
        images = decode_latents(vae, res.samples, chunk=1)
        assert images.shape == (2, 3, 16, 16) and images.dtype == torch.float32
        assert torch.isfinite(images).all() and images.min() >= -1 and images.max() <= 1
        torch.testing.assert_close(decode_latents(vae, res.samples), images)  # chunking changes nothing
        # the standard sampler makes exactly one call per step
        calls.clear()
        model.calls = 0
        std = sample_standard(model, sched, 2, cond=cond)
        assert len(calls) == sched.steps and torch.isfinite(std.samples).all()
    finally:
        handle.remove()


def test_tiny_sd3_bf16_network(tiny):
    """net_dtype=bfloat16 (the SD3 setting): states and velocities stay float32, values match float32."""
    transformer, _ = tiny
    emb, pooled = _embeds(2)
    nemb, npooled = _embeds(1, seed=1)
    ref = SD3Velocity(transformer, emb, pooled, nemb, npooled, guidance=2.0)
    low = SD3Velocity(copy.deepcopy(transformer), emb, pooled, nemb, npooled, guidance=2.0, net_dtype="bfloat16")
    assert low.transformer.dtype == torch.bfloat16 and low.dtype == torch.float32
    x = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    sigma = torch.tensor([0.9, 0.5, 0.1], dtype=torch.float64)
    prompt = torch.tensor([1, 0, 1])
    a, b = ref(x, sigma, prompt=prompt), low(x, sigma, prompt=prompt)
    assert b.dtype == torch.float32
    assert float((a - b).norm() / a.norm()) < 0.05


def test_adapter_errors(tiny):
    transformer, _ = tiny
    emb, pooled = _embeds(2)
    nemb, npooled = _embeds(1, seed=1)
    with pytest.raises(ValueError, match="in_channels=4"):
        SD3Velocity(transformer, emb, pooled, nemb, npooled, latent_shape=(16, 8, 8))
    with pytest.raises(ValueError, match="patch_size=2"):
        SD3Velocity(transformer, emb, pooled, nemb, npooled, latent_shape=(4, 7, 8))
    with pytest.raises(ValueError, match="pos_embed_max_size=8"):
        SD3Velocity(transformer, emb, pooled, nemb, npooled, latent_shape=(4, 32, 32))
    with pytest.raises(ValueError, match="joint_attention_dim"):
        SD3Velocity(transformer, torch.zeros(2, 5, 12), pooled, nemb, npooled)
    with pytest.raises(ValueError, match="guidance"):
        SD3Velocity(transformer, emb, pooled, nemb, npooled, guidance=float("nan"))
    with pytest.raises(ValueError, match="unconditional"):
        SD3Velocity(transformer, emb, pooled, guidance=7.0)(
            torch.zeros(1, 4, 8, 8), torch.ones(1), prompt=torch.zeros(1, dtype=torch.long)
        )
    model = SD3Velocity(transformer, emb, pooled, nemb, npooled)
    with pytest.raises(ValueError, match=r"prompt indices must lie in \[0, 2\)"):
        model(torch.zeros(1, 4, 8, 8), torch.ones(1), prompt=torch.tensor([2]))
    with pytest.raises(ValueError, match="expected"):
        model(torch.zeros(1, 4, 4, 4), torch.ones(1), prompt=torch.tensor([0]))


class FakePipeline:
    """What :meth:`SD3Config.build` uses of ``StableDiffusion3Pipeline``: modules and ``encode_prompt``."""

    def __init__(self, transformer, vae):
        self.transformer, self.vae = transformer, vae
        self.text_encoder = self.text_encoder_2 = self.text_encoder_3 = object()
        self.encoded = []

    def encode_prompt(
        self,
        prompt,
        prompt_2,
        prompt_3,
        device,
        num_images_per_prompt,
        do_classifier_free_guidance,
        max_sequence_length,
    ):
        assert not do_classifier_free_guidance and prompt_2 is None and prompt_3 is None
        self.encoded.extend(prompt)
        rows = [_embeds(1, seed=sum(map(ord, p)) % 1000) for p in prompt]
        return torch.cat([r[0] for r in rows]), None, torch.cat([r[1] for r in rows]), None


def test_sd3_config_builds_a_target(tiny):
    transformer, vae = tiny
    pipe = FakePipeline(transformer, vae)
    cfg = SD3Config(
        resolution=16, net_dtype="float32", guidance=3.0, decode_chunk=1
    )  # tiny VAE factor 2 -> latent 4x8x8
    cfg.prompts.source, cfg.prompts.n = "demo", 2
    target = cfg.build("cpu", pipeline=pipe)
    assert target.model.event_shape == (4, 8, 8)
    texts = target.prompts_for(torch.arange(2))
    assert len(texts) == 2 and pipe.encoded == texts + [""]
    assert pipe.text_encoder is None and pipe.text_encoder_3 is None  # freed after encoding
    assert target.cond_for(torch.arange(2), 0)["prompt"].tolist() == [0, 1] and target.indices.tolist() == [0, 1]
    assert target.clip["model_name"] == "ViT-L-14-quickgelu" and target.max_batch is None
    res = sample_standard(
        target.model, Schedule.make(4, 0.8, shift=3.0), indices=target.indices, cond=target.cond_for(target.indices, 0)
    )
    images = target.decode(res.samples)
    assert images.shape == (2, 3, 16, 16) and torch.isfinite(images).all()
    with pytest.raises(ConfigError, match="n_samples is invalid: the prompt plan has 2 images"):
        target.cond_for(torch.arange(3), 0)
    for key, value, match in (
        ("resolution", 18, "model.resolution"),
        ("net_dtype", "float8", "model.net_dtype"),
        ("max_batch", 0, "model.max_batch=0"),
        ("guidance", float("nan"), "model.guidance"),
    ):
        with pytest.raises(ConfigError, match=match):
            SD3Config(**{**cfg.__dict__, key: value}).build("cpu", pipeline=FakePipeline(transformer, vae))


def test_load_sd3_fails_fast_and_clearly(tmp_path):
    with pytest.raises(SD3UnavailableError, match="not a directory"):
        load_sd3(str(tmp_path / "missing"), device="cpu")
    with pytest.raises(SD3UnavailableError, match="not a loadable diffusers SD3 directory"):
        load_sd3(str(tmp_path), device="cpu")
    with pytest.raises(SD3UnavailableError, match="gated.*huggingface-cli login"):
        load_sd3(device="cpu", local_files_only=True, cache_dir=str(tmp_path))
