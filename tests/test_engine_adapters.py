"""LoRA adapters in the engine (`verst.engine.adapters`): several adapters and the base in one
batch compute what peft computes for each; bad adapters are refused whole; the prefix cache
never hands one adapter's KV to another; SGLang's /load_lora_adapter, /unload_lora_adapter and
`lora_path` over HTTP, on /generate and the OpenAI routes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from verst.engine import GenerateRequest, SamplingParams
from verst.engine.adapters import AdapterError
from verst.engine.scheduler import Scheduler
from verst.models.loading import ModelConfig, load_model_and_tokenizer
from verst.models.lora import LoraConfig, apply_lora, save_adapter, wire_name
from verst.models.tiny import TinyModelConfig, create_tiny

pytest.importorskip("peft")

SHAPE = TinyModelConfig(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_position_embeddings=128,
)
PROMPT = [5, 6, 7, 8, 9, 10, 11]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapters") / "base"
    create_tiny(path, SHAPE)
    return path


def load_base(base_dir: Path) -> torch.nn.Module:
    model, _ = load_model_and_tokenizer(
        ModelConfig(path=str(base_dir)), seed=0, dtype=torch.float32, device="cpu"
    )
    return model.eval()


def adapter(
    base: torch.nn.Module, rank: int, seed: int, targets: Any = "all-linear"
) -> tuple[torch.nn.Module, LoraConfig, dict[str, torch.Tensor]]:
    """peft's model with a random adapter (B non-zero), its config, its tensors as engines
    take them."""
    cfg = LoraConfig(rank=rank, alpha=2.0 * rank + seed, target_modules=targets)
    adapted = copy.deepcopy(base)
    apply_lora(adapted, cfg)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
                tensors[wire_name(name)] = param.detach().clone()
    return adapted.eval(), cfg, tensors


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """HF's forward, token by token: the greedy ids and their log-probs."""
    ids, logprobs = list(prompt), []
    for _ in range(NEW_TOKENS):
        row = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
        token = int(row.argmax())
        ids.append(token)
        logprobs.append(float(row[token]))
    return ids[len(prompt) :], logprobs


def request(lora: str | None, prompt: list[int] = PROMPT) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return GenerateRequest(list(prompt), params, lora_path=lora)


def scheduler(model: torch.nn.Module, **options: Any) -> Scheduler:
    return Scheduler.for_model(model, eos_token_ids=[], pad_token_id=0, **options)


def test_mixed_adapters_in_one_batch_match_peft(base_dir: Path) -> None:
    """Three adapters of different ranks and targets and the base, in the same steps: each row
    gets what peft's model of its adapter computes (fp32: ids equal, log-probs to 1e-5)."""
    base = load_base(base_dir)
    engine = scheduler(base)
    adapters = {
        "r2": adapter(base, 2, seed=1),
        "r4": adapter(base, 4, seed=2, targets=["q_proj", "v_proj"]),
        "r8": adapter(base, 8, seed=3, targets=["down_proj", "o_proj"]),
    }
    for name, (_, cfg, tensors) in adapters.items():
        engine.load_adapter(name, cfg.wire_config(), tensors, "tensors")
    names: list[str | None] = ["r2", None, "r4", "r8", "r2"]
    outputs = engine.generate([request(name) for name in names])
    for name, out in zip(names, outputs, strict=True):
        reference = base if name is None else adapters[name][0]
        ids, logprobs = greedy(reference, PROMPT)
        assert out.output_ids == ids, name
        assert (
            max(abs(a - b) for a, b in zip(out.output_token_logprobs, logprobs, strict=True)) < 1e-5
        )
    assert len({tuple(o.output_ids) for o in outputs}) > 1  # the adapters do change outputs


def test_an_update_replaces_an_adapter_in_place_and_unload_frees_its_slot(base_dir: Path) -> None:
    base = load_base(base_dir)
    engine = scheduler(base, max_adapters=2)
    first, cfg, tensors = adapter(base, 4, seed=1)
    second, new_cfg, new_tensors = adapter(base, 4, seed=5)
    engine.load_adapter("a", cfg.wire_config(), tensors, "tensors")
    engine.load_adapter("b", cfg.wire_config(), tensors, "tensors")
    structure = engine.runner.adapters.structure
    engine.load_adapter("a", new_cfg.wire_config(), new_tensors, "tensors")
    assert engine.runner.adapters.structure == structure  # same buffers: graphs stay valid
    assert engine.generate([request("a")])[0].output_ids == greedy(second, PROMPT)[0]
    assert engine.generate([request("b")])[0].output_ids == greedy(first, PROMPT)[0]
    with pytest.raises(AdapterError, match="holds 2 adapters"):
        engine.load_adapter("c", cfg.wire_config(), tensors, "tensors")
    engine.unload_adapter("b")
    engine.load_adapter("c", cfg.wire_config(), tensors, "tensors")
    with pytest.raises(AdapterError, match="'b' is not a loaded adapter"):
        engine.submit(request("b"))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c, t: ({**c, "r": 0}, t), "r must be an int >= 1"),
        (lambda c, t: ({**c, "use_dora": True}, t), "use_dora"),
        (lambda c, t: (c, {**t, "model.nope.lora_A.weight": torch.zeros(2, 2)}), "nope"),
        (lambda c, t: (c, {k: v for k, v in t.items() if "q_proj.lora_B" not in k}), "missing"),
        (lambda c, t: (c, {k: v[:, :1] if "lora_B" in k else v for k, v in t.items()}), "shape"),
    ],
    ids=["rank", "dora", "unknown-module", "missing-B", "bad-shape"],
)
def test_a_bad_adapter_is_refused_and_changes_nothing(
    base_dir: Path, change: Any, message: str
) -> None:
    base = load_base(base_dir)
    engine = scheduler(base)
    held, cfg, tensors = adapter(base, 4, seed=1)
    engine.load_adapter("a", cfg.wire_config(), tensors, "tensors")
    _, _, other = adapter(base, 4, seed=2)
    bad_config, bad_tensors = change(cfg.wire_config(), other)
    with pytest.raises(AdapterError, match=message):
        engine.load_adapter("a", bad_config, bad_tensors, "tensors")
    assert engine.generate([request("a")])[0].output_ids == greedy(held, PROMPT)[0]


