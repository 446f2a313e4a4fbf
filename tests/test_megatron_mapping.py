"""HF <-> Megatron weight mapping of the megatron backend, on CPU without process groups: the
round trip HF -> per-rank Megatron shards -> HF is exact for TP, PP and EP layouts, the fused
layouts are the ones Megatron's layers read, and layouts that do not divide the model fail
naming the field."""

from __future__ import annotations

import pytest
import torch

from verst.models.tiny import TinyModelConfig, build_tiny_model
from verst.train.megatron.config import MegatronConfig, check_layout
from verst.train.megatron.mapping import WeightMap

VOCAB = 37  # odd, so TP=2 pads the vocabulary


def _model(family: str, tied: bool = False, intermediate_size: int = 48):
    shape = TinyModelConfig(
        family=family, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=intermediate_size, tie_word_embeddings=tied, num_experts=4,
        experts_per_token=2,
    )  # fmt: skip
    return build_tiny_model(shape, VOCAB, seed=0)


def _round_trip(model, layout: MegatronConfig) -> dict[str, torch.Tensor]:
    """Shard every rank's Megatron state, then rebuild the HF tensors from the shards alone."""
    mapping = WeightMap(model.config, layout)
    hf = model.state_dict()
    tp, pp, ep = layout.tensor_parallel, layout.pipeline_parallel, layout.expert_parallel
    ranks = {
        (t, p, e): mapping.rank_state(hf, tp_rank=t, pp_rank=p, ep_rank=e)
        for t in range(tp) for p in range(pp) for e in range(ep)
    }  # fmt: skip
    rebuilt: dict[str, torch.Tensor] = {}
    for entry in mapping.entries():
        if entry.is_expert:  # each EP rank's local experts (TP rank 0's copy)
            per_rank = [
                [ranks[(0, entry.stage, e)][entry.name.format(j)] for j in range(4 // ep)]
                for e in range(ep)
            ]
            rebuilt |= mapping.merge_experts(entry, per_rank)
            continue
        shards = [ranks[(t, entry.stage, 0)][entry.name] for t in range(tp)]
        rebuilt |= mapping.merge(entry, shards)
    return rebuilt


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("tied", [False, True])
def test_dense_round_trip(family: str, tp: int, pp: int, tied: bool) -> None:
    model = _model(family, tied)
    layout = MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp)
    check_layout(layout, model.config, world_size=tp * pp)
    rebuilt = _round_trip(model, layout)
    original = {n: t for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    assert rebuilt.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(rebuilt[name], tensor), name


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_moe_round_trip(tp: int, ep: int) -> None:
    model = _model("qwen3-moe")
    layout = MegatronConfig(tensor_parallel=tp, expert_parallel=ep)
    check_layout(layout, model.config, world_size=tp * ep)
    rebuilt = _round_trip(model, layout)
    original = model.state_dict()
    assert rebuilt.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(rebuilt[name], tensor), name


def test_expert_entries_follow_the_rest_and_split_evenly() -> None:
    mapping = WeightMap(_model("qwen3-moe").config, MegatronConfig(expert_parallel=2))
    kinds = [entry.is_expert for entry in mapping.entries()]
    assert kinds == sorted(kinds)  # every non-expert entry before the first expert one
    assert list(mapping.local_experts(1)) == [2, 3]
    hf = _model("qwen3-moe").state_dict()
    state = mapping.rank_state(hf, tp_rank=0, pp_rank=0, ep_rank=1)
    # rank 1 holds experts 2 and 3 as its local experts 0 and 1, [gate; up] rows as HF stacks them
    fc1 = state["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(fc1, hf["model.layers.0.mlp.experts.gate_up_proj"][3])
    assert not any("local_experts.2" in name for name in state)


def test_fused_layouts_are_megatrons() -> None:
    """qkv: one [q heads, k, v] block per query group; fc1 on a TP rank: [its gate, its up]."""
    model = _model("qwen3")
    mapping = WeightMap(model.config, MegatronConfig(tensor_parallel=2))
    hf = model.state_dict()
    entries = {e.name: e for e in mapping.entries()}
    qkv = mapping.split(entries["decoder.layers.0.self_attention.linear_qkv.weight"], hf)
    attn, d = "model.layers.0.self_attn.", 8  # head_dim 8, 2 heads per group, group 0 on rank 0
    expected = torch.cat([hf[attn + "q_proj.weight"][: 2 * d], hf[attn + "k_proj.weight"][:d],
                          hf[attn + "v_proj.weight"][:d]])  # fmt: skip
    assert torch.equal(qkv[0], expected)
    fc1 = mapping.split(entries["decoder.layers.0.mlp.linear_fc1.weight"], hf)
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1[1], torch.cat([gate[24:], up[24:]]))
    vocab = mapping.split(entries["embedding.word_embeddings.weight"], hf)
    assert [v.shape[0] for v in vocab] == [19, 19] and not vocab[1][-1].any()


@pytest.mark.parametrize(
    ("layout", "world", "field"),
    [
        (dict(tensor_parallel=3), 3, "tensor_parallel=3"),
        (dict(pipeline_parallel=3), 3, "pipeline_parallel=3"),
        (dict(expert_parallel=2), 2, "expert_parallel=2 needs an MoE"),
        (dict(tensor_parallel=4), 4, "tensor_parallel=4 does not divide the model's 2 key/value"),
        (dict(tensor_parallel=2), 3, "does not divide the 3 ranks"),
        (dict(pipeline_parallel=2), 3, "pipeline_parallel = 2 does not divide the 3 ranks"),
    ],
)
def test_bad_layouts_name_the_field(layout: dict, world: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        check_layout(MegatronConfig(**layout), _model("qwen3").config, world)


def test_bad_expert_layout_and_family() -> None:
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide the model's 4 experts"):
        check_layout(MegatronConfig(expert_parallel=3), _model("qwen3-moe").config, 3)
    with pytest.raises(ValueError, match="model family 'mistral' is not covered"):
        check_layout(MegatronConfig(), _model("mistral").config, 1)


def test_bad_mlp_rope_and_expert_layouts_name_the_field() -> None:
    narrow = _model("qwen3", intermediate_size=51)  # TP=2 divides its 4 heads and 2 kv heads
    with pytest.raises(ValueError, match="tensor_parallel=2 does not divide the model's 51 MLP"):
        check_layout(MegatronConfig(tensor_parallel=2), narrow.config, 2)
    moe = _model("qwen3-moe").config
    with pytest.raises(ValueError, match=r"expert_parallel=2 does not divide the 1 data-parallel"):
        check_layout(MegatronConfig(tensor_parallel=2, expert_parallel=2), moe, 2)
    moe.mlp_only_layers = [0]
    with pytest.raises(ValueError, match="every layer must be an MoE layer"):
        check_layout(MegatronConfig(), moe, 1)
    scaled = _model("llama").config
    scaled.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope scaling 'linear' is not covered"):
        check_layout(MegatronConfig(), scaled, 1)


def test_a_layout_that_cannot_fit_fails_before_the_weights_load(tmp_path, capsys) -> None:
    """The layout is checked on the model's config alone: a directory whose weights file is
    gone still fails on the layout, so a big model never loads only to be refused."""
    from verst import exitcodes
    from verst.cli import main
    from verst.models.tiny import create_tiny

    model_dir = tmp_path / "model"
    create_tiny(model_dir, TinyModelConfig(num_heads=2, num_kv_heads=1, hidden_size=32))
    for weights in model_dir.glob("*.safetensors"):
        weights.unlink()
    args = ["train", "trainer.backend=megatron", "trainer.megatron.tensor_parallel=3",
            f"model.path={model_dir}", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main(args) == exitcodes.BAD_INPUT
    assert "trainer.megatron.tensor_parallel=3 does not divide the model's 2 heads" in (
        capsys.readouterr().err
    )
