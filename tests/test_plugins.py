"""The plug-in contracts and their loader: import paths, every error naming the config field and
the path, and the built-in and example plug-ins fitting their contracts."""

from __future__ import annotations

import ast
import os.path
import re
from pathlib import Path
from typing import Any

import pytest

from verst.models import TinyModelConfig
from verst.plugin_loader import PluginError, load_object, load_plugin
from verst.plugins import (
    AgentFunction,
    Buffer,
    EngineClient,
    RewardFunction,
    SampleFilter,
    WeightTransport,
)
from verst.rollout.buffer import DataBuffer, load_buffer_class, make_buffer
from verst.types import Group, Sample

ROOT = Path(__file__).resolve().parents[1]

# ---- plug-ins, good and bad, loaded from this module by path -----------------------------------


def two_arg_reward(sample: Sample, other: Any) -> float:
    return 0.0


def reward_with_options(sample: Sample, scale: float = 1.0) -> float:
    return scale


async def async_reward(s: Sample) -> float:
    return 1.0


class CallableReward:
    def __call__(self, sample: Sample) -> float:
        return 1.0


callable_reward = CallableReward()


async def agent(base_url: str, prompt: Any, request_kwargs: Any, metadata: Any) -> None:
    return None


def sync_agent(base_url: str, prompt: Any, request_kwargs: Any, metadata: Any) -> None:
    return None


async def three_arg_agent(base_url: str, prompt: Any, request_kwargs: Any) -> None:
    return None


class AgentObject:
    async def __call__(self, url: str, prompt: Any, kwargs: Any, metadata: Any) -> None:
        return None


agent_object = AgentObject()


class HalfBuffer:
    async def put(self, group: Group) -> None:
        pass


class SyncTakeBuffer(HalfBuffer):
    def take(self, n_groups: int, current_version: int) -> list[Group]:
        return []

    def metrics(self) -> dict[str, Any]:
        return {}


def half_buffer_factory(**kwargs: Any) -> HalfBuffer:
    return HalfBuffer()


buffer_instance = HalfBuffer()
ready_buffer = DataBuffer(2)  # fits the contract, but make_buffer needs a class to build
not_callable = 3

# ---- load_object ---------------------------------------------------------------------------------


def test_load_object():
    assert load_object("os.path:join") is os.path.join
    assert load_object("os.path.join") is os.path.join
    assert load_object("verst.models:TinyModelConfig") is TinyModelConfig
    not_found = r"'no_such_pkg\.mod:f'.*module 'no_such_pkg\.mod' not found"
    with pytest.raises(ImportError, match=not_found):
        load_object("no_such_pkg.mod:f")
    with pytest.raises(ImportError, match=r"'os\.path:nope'.*no attribute 'nope'"):
        load_object("os.path:nope")
    with pytest.raises(ValueError, match="'justaname'"):
        load_object("justaname")


# ---- every error names the field, the path and the problem ---------------------------------------

HERE = __name__


@pytest.mark.parametrize(
    ("path", "protocol", "problem"),
    [
        ("no_such_pkg.mod:f", RewardFunction, "module 'no_such_pkg.mod' not found"),
        (f"{HERE}:nope", RewardFunction, "has no attribute 'nope'"),
        ("justaname", RewardFunction, "not of the form 'pkg.mod:name'"),
        (f"{HERE}:not_callable", RewardFunction, "RewardFunction: it is a int, not callable"),
        (f"{HERE}:two_arg_reward", RewardFunction, r"must take \(sample\)"),
        (f"{HERE}:sync_agent", AgentFunction, "must be an `async def` function"),
        (f"{HERE}:CallableReward", AgentFunction, "must be an `async def` function"),
        (f"{HERE}:three_arg_agent", AgentFunction, "must take .*metadata"),
        (f"{HERE}:HalfBuffer", Buffer, "HalfBuffer lacks take, metrics"),
        (f"{HERE}:SyncTakeBuffer", Buffer, r"SyncTakeBuffer\.take must be an async method"),
        (f"{HERE}:buffer_instance", Buffer, "a HalfBuffer object lacks take, metrics"),
        (f"{HERE}:not_callable", Buffer, "a int object lacks put, take, metrics"),
    ],
)
def test_errors_name_the_field_and_the_path(path: str, protocol: type, problem: str) -> None:
    with pytest.raises(PluginError) as info:
        load_plugin(path, protocol, field="section.some_field")
    message = str(info.value)
    assert message.startswith("section.some_field: ")
    assert repr(path) in message
    assert re.search(problem, message), message
    assert isinstance(info.value, ValueError)  # config validators report it as a field error


