"""A tiny random Stable Diffusion pipeline, built locally (no hub access), saved with
``save_pretrained`` so it loads with ``DiffusionPipeline.from_pretrained`` as a hub model does.

Its weights are random: its images are noise. The sizes are those of diffusers' own fast tests
(``get_dummy_components`` of tests/pipelines/stable_diffusion): a denoising step of a 64x64
image takes milliseconds on a CPU. Its VAE has two blocks, so latents are half the image's size
(a real Stable Diffusion VAE: an eighth).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# The CLIP tokenizer's alphabet: every byte as a printable character (GPT-2's byte-level BPE),
# alone and at the end of a word; no merges, so a word is one token per character.
START, END = "<|startoftext|>", "<|endoftext|>"


def _byte_chars() -> list[str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _write_tokenizer(out: Path) -> None:
    from transformers import CLIPTokenizer

    chars = _byte_chars()
    vocab = {t: i for i, t in enumerate(chars + [c + "</w>" for c in chars] + [START, END])}
    src = out / "tokenizer-src"
    src.mkdir()
    (src / "vocab.json").write_text(json.dumps(vocab))
    (src / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(src / "vocab.json"), str(src / "merges.txt"), model_max_length=77)
    tok.save_pretrained(out / "tokenizer")
    shutil.rmtree(src)


def build_tiny_image_model(out_dir: str | os.PathLike[str]) -> Path:
    """Write the pipeline to ``out_dir`` (model_index.json and one folder per component)."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
    )
    vae = AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
    )
    tokenizer = CLIPTokenizer.from_pretrained(out / "tokenizer")
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=tokenizer.convert_tokens_to_ids(START),
            eos_token_id=tokenizer.convert_tokens_to_ids(END),
            pad_token_id=tokenizer.convert_tokens_to_ids(END),
            hidden_size=32,
            intermediate_size=37,
            layer_norm_eps=1e-05,
            num_attention_heads=4,
            num_hidden_layers=5,
            vocab_size=len(tokenizer),
        )
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out)  # type: ignore[attr-defined]
    return out


def default_image_model_path() -> Path:
    """The pipeline a media worker loads when SPOOL_IMAGE_MODEL is unset: the tiny one, built on
    first use into the user's cache (``$XDG_CACHE_HOME/spool``, else ``~/.cache/spool``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spool"
    path = cache / "tiny-image-model"
    if (path / "model_index.json").is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    # Built aside and renamed: two workers starting at once never load a half-written one.
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".building-"))
    build_tiny_image_model(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another worker's build won
        shutil.rmtree(tmp, ignore_errors=True)
    return path
