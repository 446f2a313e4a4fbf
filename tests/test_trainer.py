"""FSDP2 trainer: micro-batching is exact, colocated sync is exact, NaN stops before the update."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

from verst.engine import GenerateRequest, SamplingParams, Scheduler
from verst.models.tiny import TinyModelConfig, build_tiny_model
from verst.sync.embedded import EmbeddedSync
from verst.train.algorithms import LossConfig
from verst.train.batching import TrainItem, micro_batch_indices, pack_micro_batches
from verst.train.trainer import NonFiniteLossError, Trainer, TrainerConfig

CPU = torch.device("cpu")
TINY = TinyModelConfig(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_position_embeddings=64,
)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    return build_tiny_model(TINY, vocab_size=40, seed=seed)


def make_trainer(model: torch.nn.Module, **overrides) -> Trainer:
    cfg = TrainerConfig(lr=1e-2, device="cpu", **overrides)
    return Trainer(model, cfg, LossConfig(), total_steps=10, pad_token_id=0, device=CPU)


def items(seed: int = 0) -> list[TrainItem]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(6):
        prompt = torch.randint(3, 40, (3 + i % 3,), generator=gen).tolist()
        response = torch.randint(3, 40, (1 + i % 4,), generator=gen).tolist()
        out.append(
            TrainItem(
                tokens=prompt + response,
                response_length=len(response),
                loss_mask=[1] * len(response),
                rollout_logprobs=(-torch.rand(len(response), generator=gen) * 3).tolist(),
                advantage=float(i % 3 - 1),
            )
        )
    return out


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    # on the CPU the "full" state dict of a world of one may alias the live parameters
    return {k: v.clone() for k, v in trainer.full_state_dict().items()}


def test_pack_micro_batches_respects_the_budget() -> None:
    lengths = [5, 9, 3, 9, 4, 1]
    batches = pack_micro_batches(lengths, token_budget=18)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for batch in batches:
        assert max(lengths[i] for i in batch) * len(batch) <= 18
    assert pack_micro_batches([30], token_budget=8) == [[0]]  # a long sequence still trains


def test_micro_batches_are_runs_of_similar_lengths_split_up_to_the_count() -> None:
    lengths = [9, 2, 8, 2, 1, 9]
    runs = [[0, 5], [2, 1], [3, 4]]  # 9 9 | 8 2 | 2 1: each within the budget
    assert micro_batch_indices(lengths, token_budget=18, count=1) == runs
    split = micro_batch_indices(lengths, token_budget=18, count=4)  # the most padded run, 9 9
    assert split == [[0], [5], [2, 1], [3, 4]]
    assert micro_batch_indices([5], token_budget=18, count=3) == [[0], [], []]
    assert micro_batch_indices([], token_budget=18, count=2) == [[], []]


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batches_give_the_same_step_as_one_batch(aggregation: str) -> None:
    whole = make_trainer(tiny_model())
    split = make_trainer(tiny_model(), micro_batch_tokens=8)
    for trainer in (whole, split):
        trainer.loss_cfg = LossConfig(loss_aggregation=aggregation)
        # plain SGD with lr 1: the weight change is the gradient itself (Adam would amplify
        # float summation-order noise in near-zero gradients)
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
    m_whole = whole.step(items(), step=1)
    m_split = split.step(items(), step=1)
    assert m_whole["train/loss"] == pytest.approx(m_split["train/loss"], abs=1e-6)
    assert m_whole["train/grad_norm"] == pytest.approx(m_split["train/grad_norm"], rel=1e-5)
    for name, tensor in weights(whole).items():
        torch.testing.assert_close(tensor, weights(split)[name], atol=1e-6, rtol=1e-5)


def test_step_moves_weights_and_reports_metrics() -> None:
    trainer = make_trainer(tiny_model())
    before = weights(trainer)
    metrics = trainer.step(items(), step=1)
    after = weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for key in (
        "train/loss",
        "train/pg_loss",
        "train/pg_clipfrac",
        "train/grad_norm",
        "train/train_rollout_logprob_abs_diff",
        "train/lr",
    ):
        assert key in metrics


def test_a_step_returns_no_view_from_the_wrapped_model() -> None:
    """FSDP2 warns at every step when its root module returns a view (the scoring head's
    output was one); an in-place op on such an output would drop its pre-backward hook."""
    trainer = make_trainer(tiny_model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.step(items(), step=1)
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]


def test_a_batch_without_signal_leaves_the_weights_where_they_are() -> None:
    # after a real step Adam holds momentum; a batch whose advantages are all 0 has a zero
    # gradient, and stepping on it would still move every weight
    trainer = make_trainer(tiny_model())
    assert trainer.step(items(), step=1)["train/update_skipped"] == 0.0
    before, scheduled = weights(trainer), trainer.scheduler.last_epoch
    silent = [dataclasses.replace(item, advantage=0.0) for item in items(1)]
    metrics = trainer.step(silent, step=2)
    assert metrics["train/grad_norm"] == 0.0 and metrics["train/update_skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in weights(trainer).items())
    assert trainer.scheduler.last_epoch == scheduled + 1  # the schedule still counts steps
    assert trainer.step(items(2), step=3)["train/update_skipped"] == 0.0


def test_non_finite_loss_raises_before_the_update() -> None:
    trainer = make_trainer(tiny_model())
    before = weights(trainer)
    bad = items()
    bad[0].advantage = float("nan")
    with pytest.raises(NonFiniteLossError, match="step 7"):
        trainer.step(bad, step=7)
    after = weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def embedded_engine(model: torch.nn.Module, seed: int = 0) -> Scheduler:
    return Scheduler.for_model(
        model, eos_token_ids=[0], pad_token_id=0, seed=seed, kv_cache_bytes=4 << 20, page_size=4
    )


def _engine_matches_trainer(engine: Scheduler, trainer: Trainer) -> None:
    engine_params = dict(engine.model.named_parameters())
    for name, tensor in weights(trainer).items():
        if name in engine_params:
            target = engine_params[name].detach()
            assert torch.equal(target, tensor.to(target.dtype)), name


def test_a_world_of_one_takes_its_parameters_without_a_gather(monkeypatch) -> None:
    """A rank that holds whole tensors hands out its own: no DTensor gather, whose Python cost
    per tensor dominated pushes of many small tensors (LoRA adapters)."""
    from torch.distributed.tensor import DTensor

    from verst.sync.buckets import full_parameters

    trainer = make_trainer(tiny_model())

    def gather(self, *args, **kwargs):
        raise AssertionError("a world of one gathered a parameter")

    monkeypatch.setattr(DTensor, "full_tensor", gather)
    taken = dict(full_parameters(trainer.model))
    local = dict(trainer.named_local_parameters())
    assert taken.keys() == local.keys()
    for name, tensor in taken.items():
        assert type(tensor) is torch.Tensor and not tensor.requires_grad, name
        assert tensor.shape == local[name].shape and tensor.data_ptr() == local[name].data_ptr()


def test_embedded_sync_shares_storage_and_stays_exact() -> None:
    model = tiny_model()
    engine = embedded_engine(copy.deepcopy(model).eval())
    trainer = make_trainer(model)
    sync = EmbeddedSync(trainer, engine)
    assert sync.zero_copy
    trainer.step(items(), step=1)
    sync.push(2)
    assert engine.weight_version == 2
    _engine_matches_trainer(engine, trainer)


def test_a_zero_copy_push_drops_the_prefix_cache() -> None:
    """The optimiser changed the weights under the engine: KV cached before is stale."""
    model = tiny_model()
    engine = embedded_engine(copy.deepcopy(model).eval())
    trainer = make_trainer(model)
    sync = EmbeddedSync(trainer, engine)
    prompt = [GenerateRequest(input_ids=list(range(5, 19)), sampling_params=SamplingParams(4))]
    engine.generate(prompt)
    assert engine.generate(prompt)[0].cached_tokens > 0
    trainer.step(items(), step=1)
    sync.push(2)
    assert engine.generate(prompt)[0].cached_tokens == 0


def test_embedded_sync_copies_when_dtypes_differ() -> None:
    model = tiny_model()
    engine = embedded_engine(copy.deepcopy(model).to(torch.bfloat16).eval())
    trainer = make_trainer(model)
    sync = EmbeddedSync(trainer, engine)
    assert not sync.zero_copy
    trainer.step(items(), step=1)
    sync.push(2)
    assert engine.weight_version == 2
    _engine_matches_trainer(engine, trainer)


def test_trainer_logprobs_match_the_engine() -> None:
    """On-policy data: the trainer's recomputed log-probs equal the engine's (fp32)."""
    model = tiny_model(seed=3)
    engine = embedded_engine(copy.deepcopy(model).eval(), seed=1)
    trainer = make_trainer(model)
    EmbeddedSync(trainer, engine)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    outputs = engine.generate(
        [
            GenerateRequest(
                input_ids=p, sampling_params=SamplingParams(max_new_tokens=5, ignore_eos=True)
            )
            for p in prompts
        ]
    )
    batch = [
        TrainItem(
            tokens=p + o.output_ids,
            response_length=len(o.output_ids),
            loss_mask=[1] * len(o.output_ids),
            rollout_logprobs=o.output_token_logprobs,
            advantage=1.0,
        )
        for p, o in zip(prompts, outputs, strict=True)
    ]
    metrics = trainer.step(batch, step=1)
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
