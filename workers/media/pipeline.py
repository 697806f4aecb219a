"""One diffusers text-to-image pipeline, loaded once, called for one image at a time.

It knows nothing of Redis or Celery. ``generate`` reports each denoising step to a callback that
may stop it (a cancel, a timeout, a lost lease), through diffusers' ``callback_on_step_end`` and
the pipeline's ``_interrupt`` flag, which makes the remaining steps no-ops. At the steps the spec
names (``preview_steps``) it also hands the callback a preview, the current latents decoded by the
pipeline's own VAE and shrunk to at most ``PREVIEW_SIDE`` pixels a side.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

PREVIEW_SIDE = 128  # a preview's longer side at most (pixels)


@dataclass(frozen=True)
class Image:
    png: bytes
    width: int
    height: int


OnStep = Callable[[int, int, "Image | None"], bool]  # (step done, of steps, its preview) -> go on


def preview_steps(steps: int, previews: int) -> frozenset[int]:
    """The steps after which a part with ``previews`` partial images shows one: spread evenly,
    the last one before the final step where there is room."""
    return frozenset(max(1, min(steps, round(steps * i / (previews + 1)))) for i in range(1, previews + 1))


@dataclass(frozen=True)
class ImageSpec:
    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    guidance_scale: float | None = None  # None: the pipeline's default
    negative_prompt: str | None = None
    preview_steps: frozenset[int] = frozenset()  # the steps (1-based) to decode a preview after


class ImagePipeline:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32") -> None:
        from diffusers import DiffusionPipeline  # heavy: only in the media worker
        from diffusers.utils import logging as diffusers_logging

        # A progress bar in a service's log is noise, and its unended line swallows the start of
        # the next line (spool up's own).
        diffusers_logging.disable_progress_bar()
        self.device = device
        pipe: Any = DiffusionPipeline.from_pretrained(model, dtype=getattr(torch, dtype))
        self.pipe = pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)

    def generate(self, spec: ImageSpec, on_step: OnStep) -> Image | None:
        """The image as PNG; None when ``on_step`` stopped it."""
        stopped = False

        def callback(pipe: Any, i: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            nonlocal stopped
            if stopped:
                return tensors
            preview = self._preview(tensors.get("latents")) if i + 1 in spec.preview_steps else None
            if not on_step(i + 1, int(getattr(pipe, "num_timesteps", spec.steps)), preview):
                stopped = True
                pipe._interrupt = True  # diffusers skips the remaining steps (then decodes once)
            return tensors

        kwargs: dict[str, Any] = {
            "prompt": spec.prompt,
            "width": spec.width,
            "height": spec.height,
            "num_inference_steps": spec.steps,
            "generator": torch.Generator(device=self.device).manual_seed(spec.seed),
            "callback_on_step_end": callback,
        }
        if spec.guidance_scale is not None:
            kwargs["guidance_scale"] = spec.guidance_scale
        if spec.negative_prompt is not None:
            kwargs["negative_prompt"] = spec.negative_prompt
        with torch.inference_mode():
            image = self.pipe(**kwargs).images[0]
        if stopped:
            return None
        return png_of(image)

    def _preview(self, latents: Any) -> Image | None:
        """The latents decoded as the pipeline decodes its output, small; None for a pipeline
        without a VAE and an image processor (a preview is best effort, never a failure)."""
        vae, processor = getattr(self.pipe, "vae", None), getattr(self.pipe, "image_processor", None)
        if latents is None or vae is None or processor is None:
            return None
        try:
            scale = getattr(vae.config, "scaling_factor", 1.0)
            decoded = vae.decode(latents[:1] / scale, return_dict=False)[0]
            image = processor.postprocess(decoded, output_type="pil")[0]
        except Exception:
            log.warning("could not decode a preview; going on without it", exc_info=True)
            return None
        image.thumbnail((PREVIEW_SIDE, PREVIEW_SIDE))
        return png_of(image)


def png_of(image: Any) -> Image:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # PIL writes no timestamp: the same pixels, the same bytes
    return Image(buf.getvalue(), image.width, image.height)
