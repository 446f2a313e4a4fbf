"""Sample grids as PNG files (one row per prompt), for docs and run directories."""

from __future__ import annotations

from pathlib import Path

import torch


def save_grid(images_B: torch.Tensor, rows: int, path: Path, *, scale: int = 4) -> Path:
    """Write `images_B` (RGB in [0, 1], B = rows x columns) as one PNG, each pixel `scale`-fold."""
    from PIL import Image

    b, _, h, w = images_B.shape
    if b % rows:
        raise ValueError(f"{b} images do not fill {rows} rows")
    cols = b // rows
    pad = 1
    canvas = torch.ones(3, rows * (h + pad) + pad, cols * (w + pad) + pad) * 0.5
    for k in range(b):
        r, c = divmod(k, cols)
        top, left = pad + r * (h + pad), pad + c * (w + pad)
        canvas[:, top : top + h, left : left + w] = images_B[k].clamp(0, 1)
    pixels = (canvas.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    image = Image.fromarray(pixels).resize(
        (canvas.shape[2] * scale, canvas.shape[1] * scale), Image.NEAREST
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