def test_prefix_cache_keeps_each_adapters_kv_apart(base_dir: Path) -> None:
    """A prompt of several pages, run with an adapter, then with the base, then with the
    adapter again: the base finds nothing cached (the adapter's KV is not its KV), the second
    adapter request reuses the first one's pages."""
    base = load_base(base_dir)
    engine = scheduler(base, page_size=4)
    adapted, cfg, tensors = adapter(base, 4, seed=1)
    engine.load_adapter("a", cfg.wire_config(), tensors, "tensors")
    prompt = list(range(3, 40))
    with_adapter = engine.generate([request("a", prompt)])[0]
    plain = engine.generate([request(None, prompt)])[0]
    again = engine.generate([request("a", prompt)])[0]
    assert plain.cached_tokens == 0
    assert plain.output_ids == greedy(base, prompt)[0]
    assert again.cached_tokens > 0 and again.output_ids == with_adapter.output_ids
    assert with_adapter.output_ids == greedy(adapted, prompt)[0]


# ---- over HTTP -------------------------------------------------------------------------------

aiohttp = pytest.importorskip("aiohttp")

from tests.servers import LoopThread, call, serve_engine  # noqa: E402
from verst.engine.serving import ServingEngine  # noqa: E402

GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def test_http_load_generate_and_unload(base_dir: Path, tmp_path: Path) -> None:
    base = load_base(base_dir)
    adapted, cfg, tensors = adapter(base, 4, seed=1)
    adapter_dir = base_dir.parent / "adapter_a"  # beside the model: a directory it may read
    save_adapter(adapter_dir, {n: t for n, t in adapted.state_dict().items() if ".lora_" in n}, cfg)
    expected, _ = greedy(adapted, PROMPT)
    plain, _ = greedy(base, PROMPT)
    serving = ServingEngine.from_model_dir(str(base_dir), batch_wait_s=0.005)
    serving.allowed_weight_dirs = (base_dir.parent,)
    loop = LoopThread()
    engine = loop.run(serve_engine(serving))
    try:
        url = engine.url

        def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
            return loop.run(call(url, path, body))

        status, body = post("/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter_dir)})
        assert status == 200 and body["success"], body
        assert body["loaded_adapters"] == {"a": str(adapter_dir)}
        gen = {"input_ids": PROMPT, "sampling_params": GREEDY}
        status, body = post("/generate", {**gen, "lora_path": "a"})
        assert status == 200 and body["output_ids"] == expected
        status, body = post(
            "/generate",
            {"input_ids": [PROMPT, PROMPT], "sampling_params": GREEDY, "lora_path": [None, "a"]},
        )
        assert [item["output_ids"] for item in body] == [plain, expected]
        status, body = post(
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": PROMPT,
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "lora_path": "a",
            },
        )
        assert status == 200, body
        assert body["choices"][0]["text"] == serving.tokenizer.decode(expected)

        status, body = post("/generate", {**gen, "lora_path": "b"})
        assert status == 400 and "'b' is not a loaded adapter" in str(body), body
        outside = tmp_path / "elsewhere"
        save_adapter(outside, {n: t for n, t in adapted.state_dict().items() if ".lora_" in n}, cfg)
        status, body = post("/load_lora_adapter", {"lora_name": "b", "lora_path": str(outside)})
        assert (
            status == 400
            and not body["success"]
            and body["loaded_adapters"] == {"a": str(adapter_dir)}
        )
        status, body = post("/load_lora_adapter", {"lora_name": "b", "lora_path": str(base_dir)})
        assert status == 400 and "no peft adapter directory" in body["error_message"]

        status, body = post("/unload_lora_adapter", {"lora_name": "a"})
        assert status == 200 and body["loaded_adapters"] == {}
        status, body = post("/generate", {**gen, "lora_path": "a"})
        assert status == 400
        status, body = post("/unload_lora_adapter", {"lora_name": "a"})
        assert status == 400 and "not a loaded adapter" in body["error_message"]
    finally:
        loop.run(engine.runner.cleanup())
        loop.close()


def test_serve_refuses_lora_paths_that_are_no_name_dir_pairs(base_dir: Path, capsys) -> None:
    from verst.cli import main

    args = ["serve", "--model", str(base_dir), "--port", "0", "--lora-paths"]
    assert main([*args, "no-equals-sign"]) == 2
    assert "NAME=DIR" in capsys.readouterr().err
    assert main([*args, f"a={base_dir}"]) == 2  # a model directory is no adapter
    assert "no peft adapter directory" in capsys.readouterr().err
