"""A tiny, randomly initialised ``StableDiffusion3Pipeline`` written to disk, offline (no hub access).

Same structure and geometry as Stable Diffusion 3.5 -- an ``SD3Transformer2DModel`` on 16 latent
channels with SD3.5's dual-attention block and RMS qk-norm, an ``AutoencoderKL`` with four blocks (spatial
factor 8) and SD3's ``scaling_factor``/``shift_factor``, two ``CLIPTextModelWithProjection`` encoders
with ``CLIPTokenizer``s, a ``FlowMatchEulerDiscreteScheduler`` with shift 3 -- but a few thousand
parameters per network and no T5 (``text_encoder_3 = tokenizer_3 = None``: the pipeline then pads the
CLIP embeddings with zeros to ``joint_attention_dim``, as for SD3 loaded without T5).

The tokenizers use a hand-written byte-level BPE vocabulary in CLIP's layout: the 256 byte symbols,
the same with the end-of-word marker ``</w>``, a handful of merges, then ``<|startoftext|>`` and
``<|endoftext|>``. Any text tokenizes (byte fallback), so every prompt works.

``python tests/tiny_sd3.py DIR`` writes the pipeline into ``DIR``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

RESOLUTION = 64  # image side; latent 16 x 8 x 8; 4 x 4 transformer patches of 2
LATENT_CHANNELS = 16
CLIP_DIMS = ((8, 8), (16, 16))  # (hidden, projection) of text_encoder (CLIP-L role) and text_encoder_2 (CLIP-G role)
JOINT_ATTENTION_DIM = 32  # >= 8 + 16 (concatenated CLIP hidden states, zero-padded to it)
POOLED_DIM = sum(p for _, p in CLIP_DIMS)  # concatenated pooled projections
MERGES = ("t h", "th e</w>", "o n", "i n", "e r", "a n")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from bytes to printable unicode symbols."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def clip_vocab() -> tuple[dict[str, int], list[str]]:
    """``(vocab, merges)`` in CLIP's layout (byte symbols, byte symbols + ``</w>``, merges, special tokens);
    merges as pairs."""
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols]
    tokens += ["".join(m.split()) for m in MERGES]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in MERGES]


def tiny_tokenizer(pad_token: str = "<|endoftext|>"):
    """A ``CLIPTokenizer`` on :func:`clip_vocab` (``model_max_length`` 77, as SD3's)."""
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab()
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=77)


def tiny_text_encoder(hidden: int, projection: int, seed: int):
    """A two-layer ``CLIPTextModelWithProjection`` over :func:`clip_vocab` (pooled at ``<|endoftext|>``)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    vocab, _ = clip_vocab()
    cfg = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=projection,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(cfg).eval()


def tiny_transformer(seed: int = 0):
    """``SD3Transformer2DModel`` with SD3.5's block types, 16 latent channels, 2 layers of width 16."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=RESOLUTION // 8,
        patch_size=2,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=JOINT_ATTENTION_DIM,
        caption_projection_dim=16,
        pooled_projection_dim=POOLED_DIM,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    ).eval()


def tiny_vae(seed: int = 1):
    """``AutoencoderKL`` with four blocks (factor 8), 16 latent channels, SD3's scaling and shift factors."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=RESOLUTION,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


def tiny_pipeline():
    """The tiny ``StableDiffusion3Pipeline`` (no T5)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    (h1, p1), (h2, p2) = CLIP_DIMS
    return StableDiffusion3Pipeline(
        transformer=tiny_transformer(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(h1, p1, seed=2),
        tokenizer=tiny_tokenizer(),
        text_encoder_2=tiny_text_encoder(h2, p2, seed=3),
        tokenizer_2=tiny_tokenizer(pad_token="!"),  # SD3's CLIP-G tokenizer pads with "!"
        text_encoder_3=None,
        tokenizer_3=None,
    )


def write_tokenizer_files(directory: str | Path, pad_token: str = "<|endoftext|>") -> Path:
    """Write a CLIP tokenizer by hand in the layout of the SD3 hub repositories' ``tokenizer*/`` folders.

    ``vocab.json``, ``merges.txt`` (``#version: 0.2`` header, one merge per line),
    ``special_tokens_map.json`` and ``tokenizer_config.json``; no ``tokenizer.json``, so transformers
    builds the tokenizer from the vocabulary and merges, as it does for the real repositories.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = clip_vocab()
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    special = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": pad_token,
    }
    (directory / "special_tokens_map.json").write_text(json.dumps(special), encoding="utf-8")
    config = {
        **special,
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": 77,
        "do_lower_case": True,
        "clean_up_tokenization_spaces": True,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def write_tiny_sd3(directory: str | Path) -> Path:
    """Save :func:`tiny_pipeline` with ``save_pretrained`` into ``directory`` (created) and return it.

    The two tokenizer folders are then rewritten by hand (:func:`write_tokenizer_files`), in the hub
    repositories' format.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny_pipeline().save_pretrained(directory)
    for sub, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
        shutil.rmtree(directory / sub)
        write_tokenizer_files(directory / sub, pad)
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tiny_sd3.py DIR")
    print(write_tiny_sd3(sys.argv[1]))