def test_a_module_that_fails_to_import_is_told_apart(tmp_path, monkeypatch) -> None:
    (tmp_path / "broken_plugin.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="importing module 'broken_plugin' failed"):
        load_plugin("broken_plugin:fn", RewardFunction, field="rollout.reward")


def test_buffer_errors_name_rollout_buffer() -> None:
    with pytest.raises(PluginError, match=r"rollout\.buffer: .*:ready_buffer'.*not a class"):
        load_buffer_class(f"{HERE}:ready_buffer")
    with pytest.raises(PluginError, match=r"rollout\.buffer: .*half_buffer_factory.*lacks take"):
        make_buffer(
            f"{HERE}:half_buffer_factory",
            capacity=2,
            max_staleness=None,
            give_back=None,
            group_filter=None,
        )


def test_config_reports_a_bad_plugin_under_its_field() -> None:
    from verst.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"eval\.reward: .*'{HERE}:two_arg_reward'"):
        load_config(None, [f"eval.reward={HERE}:two_arg_reward"])
    with pytest.raises(ConfigError, match=rf"rollout\.buffer: .*'{HERE}:HalfBuffer'"):
        load_config(None, [f"rollout.buffer={HERE}:HalfBuffer"])


# ---- good plug-ins of every wired kind load -----------------------------------------------------


@pytest.mark.parametrize(
    ("path", "protocol"),
    [
        ("verst.rollout.rewards:exact_match", RewardFunction),
        ("verst.rollout.rewards.numeric_match", RewardFunction),
        (f"{HERE}:async_reward", RewardFunction),
        (f"{HERE}:reward_with_options", RewardFunction),
        (f"{HERE}:callable_reward", RewardFunction),
        (f"{HERE}:agent", AgentFunction),
        (f"{HERE}:agent_object", AgentFunction),
        ("tests.test_agent:tool_agent", AgentFunction),
        ("verst.rollout.buffer:DataBuffer", Buffer),
        ("examples.custom_buffer:FreshestFirstBuffer", Buffer),
        (f"{HERE}:half_buffer_factory", Buffer),  # a factory: checked once built
        ("verst.rollout.dynamic:reward_variance", SampleFilter),
        ("verst.fleet.client:InProcessEngineClient", EngineClient),
        ("verst.fleet.client:HttpEngineClient", EngineClient),
        ("verst.sync.colocated:ColocatedTransport", WeightTransport),
        ("verst.sync.broadcast:BroadcastTransport", WeightTransport),
        ("verst.sync.disk:DiskTransport", WeightTransport),
        ("verst.sync.ipc:IpcBucketSender", WeightTransport),  # WeightSync drives it alone too
    ],
)
def test_good_plugins_load(path: str, protocol: type) -> None:
    assert load_plugin(path, protocol, field="f") is load_object(path)


def test_built_in_buffer_is_checked_once_built() -> None:
    buffer = make_buffer(
        "verst.rollout.buffer:DataBuffer",
        capacity=2,
        max_staleness=None,
        give_back=None,
        group_filter=None,
    )
    assert isinstance(buffer, Buffer)


# ---- the contracts import only leaf modules ------------------------------------------------------

LEAVES = {"verst.types": set(), "verst.engine.grammar": set()}
LEAVES["verst.engine.sampling"] = {"verst.engine.grammar"}
LEAVES["verst.engine.requests"] = {"verst.engine.sampling"}


def _verst_imports(module: str) -> set[str]:
    path = ROOT / (module.replace(".", "/") + ".py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return {name for name in found if name == "verst" or name.startswith("verst.")}


def test_contracts_import_only_leaf_modules() -> None:
    assert _verst_imports("verst.plugins") <= set(LEAVES)
    for leaf, allowed in LEAVES.items():
        assert _verst_imports(leaf) <= allowed, leaf
