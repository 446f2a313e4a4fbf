"""The verifiers connector (`env.name: verifiers`): a `verifiers.v1` Taskset played as a verst
environment, its tasks scored by their own `@vf.reward` functions (PyPI `verifiers`,
`pip install 'verst[verifiers]'`).

    data:
      task: verifiers
      task_kwargs: {taskset: "my_pkg.tasks:load_taskset", args: {}, test_size: 50}
    env:
      name: verifiers
      options: {taskset: "my_pkg.tasks:load_taskset", args: {}}

`taskset` is either an import path (`pkg.mod:obj`: a Taskset subclass, built with its own
config type validated from `args`; a function called with `args` that returns a Taskset; or a
Taskset instance) or, without a colon, a verifiers taskset id (an installed taskset package,
or one of `verifiers.v1.tasksets`), loaded as verifiers loads it (`vf.load_taskset`).

`data.task: verifiers` turns the taskset's tasks into rows (the task's opening messages as the
prompt, its position `vf_task_idx` and identity `vf_task_key`); an episode takes its row's task,
shows the task's opening messages (its `system_prompt` as a system message, then its prompt, as
verifiers' `null` harness does), and the model's answer goes through the session server like
every model turn. The conversation then becomes a `vf.Trace`, the task's `score` runs its
metrics and rewards on it, and the trace's weighted reward is the episode's. `task_reward` is the
same scoring as a reward function, for single-turn runs and the warm start's dev check.

Multi-turn: `env: "pkg.mod:EnvClass"` (or a verifiers env id; a taskset id whose package
exports a `vf.Env` plays that Env) with `env_args` (its config) names a `vf.Env` whose
`run(task, agents)` drives the conversation; `verst.envs.verifiers_multiturn` plays it, each
turn it asks for a model turn through the session server. Without one, the episode is
single-turn: it ends after the first answer (a v1 `Task` has no per-turn hook).

The harness, the runtime and task toolsets are not used; a task that needs them
(`NEEDS_CONTAINER`, toolsets, a reward or metric that takes a `runtime`) is refused at reset
rather than scored without them.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from verst.envs.base import Action, Environment, Message, StepResult
from verst.envs.runner import EpisodeError
from verst.envs.verifiers_multiturn import EnvEpisode, load_env
from verst.envs.verifiers_trace import build_trace, opening_messages, vf_module
from verst.plugin_loader import load_object
from verst.types import Sample


def _build_taskset(spec: str, args: dict[str, Any]) -> Any:
    """The Taskset that `spec` names (see the module docstring), built with `args`."""
    vf = vf_module()
    if ":" not in spec:
        config = vf.taskset_config_type(spec).model_validate({"id": spec, **args})
        return vf.load_taskset(config)
    obj = load_object(spec)
    if isinstance(obj, type) and issubclass(obj, vf.Taskset):
        from verifiers.v1.utils.generic import concrete_type

        config_type = concrete_type(obj, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        return obj(config_type.model_validate(args))
    if isinstance(obj, vf.Taskset):
        if args:
            raise ValueError(f"taskset {spec!r} is a Taskset instance: it takes no args")
        return obj
    if callable(obj):
        return obj(**args)
    raise ValueError(f"taskset {spec!r} is neither a Taskset nor a function returning one")


@functools.lru_cache(maxsize=8)
def _cached_tasks(spec: str, args_json: str, size: int | None) -> tuple[Any, ...]:
    vf = vf_module()
    taskset = _build_taskset(spec, json.loads(args_json))
    if not isinstance(taskset, vf.Taskset):
        raise ValueError(f"taskset {spec!r} gave a {type(taskset).__name__}, not a vf.Taskset")
    if size is not None:
        taskset = taskset.take(size)
    elif not taskset.bounded:
        raise ValueError(f"taskset {spec!r} is infinite: set size (how many tasks to take)")
    return tuple(taskset)


def load_tasks(spec: Any, args: Any = None, size: Any = None, *, where: str) -> tuple[Any, ...]:
    """The tasks of taskset `spec` built with `args` (the first `size` when set), in load
    order, built once per process; `ValueError` naming `where` (the config field) when the
    settings are not a taskset's."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{where}.taskset: name a verifiers taskset ('pkg.mod:obj' or an id)")
    if not isinstance(args or {}, dict):
        raise ValueError(f"{where}.args: the taskset's settings must be a mapping")
    if size is not None and (not isinstance(size, int) or size < 1):
        raise ValueError(f"{where}.size: a number of tasks >= 1, got {size!r}")
    try:
        return _cached_tasks(spec, json.dumps(args or {}, sort_keys=True), size)
    except (ImportError, ValueError, TypeError) as error:
        raise ValueError(f"{where}.taskset: {error}") from error


