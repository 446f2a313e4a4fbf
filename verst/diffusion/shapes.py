"""Procedural coloured shapes with captions: the data a tiny diffusion model is pre-trained on.

A caption is "a {colour} {shape}"; its class id is `colour * len(SHAPES) + shape`, and the
extra id `NULL_CLASS` stands for the empty prompt (the unconditional branch of guidance).
Images are float RGB in [0, 1], shape (3, H, W), on a black background.
"""

from __future__ import annotations

import torch

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.1, 0.1),
    "green": (0.1, 0.9, 0.1),
    "blue": (0.15, 0.25, 1.0),
    "yellow": (1.0, 0.9, 0.1),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
CAPTIONS: tuple[str, ...] = tuple(f"a {c} {s}" for c in COLOURS for s in SHAPES)
NULL_CLASS = len(CAPTIONS)


def caption_class(prompt: str, *, field: str = "prompt") -> int:
    """The class id of a caption ('' is the unconditional class); ValueError naming `field`."""
    text = " ".join(prompt.lower().split())
    if text == "":
        return NULL_CLASS
    if text not in CAPTIONS:
        raise ValueError(
            f"{field}: {prompt!r} is not a caption this model knows; known: {', '.join(CAPTIONS)}"
        )
    return CAPTIONS.index(text)


def parse_caption(prompt: str) -> tuple[str, str]:
    """(colour, shape) of a known caption."""
    colour, shape = CAPTIONS[caption_class(prompt)].split()[1:]
    return colour, shape


def shape_mask(shape: str, size: int, cx: float, cy: float, radius: float) -> torch.Tensor:
    """A boolean (size, size) mask of `shape` centred at (cx, cy) with half-width `radius`."""
    ys, xs = torch.meshgrid(
        torch.arange(size, dtype=torch.float32) + 0.5,
        torch.arange(size, dtype=torch.float32) + 0.5,
        indexing="ij",
    )
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        return dx * dx + dy * dy <= radius * radius
    if shape == "square":
        return (dx.abs() <= radius) & (dy.abs() <= radius)
    if shape == "triangle":  # apex up: rows widen linearly from the top to the base
        rows = (dy + radius) / (2 * radius)
        return (rows >= 0) & (rows <= 1) & (dx.abs() <= rows * radius)
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def draw(prompt: str, size: int, generator: torch.Generator) -> torch.Tensor:
    """One random image of `prompt`: the shape at a random place and size."""
    colour, shape = parse_caption(prompt)
    radius = float(torch.empty(()).uniform_(size * 0.22, size * 0.36, generator=generator))
    low, high = radius, size - radius
    cx, cy = (float(torch.empty(()).uniform_(low, high, generator=generator)) for _ in range(2))
    mask = shape_mask(shape, size, cx, cy, radius)
    image = torch.zeros(3, size, size)
    image[:, mask] = torch.tensor(COLOURS[colour]).unsqueeze(1)
    return image


def dataset(n: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images_N_3_H_W in [0, 1], class ids_N): `n` drawings of captions in turn."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % len(CAPTIONS)
    images = torch.stack([draw(CAPTIONS[int(c)], size, generator) for c in labels])
    return images, labels
