"""A fleet of serving engines behind a router, driven from the synchronous trainer.

`Fleet.start(...)` brings up `num_engines` serving engines — in this process
(`engines: in_process`, each also served on a loopback port) or as `verst serve` subprocesses
(`engines: processes`) — registers them with one `Router`, and runs every coroutine on a
background event loop. The trainer's side stays synchronous:

- `fleet.generate(requests)` has the embedded `Scheduler.generate`'s signature, so the rollout,
  evaluation and the warm start's dev check run unchanged on a fleet. Samples of one prompt
  share a routing key, so a group lands on one engine and its prompt is prefilled once.
- `fleet.agenerate(request, key)` is the same for one request, for coroutines on the fleet's
  loop (the fully asynchronous worker, agents).
- `fleet.sessions_url()` starts the router's HTTP front and a session server over it, for
  agents that speak the OpenAI chat API.
- `fleet.clients` are the `EngineClient`s the weight-sync protocol drives.

Failures: an engine that cannot be reached, fails a weight push, or fails the health monitor's
checks (`verst.fleet.health`, on by default for engine processes) is lost (`lose`): taken out
of routing and of weight pushes, its process killed and started again on the same device
(`verst.fleet.processes`). The restarted engine joins (`joining_engines`) and is sent the
current weights before it serves: at the next push, or at once when the trainer's thread waits
on the fleet (`wait` calls `rejoin`). Requests to a lost engine go to another one; with no
engine serving they wait for a restarted one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import torch

from verst.auth import ApiKeys, generate_key
from verst.engine import GenerateOutput, GenerateRequest
from verst.engine.config import Quantization
from verst.engine.serving import ServingEngine
from verst.fleet.bodies import output_from_body, request_body
from verst.fleet.client import HttpEngineClient, InProcessEngineClient
from verst.fleet.health import (
    EngineMonitor,
    EngineRestartError,
    FaultCounters,
    FaultToleranceConfig,
)
from verst.fleet.launcher import LocalEngine, free_port
from verst.fleet.loop_thread import LoopThread
from verst.fleet.placement import PlacementConfig, engine_devices
from verst.fleet.processes import EngineProcesses, ProcessSlot
from verst.plugins import EngineClient
from verst.router.policy import NoEngineAvailable, Router

T = TypeVar("T")
log = logging.getLogger(__name__)


# ---- the fleet -------------------------------------------------------------------------------


class Fleet:
    def __init__(
        self,
        loop: LoopThread,
        clients: dict[str, EngineClient],
        *,
        tokenizer: Any,
        chat_template: str | None = None,
        processes: EngineProcesses | None = None,
        runners: list[Any] | None = None,
        api_keys: ApiKeys | None = None,
        fault_tolerance: FaultToleranceConfig | None = None,
    ) -> None:
        self.loop = loop
        self.api_keys = api_keys or ApiKeys()  # what the fleet's engines and router want
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # serving engines by URL, in registration order: in routing, and sent every push
        self._clients = clients
        self._joining: dict[str, EngineClient] = {}  # restarted, waiting for their first push
        self._restarting: dict[int, asyncio.Task] = {}  # by process slot
        self.router = Router(list(clients))
        self.engine_processes = processes
        self._runners = runners or []  # aiohttp runners serving in-process engines and fronts
        self._key_refs: dict[str, int] = {}
        self._retried_keys: set[str] = set()
        self._sessions_url: str | None = None
        self.lora_path: str | None = None  # the LoRA adapter every request runs with, if any
        self.routed_experts = False  # sessions ask for each turn's experts (MoE replay)
        self._changed = asyncio.Event()  # replaced after each change of the engines
        self.weight_version = 0
        self.pushing = False
        self.pushes_begun = self.pushes_done = 0
        self.faults = FaultCounters()
        self.failure: EngineRestartError | None = None
        # the trainer's side: pushes the current weights to joining engines (world of one)
        self.rejoin: Callable[[], None] | None = None
        ft = fault_tolerance or FaultToleranceConfig(enabled=False)
        self.fault_tolerance = ft if processes is not None and ft.active("processes") else None
        self.monitor: EngineMonitor | None = None
        if self.fault_tolerance is not None:
            self.monitor = EngineMonitor(self, self.fault_tolerance)
            loop.call(self.monitor.start)

    @property
    def clients(self) -> list[EngineClient]:
        """The serving engines (in routing, known healthy)."""
        return list(self._clients.values())

    def serving_engines(self) -> dict[str, EngineClient]:
        return dict(self._clients)

    def joining_engines(self) -> dict[str, EngineClient]:
        return dict(self._joining)

    @property
    def processes(self) -> list[LocalEngine]:
        """The running engine processes (none for in-process engines)."""
        return self.engine_processes.engines if self.engine_processes is not None else []

    @property
    def process_devices(self) -> list[str]:
        return self.engine_processes.devices if self.engine_processes is not None else []

    # ---- start and stop ------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        cfg: PlacementConfig,
        *,
        model: torch.nn.Module,
        tokenizer: Any,
        model_dir: Path,
        trainer_device: torch.device,
        dtype: torch.dtype,
        seed: int,
        fault_tolerance: FaultToleranceConfig | None = None,
        true_on_policy: bool = False,
        quantization: Quantization = "none",
        overlap: bool | None = None,
    ) -> Fleet:
        """Bring up `cfg.num_engines` engines with `model`'s weights (`true_on_policy`: each
        runs the batch-invariant forward; `quantization` fp8: fp8 projections; `overlap`:
        overlapped decode steps, None on CUDA only; `Scheduler`).

        `model` is the engine's copy (its device and dtype) for in-process engines; engine
        processes load `model_dir`, which must hold the same weights.
        """
        if not cfg.serving:
            raise ValueError("Fleet.start needs placement.engines = in_process or processes")
        loop = LoopThread()
        # One key per run: the engines' HTTP ports, even on loopback, answer only the trainer.
        keys = ApiKeys(api_key=generate_key())
        try:
            if cfg.engines == "in_process":
                clients, runners = loop.run(
                    _start_in_process(
                        cfg, model, tokenizer, seed, keys, true_on_policy, quantization, overlap
                    )
                )
                return cls(loop, clients, tokenizer=tokenizer, runners=runners, api_keys=keys)
            devices = _devices(cfg, trainer_device)
            if true_on_policy:
                _same_kind_as_trainer(devices, trainer_device)
            processes = _engine_processes(
                cfg, model_dir, devices, dtype, seed, keys, true_on_policy, quantization, overlap
            )
            processes.start_all()
            clients = {e.url: HttpEngineClient(e.url, api_keys=keys) for e in processes.engines}
            return cls(
                loop,
                clients,
                tokenizer=tokenizer,
                processes=processes,
                api_keys=keys,
                fault_tolerance=fault_tolerance,
            )
        except BaseException:
            loop.close()
            raise

    def close(self) -> None:
        if self.loop.loop.is_closed():
            return
        try:
            self.loop.run(self._aclose(), timeout_s=60)
        finally:
            self.loop.close()
            if self.engine_processes is not None:
                self.engine_processes.stop_all()

    async def _aclose(self) -> None:
        if self.monitor is not None:
            await self.monitor.stop()
        for task in self._restarting.values():
            task.cancel()
        await asyncio.gather(*self._restarting.values(), return_exceptions=True)
        for runner in reversed(self._runners):
            await runner.cleanup()
        for client in [*self._clients.values(), *self._joining.values()]:
            await client.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- failures and restarts (on the fleet's loop) -------------------------------------

    def exit_code(self, url: str) -> int | None:
        if self.engine_processes is None:
            return None
        return self.engine_processes.exit_code(url)

    def lose(self, url: str, reason: str) -> None:
        """The engine at `url` has failed: out of routing and of weight pushes, its process
        killed and, with fault tolerance, restarted in place."""
        client = self._clients.pop(url, None) or self._joining.pop(url, None)
        if client is None:
            return  # already lost
        self.router.remove_engine(url)
        asyncio.ensure_future(client.close())
        slot = self.engine_processes.slot_of(url) if self.engine_processes else None
        if slot is None:  # an in-process engine: nothing to restart
            log.warning("engine %s failed (%s); routing around it", url, reason)
            self._notify()
            return
        self.faults.down(slot.index)
        self.engine_processes.kill(slot)  # type: ignore[union-attr]
        ft = self.fault_tolerance
        if ft is None:
            log.warning("engine %s failed (%s); routing around it", url, reason)
        elif self.faults.engine_restarts >= ft.max_engine_restarts:
            self.failure = EngineRestartError(
                f"engine {url} failed ({reason}) after {self.faults.engine_restarts} engine "
                f"restarts, the most fault_tolerance.max_engine_restarts allows"
            )
        else:
            log.warning("engine %s on %s failed (%s); restarting it", url, slot.device, reason)
            self._restarting[slot.index] = asyncio.ensure_future(self._restart(slot))
        self._notify()

    def lose_client(self, client: EngineClient, reason: str) -> None:
        """`lose`, for the weight-sync protocol, which knows engines by client."""
        for url, known in [*self._clients.items(), *self._joining.items()]:
            if known is client:
                self.lose(url, reason)
                return

    async def _restart(self, slot: ProcessSlot) -> None:
        """Start `slot`'s process again (again and again if it dies while it starts, within
        the run's restarts); it joins at the next push."""
        assert self.engine_processes is not None and self.fault_tolerance is not None
        try:
            while True:
                self.faults.engine_restarts += 1
                try:
                    engine = await asyncio.to_thread(self.engine_processes.restart, slot)
                    break
                except Exception as error:
                    if self.faults.engine_restarts >= self.fault_tolerance.max_engine_restarts:
                        self.failure = EngineRestartError(
                            f"engine on {slot.device} did not restart: {error}"
                        )
                        return
                    log.warning("engine on %s did not restart (%s); again", slot.device, error)
            self._joining[engine.url] = HttpEngineClient(engine.url, api_keys=self.api_keys)
            log.warning(
                "engine on %s restarted at %s; it serves after a weight push",
                slot.device,
                engine.url,
            )
        finally:
            self._restarting.pop(slot.index, None)
            self._notify()

    def admit(self, clients: list[EngineClient]) -> None:
        """Joining engines that now hold the fleet's weights: back in routing."""
        for url, client in list(self._joining.items()):
            if any(client is c for c in clients):
                del self._joining[url]
                self._clients[url] = client
                self.router.add_engine(url)
                slot = self.engine_processes.slot_of(url) if self.engine_processes else None
                if slot is not None:
                    self.faults.up(slot.index)
        self._notify()

    @property
    def recovering(self) -> bool:
        """Engines are restarting or waiting for their first push."""
        return bool(self._restarting or self._joining)

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_for_engine(self, key: str | None) -> str:
        """The router's pick for `key`, waiting for a restarted engine when none serves."""
        deadline = time.monotonic() + self._recovery_limit_s()
        while True:
            self.raise_failure()
            try:
                return self.router.pick(key)
            except NoEngineAvailable:
                if not self.recovering or time.monotonic() > deadline:
                    raise
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), max(deadline - time.monotonic(), 0.0))

    async def restarted_engines(self) -> list[EngineClient]:
        """The joining engines, once every restart in progress has ended (bounded)."""
        deadline = time.monotonic() + self._recovery_limit_s()
        while self._restarting and time.monotonic() < deadline:
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), max(deadline - time.monotonic(), 0.0))
        self.raise_failure()
        if not self._joining:
            raise NoEngineAvailable("no engine came back from its restart")
        return list(self._joining.values())

    def _recovery_limit_s(self) -> float:
        processes = self.engine_processes
        ft = self.fault_tolerance
        if processes is None or ft is None:
            return 0.0
        return processes.timeout_s + 2 * ft.timeout_s

    def begin_push(self) -> None:
        self.pushing = True
        self.pushes_begun += 1

    def end_push(self, version: int | None) -> None:
        """`version` is what the serving engines now hold (None: the push failed)."""
        self.pushing = False
        if version is not None:
            self.weight_version = version
            self.pushes_done += 1

    def wait(self, coro: Coroutine[Any, Any, T], *, on: LoopThread | None = None) -> T:
        """`run(coro)` on the fleet's loop (or `on`), for the trainer's thread, which meanwhile
        gives restarted engines their weights (`rejoin`): while it waits, it holds the weights
        the fleet serves."""
        future = (on or self.loop).submit(coro)
        if self.fault_tolerance is None:  # no engine restarts: nothing to do meanwhile
            return future.result()
        while True:
            try:
                return future.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                if self._joining and self.rejoin is not None:
                    self.rejoin()

    def fault_metrics(self) -> dict[str, float]:
        return self.loop.call(
            lambda: self.faults.metrics() | {"fault/serving_engines": float(len(self._clients))}
        )

    # ---- generation ----------------------------------------------------------------------

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Every request through the router, concurrently; outputs in request order."""

        async def all_of() -> list[GenerateOutput]:
            return await asyncio.gather(
                *(self.agenerate(r, key=prompt_key(r.input_ids)) for r in requests)
            )

        return self.wait(all_of())

    async def agenerate(self, request: GenerateRequest, *, key: str | None) -> GenerateOutput:
        """One request on the engine the router picks for `key` (on the fleet's loop). An engine
        that cannot be reached is taken out of routing and the request goes to another one;
        `NoEngineAvailable` when none is left."""
        request.sampling_params.validate()
        body = request_body(request)
        if self.lora_path is not None:
            body.setdefault("lora_path", self.lora_path)
        while True:
            target = await self._wait_for_engine(key)
            try:
                answer = await self._on(target, key, self._clients[target].generate(body))
                break
            except Exception as error:
                if not self._unreachable(error):
                    raise
                self.lose(target, f"unreachable: {type(error).__name__}: {error}")
                if key and key not in self._retried_keys:
                    self._retried_keys.add(key)
                    self.faults.retried_groups += 1
        assert isinstance(answer, dict)
        return output_from_body(request, answer)

    async def _on(self, target: str, key: str | None, call: Coroutine[Any, Any, T]) -> T:
        """Await `call` on `target`, counted as an active request there (and for `key`)."""
        if key:
            self._key_refs[key] = self._key_refs.get(key, 0) + 1
        self.router.begin(target)
        try:
            return await call
        finally:
            self.router.end(target)
            if key:
                self._key_refs[key] -= 1
                if not self._key_refs[key]:
                    del self._key_refs[key]
                    self._retried_keys.discard(key)
                    self.router.release(key)

    @staticmethod
    def _unreachable(error: BaseException) -> bool:
        try:
            import aiohttp
        except ImportError:
            return False
        return isinstance(error, aiohttp.ClientConnectionError | ConnectionError)

    # ---- agents --------------------------------------------------------------------------

    def sessions_url(self) -> str:
        """The session server's base URL (started on first use, with the router's HTTP front)."""
        if self._sessions_url is None:
            self._sessions_url = self.loop.run(self._start_sessions())
        return self._sessions_url

    async def _start_sessions(self) -> str:
        from verst.router.server import make_router_app
        from verst.sessions.server import make_session_app
        from verst.sessions.templates import ChatTokenizer

        self.router.sessions = True
        router_url = await self._serve(make_router_app(self.router, api_keys=self.api_keys))
        chat = ChatTokenizer(self.tokenizer)
        # The session server stays open (on loopback): agents are user code given a base_url.
        app = make_session_app(
            router_url,
            chat,
            model_name="policy",
            upstream_keys=self.api_keys,
            lora_path=self.lora_path,
            routed_experts=self.routed_experts,
        )
        return await self._serve(app)

    async def _serve(self, app: Any) -> str:
        runner, url = await _serve_app(app)
        self._runners.append(runner)
        return url


def prompt_key(input_ids: list[int]) -> str:
    """The routing key of a prompt: its samples meet on one engine and share its prefill."""
    return f"prompt-{hash(tuple(input_ids)):x}"


async def _serve_app(app: Any) -> tuple[Any, str]:
    from aiohttp import web

    from verst.http_limits import HttpLimits, runner_kwargs

    # as the verst commands serve: a client that disconnects aborts its request
    runner = web.AppRunner(app, access_log=None, **runner_kwargs(HttpLimits()))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _same_kind_as_trainer(devices: list[str], trainer_device: torch.device) -> None:
    """True on-policy engines run the trainer's kernels: on its kind of device."""
    others = [d for d in devices if torch.device(d).type != trainer_device.type]
    if others:
        raise ValueError(
            f"trainer.true_on_policy cannot be guaranteed with engines on {others}: the trainer "
            f"runs on {trainer_device.type}, and another kind of device runs other kernels "
            "(set placement.engine_devices to that kind)"
        )