def verifiers_rows(
    split: str,
    taskset: str,
    args: dict[str, Any] | None = None,
    size: int | None = None,
    test_size: int = 0,
    dev_size: int = 0,
) -> list[dict[str, Any]]:
    """`data.task: verifiers`: the taskset's tasks as rows, in load order: test is the first
    `test_size`, dev the next `dev_size`, train the rest. Each row: `prompt` (the opening
    messages), `vf_task_idx`, `vf_task_key`, `vf_taskset` (these settings, for `task_reward`),
    and `label` when the task's data has an `answer`."""
    tasks = load_tasks(taskset, args, size, where="data.task_kwargs")
    settings = {"taskset": taskset, "args": args or {}, "size": size}
    rows = []
    for idx, task in enumerate(tasks):
        row = {
            "prompt": opening_messages(task),
            "vf_task_idx": idx,
            "vf_task_key": task.key,
            "vf_taskset": settings,
        }
        answer = getattr(task.data, "answer", None)
        if answer is not None:
            row["label"] = str(answer)
        rows.append(row)
    bounds = {"test": (0, test_size), "dev": (test_size, test_size + dev_size)}
    start, end = bounds.get(split, (test_size + dev_size, len(rows)))
    return rows[start:end]


def _unplayable(task: Any) -> str | None:
    """Why the task cannot be scored without a verifiers runtime, or None."""
    import inspect

    if task.NEEDS_CONTAINER:
        return "it needs a container (NEEDS_CONTAINER)"
    if task.toolsets(task.config):
        return "it has toolsets (tool servers the harness's runtime launches)"
    for kind in ("reward", "metric"):
        for fn in task.hooks(kind):
            param = inspect.signature(fn).parameters.get("runtime")
            if param is not None and param.default is inspect.Parameter.empty:
                return f"its {kind} {fn.__name__!r} takes a runtime"
    return None


def task_of(metadata: dict[str, Any], settings: dict[str, Any], *, where: str) -> Any:
    """The task a sample's row names (`vf_task_idx`, `vf_task_key`) in the taskset that
    `settings` name (`taskset`, `args`, `size`: `where`, the config field); `ValueError` when
    the row has no task, or names another taskset's."""
    tasks = load_tasks(
        settings.get("taskset"), settings.get("args"), settings.get("size"), where=where
    )
    idx, key = metadata.get("vf_task_idx"), metadata.get("vf_task_key")
    if not isinstance(idx, int):
        raise ValueError("verifiers: the sample has no vf_task_idx (use data.task: verifiers)")
    if not 0 <= idx < len(tasks) or tasks[idx].key != key:
        raise ValueError(
            f"verifiers: the sample's task {idx} is not {where}.taskset's task {idx}: "
            "do data.task_kwargs and it name the same taskset, args and size?"
        )
    return tasks[idx]


async def score_answer(task: Any, answer: str, finish_reason: str = "stop") -> Any:
    """The task's own metrics and rewards on its opening messages and one answer: the scored
    `vf.Trace` (`trace.reward` is the weighted sum)."""
    messages = [*opening_messages(task), {"role": "assistant", "content": answer}]
    trace = build_trace(task, messages, {len(messages) - 1: finish_reason})
    await task.score(trace)
    return trace


