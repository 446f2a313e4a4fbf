"""RL for diffusion models on verst's loop: Flow-GRPO, DiffusionNFT, SFT (`model.kind: diffusion`).

A sample is a whole denoising trajectory. The engine (`engine.py`, served by `server.py`)
returns the latent trajectory with per-step transition log-probabilities; the trainer
(`trainer.py`) replays chosen transitions and optimises `objectives.py`; `sde.py` holds the
samplers' closed forms. Needs the `diffusion` extra (`pip install verst[diffusion]`).
"""