async def _start_in_process(
    cfg: PlacementConfig,
    model: torch.nn.Module,
    tokenizer: Any,
    seed: int,
    keys: ApiKeys,
    true_on_policy: bool,
    quantization: Quantization,
    overlap: bool | None,
) -> tuple[dict[str, EngineClient], list[Any]]:
    """Engines on the trainer's device; the first uses `model` itself, the others copies."""
    import copy

    from verst.engine.server.app import make_app

    clients: dict[str, EngineClient] = {}
    runners = []
    for i in range(cfg.num_engines):
        engine_model = model if i == 0 else copy.deepcopy(model)
        serving = ServingEngine.from_model(
            engine_model,
            tokenizer,
            seed=seed + i,
            max_batch_size=cfg.max_batch_size,
            true_on_policy=true_on_policy,
            quantization=quantization,
            overlap=overlap,
        )
        await serving.start()
        app = make_app(serving, tokenizer, served_model_name="policy", api_keys=keys)
        runner, url = await _serve_app(app)
        runners.append(runner)
        clients[url] = InProcessEngineClient(serving)
    return clients, runners


def _engine_processes(
    cfg: PlacementConfig,
    model_dir: Path,
    devices: list[str],
    dtype: torch.dtype,
    seed: int,
    keys: ApiKeys,
    true_on_policy: bool,
    quantization: Quantization,
    overlap: bool | None,
) -> EngineProcesses:
    """`verst serve` processes, one per device (started by `start_all`)."""
    common = ["--dtype", str(dtype).removeprefix("torch."), "--max-batch-size"]
    common += [str(cfg.max_batch_size)] + (["--true-on-policy"] if true_on_policy else [])
    common += ["--quantization", quantization] + (
        ["--overlap" if overlap is not False else "--no-overlap"]
    )
    if cfg.engine_threads is not None:
        common += ["--num-threads", str(cfg.engine_threads)]
    kwargs: dict[str, Any] = dict(
        common_args=common,
        seed=seed,
        timeout_s=cfg.startup_timeout_s,
        env=keys.env(),
        nice=cfg.engine_nice,
    )
    if cfg.backend == "ray":
        from verst.fleet.ray_engines import RayEngineProcesses

        return RayEngineProcesses(model_dir, devices, first_bundle=cfg.trainer_ranks, **kwargs)
    return EngineProcesses(model_dir, devices, **kwargs)


def _devices(cfg: PlacementConfig, trainer_device: torch.device) -> list[str]:
    """Each engine's device; under Ray, unless set, the GPU of its bundle (or the CPU)."""
    if cfg.backend == "ray" and not cfg.engine_devices:
        return ["auto"] * cfg.num_engines
    return engine_devices(cfg, trainer_device)
