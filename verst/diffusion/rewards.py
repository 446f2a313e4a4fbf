"""Batched image rewards: built-ins that need no hub, a CLIP-style scorer, or an import path.

A reward is a callable `(images_B_3_H_W in [0, 1], prompts) -> list[float]`, one score per
image. `shape_colour` scores the procedural captions by pixel statistics; `clip` scores with a
CLIP model from a local directory (`diffusion.clip_path`) as PickScore does; any other value of
`diffusion.reward` is an import path 'pkg.mod:fn' to a callable of the same form.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import torch

from verst.diffusion import shapes
from verst.plugin_loader import load_named

# the fill of a shape's bounding box: a disc covers pi/4 of its square, a triangle half
SHAPE_FILL = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}
COLOUR_TOLERANCE = 0.35  # max RGB distance of a pixel that counts as the requested colour
MIN_PIXELS = 4


class ImageReward(Protocol):
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> list[float]: ...


def shape_colour_score(image: torch.Tensor, prompt: str) -> float:
    """In [0, 1]: half for the requested colour's share of the bright pixels, half more as the
    colour's blob fills its bounding box as the requested shape does."""
    colour, shape = shapes.parse_caption(prompt)
    target = torch.tensor(shapes.COLOURS[colour]).view(3, 1, 1)
    distance = (image - target).norm(dim=0)
    mask = distance < COLOUR_TOLERANCE
    bright = image.max(dim=0).values > 0.4
    count, other = int(mask.sum()), int((bright & ~mask).sum())
    if count < MIN_PIXELS:
        return 0.0
    colour_share = count / (count + other)
    ys, xs = mask.nonzero(as_tuple=True)
    box = (int(ys.max() - ys.min()) + 1) * (int(xs.max() - xs.min()) + 1)
    fill = count / box
    shape_match = max(0.0, 1.0 - abs(fill - SHAPE_FILL[shape]) / 0.25)
    return 0.5 * colour_share + 0.5 * colour_share * shape_match


def shape_colour(images: torch.Tensor, prompts: list[str]) -> list[float]:
    """The built-in procedural reward, one score per image."""
    return [
        shape_colour_score(img.float().cpu(), p) for img, p in zip(images, prompts, strict=True)
    ]


class ClipScore:
    """exp(logit_scale) x cosine(text, image) / `divisor` with a local CLIP (PickScore's form:
    PickScore divides by 26 so its scores sit near [0, 1])."""

    MEAN = (0.48145466, 0.4578275, 0.40821073)
    STD = (0.26862954, 0.26130258, 0.27577711)

    def __init__(self, path: str | Path, *, divisor: float = 26.0, device: str = "cpu"):
        from transformers import AutoTokenizer, CLIPModel

        path = Path(path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"diffusion.clip_path: {str(path)!r} holds no CLIP config.json")
        self.model = CLIPModel.from_pretrained(path).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.size = self.model.config.vision_config.image_size
        self.divisor, self.device = divisor, device

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str]) -> list[float]:
        pixels = torch.nn.functional.interpolate(
            images.float().to(self.device), size=(self.size, self.size), mode="bicubic"
        )
        mean = torch.tensor(self.MEAN, device=self.device).view(1, 3, 1, 1)
        std = torch.tensor(self.STD, device=self.device).view(1, 3, 1, 1)
        image_emb = _embedding(self.model.get_image_features(pixel_values=(pixels - mean) / std))
        text = self.tokenizer(prompts, padding=True, return_tensors="pt").to(self.device)
        text_emb = _embedding(self.model.get_text_features(**text))
        cos = torch.nn.functional.cosine_similarity(image_emb, text_emb, dim=-1)
        return (self.model.logit_scale.exp() * cos / self.divisor).tolist()


def _embedding(output) -> torch.Tensor:
    """The projected embedding: transformers >= 5 wraps it as the output's `pooler_output`."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def load_reward(name: str, clip_path: str | None) -> ImageReward:
    """The reward `diffusion.reward` names (a built-in or an import path)."""
    if name == "clip":
        if clip_path is None:
            raise ValueError(
                "diffusion.reward=clip needs diffusion.clip_path (a local CLIP directory)"
            )
        return ClipScore(clip_path)
    builtins = {"shape_colour": shape_colour, "clip": None}
    return load_named(name, builtins, ImageReward, field="diffusion.reward", kind="image reward")
