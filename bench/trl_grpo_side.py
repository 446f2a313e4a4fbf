"""The TRL half of `bench/grpo_step_vs_trl.py`: time GRPO optimizer steps with TRL's GRPOTrainer.

`run_trl_grpo` trains a local HF model directory with `trl.GRPOTrainer` (CPU, plain
`model.generate`, no vLLM, no reference model) on raw-string prompts with an exact-match
reward, and returns the wall-clock time of every optimizer step, generation included, and the
mean completion length of each step (the work its generation did).

One optimizer step = `prompts_per_step` prompts × `num_generations` completions, generated in
one `generate` call and trained in one pass (`num_iterations=1`, so the old log-probs are
the current ones detached and no extra forward runs); with `micro_batch_size` set the pass is
split into gradient-accumulation micro-batches of that many completions. The loss is TRL's
`loss_type="dapo"` by default: token-level mean over the whole step, which is verst's
`loss_aggregation="token_mean"`.

Run `python bench/trl_grpo_side.py` to time it on verst's tiny random Qwen3 in a temp dir.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

WARMUP_STEPS = 2


def run_trl_grpo(
    model_dir: str,
    prompts: list[str],
    labels: list[str],
    *,
    num_generations: int,
    prompts_per_step: int,
    max_completion_length: int,
    steps: int,
    lr: float,
    temperature: float,
    seed: int,
    out_dir: str,
    micro_batch_size: int | None = None,
    loss_type: str = "dapo",
) -> dict[str, Any]:
    """Train `steps` GRPO steps with TRL and return per-step wall-clock times.

    `micro_batch_size` (completions per forward/backward) defaults to the whole step. The mean
    step time excludes the first `WARMUP_STEPS` steps (allocator and kernel warm-up). Returns
    `step_times_s`, `mean_step_time_s` (also median / min), `trl_version` and `config` (the
    exact GRPOConfig arguments and the optimizer's settings).
    """
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    if len(prompts) != len(labels):
        raise ValueError(f"{len(prompts)} prompts but {len(labels)} labels")
    completions_per_step = prompts_per_step * num_generations
    micro = micro_batch_size or completions_per_step
    if completions_per_step % micro or micro % num_generations:
        raise ValueError(
            f"micro_batch_size {micro} must divide prompts_per_step × num_generations "
            f"({completions_per_step}) and be a multiple of num_generations ({num_generations})"
        )
    grad_accum = completions_per_step // micro

    # Enough rows for `steps` steps without a second epoch (which would rebuild the sampler).
    rows = prompts_per_step * steps
    reps = -(-rows // len(prompts))
    dataset = Dataset.from_dict(
        {"prompt": (prompts * reps)[:rows], "label": (labels * reps)[:rows]}
    )

    lengths_per_call: list[float] = []  # mean completion tokens of each reward call (a step)

    def exact_match(
        completions: list[str], label: list[str], completion_ids: list[list[int]], **_: Any
    ) -> list[float]:
        lengths_per_call.append(statistics.mean(len(ids) for ids in completion_ids))
        return [float(c.strip() == y) for c, y in zip(completions, label, strict=True)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.step_times_s: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_times_s.append(time.perf_counter() - self._t0)

    config_kwargs: dict[str, Any] = dict(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=seed,
        data_seed=seed,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=grad_accum,
        steps_per_generation=grad_accum,
        num_generations=num_generations,
        num_iterations=1,
        max_completion_length=max_completion_length,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        scale_rewards="group",
        loss_type=loss_type,
        use_vllm=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        disable_dropout=True,
        log_completions=False,
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    config = GRPOConfig(**config_kwargs)

    random.seed(seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    # With tqdm off, transformers prints every log dict to stdout; keep stdout for our JSON.
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    optimizer = trainer.optimizer
    # The optimizer's own settings, so the verst side can match them exactly.
    optimizer_info = {
        "class": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        **{k: v for k, v in optimizer.param_groups[0].items() if k != "params"},
    }

    measured_s = timer.step_times_s[WARMUP_STEPS:] or timer.step_times_s
    return {
        "step_times_s": timer.step_times_s,
        "mean_step_time_s": sum(measured_s) / len(measured_s),
        # Shared CPUs make single steps noisy; the median and min are robust companions.
        "median_step_time_s": statistics.median(measured_s),
        "min_step_time_s": min(measured_s),
        "warmup_steps": WARMUP_STEPS,
        "completion_tokens_mean_per_step": lengths_per_call,
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "config": {
            "completions_per_step": completions_per_step,
            "optimizer": json.loads(json.dumps(optimizer_info, default=str)),
            "grpo_config": {k: v for k, v in config_kwargs.items() if k != "output_dir"},
        },
    }


def addition_prompts(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """`n` two-digit addition prompts like "07+58=" with their answers."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(100), rng.randrange(100)) for _ in range(n)]
    return [f"{a:02d}+{b:02d}=" for a, b in pairs], [str(a + b) for a, b in pairs]


def main() -> None:
    import torch

    from verst.models.tiny import create_tiny

    torch.set_num_threads(2)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        create_tiny(model_dir, seed=0)
        prompts, labels = addition_prompts(256)
        result = run_trl_grpo(
            model_dir,
            prompts,
            labels,
            num_generations=16,
            prompts_per_step=16,
            max_completion_length=4,
            steps=steps,
            lr=1e-5,
            temperature=1.0,
            seed=0,
            out_dir=os.path.join(tmp, "out"),
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
