"""One diffusers text-to-image pipeline, loaded once, called for one image at a time.

Knows nothing of Redis or Celery: ``generate`` reports each denoising step to a callback that
may stop it (a cancel, a timeout, a lost lease), through diffusers' ``callback_on_step_end`` and
the pipeline's ``_interrupt`` flag, which makes the remaining steps no-ops.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

OnStep = Callable[[int, int], bool]  # (step done, of steps) -> go on


@dataclass(frozen=True)
class ImageSpec:
    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    guidance_scale: float | None = None  # None: the pipeline's default
    negative_prompt: str | None = None


@dataclass(frozen=True)
class Image:
    png: bytes
    width: int
    height: int


class ImagePipeline:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32") -> None:
        from diffusers import DiffusionPipeline  # heavy: only in the media worker

        self.device = device
        pipe: Any = DiffusionPipeline.from_pretrained(model, dtype=getattr(torch, dtype))
        self.pipe = pipe.to(device)
        self.pipe.set_progress_bar_config(disable=True)

    def generate(self, spec: ImageSpec, on_step: OnStep) -> Image | None:
        """The image as PNG; None when ``on_step`` stopped it."""
        stopped = False

        def callback(pipe: Any, i: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            nonlocal stopped
            if not stopped and not on_step(i + 1, int(getattr(pipe, "num_timesteps", spec.steps))):
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
        buf = io.BytesIO()
        image.save(buf, format="PNG")  # PIL writes no timestamp: the same pixels, the same bytes
        return Image(buf.getvalue(), image.width, image.height)