async def task_reward(sample: Sample) -> float:
    """`rollout.reward` / `eval.reward` for single-turn runs on `data.task: verifiers` rows
    (no session server): the sample's task scores its response with its own rewards."""
    settings = sample.metadata.get("vf_taskset")
    if not isinstance(settings, dict):
        raise ValueError("verifiers: the sample has no vf_taskset (use data.task: verifiers)")
    task = task_of(sample.metadata, settings, where="data.task_kwargs")
    if (why := _unplayable(task)) is not None:
        raise ValueError(f"verifiers: task {task.data.idx} cannot be scored here: {why}")
    trace = await score_answer(task, str(sample.metadata.get("response_text", "")))
    return float(trace.reward)


def env_spec(options: dict[str, Any]) -> str | None:
    """The multi-turn `vf.Env` that `env.options` name: `env` when set, else the Env that a
    taskset id's package exports (as verifiers pairs them); None for single-turn play."""
    spec = options.get("env")
    if spec is not None:
        if not isinstance(spec, str) or not spec:
            raise ValueError("env.options.env: name a vf.Env ('pkg.mod:Class' or an env id)")
        return spec
    taskset = options.get("taskset")
    if not isinstance(taskset, str) or ":" in taskset:
        return None
    from verifiers.v1.utils.loaders import environment_class

    env_cls = environment_class(taskset)
    if env_cls is vf_module().SingleAgentEnv:
        return None
    return f"{env_cls.__module__}:{env_cls.__qualname__}"


def trace_result(trace: Any) -> StepResult:
    """The episode's last result: the scored trace's weighted reward, and its rewards,
    metrics and last reply as facts for the sample's metadata."""
    info = {
        "answer": trace.last_reply,
        "vf_rewards": {k: r.score for k, r in trace.rewards.items() if r is not None},
        "vf_metrics": {k: v for k, v in trace.metrics.items() if v is not None},
        "vf_stop": trace.stop_condition,
    }
    return StepResult(reward=float(trace.reward), done=True, info=info)


class VerifiersEnvironment(Environment):
    """An episode of one verifiers task (see the module docstring for `env.options`):
    single-turn, or the turns of the `vf.Env` that the options name."""

    episode: EnvEpisode | None = None

    async def reset(self, prompt: str | list[Message], metadata: dict[str, Any]) -> list[Message]:
        self.task = task_of(metadata, self.options, where="env.options")
        if (why := _unplayable(self.task)) is not None:
            idx = self.task.data.idx
            raise ValueError(f"verifiers: task {idx} cannot be scored without its runtime: {why}")
        try:
            spec = env_spec(self.options)
            env = None if spec is None else load_env(spec, self.options.get("env_args") or {})
        except (ImportError, ValueError, TypeError) as error:
            raise ValueError(f"env.options.env: {error}") from error
        if env is None:
            return opening_messages(self.task)
        self.episode = EnvEpisode(env, self.task)
        return await self.episode.start()

    async def step(self, action: Action) -> StepResult:
        if self.episode is None:
            trace = await score_answer(self.task, action.content, action.finish_reason)
            return trace_result(trace)
        reply = {"role": "assistant", "content": action.content}
        try:
            following = await self.episode.answer(reply, action.finish_reason)
        except Exception as error:
            raise _env_failed(self.episode, error) from error
        return StepResult(observation=following) if following else trace_result(self.episode.trace)

    async def truncate(self) -> StepResult | None:
        if self.episode is None:
            return None
        try:
            await self.episode.end()
        except Exception as error:
            raise _env_failed(self.episode, error) from error
        return trace_result(self.episode.trace)

    async def close(self) -> None:
        if self.episode is not None:
            await self.episode.close()


def _env_failed(episode: EnvEpisode, error: Exception) -> EpisodeError:
    """A failing env run, finalize or scoring fails the episode (verifiers counts it failed,
    not as a zero reward): the sample is ABORTED whatever env.on_error says."""
    name = type(episode.env).__name__
    return EpisodeError(f"verifiers: {name}: {type(error).__name__}: {error}")
