"""The `EngineClient`s of every engine: in-process or over SGLang's HTTP protocol.

Everything above this layer (rollout, weight sync, the router) speaks SGLang's `/generate`
request and response dicts through an `EngineClient` and never learns which engine runs.
`InProcessEngineClient` calls the very functions the verst HTTP server uses, so both give the
same dicts and the same errors; `HttpEngineClient` talks to a verst or a real SGLang server.
Failures are `EngineError(status, body)` in both. The contract itself, `EngineClient`, is in
`verst.plugins`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verst.auth import ApiKeys
from verst.engine.server import control_api as control
from verst.engine.server.app import CONTROL_PATHS
from verst.engine.server.protocol_errors import ProtocolError
from verst.engine.server.sglang_api import run_generate
from verst.engine.serving import ServingEngine
from verst.sync.broadcast import WHOLE_UPDATE_PATH
from verst.sync.buffer_layouts import BUFFERS_PATH

if TYPE_CHECKING:
    from prometheus_client.core import Metric


class EngineError(RuntimeError):
    """The engine refused a request: `status` is the HTTP status, `body` the error body."""

    def __init__(self, status: int, body: Any, *, url: str = "") -> None:
        where = f" from {url}" if url else ""
        super().__init__(f"engine error {status}{where}: {body}")
        self.status = status
        self.body = body


def _refuse_stream(payload: dict[str, Any]) -> None:
    if payload.get("stream"):
        raise ValueError("EngineClient.generate does not stream; drop `stream` from the payload")


class InProcessEngineClient:
    """An `EngineClient` over a `ServingEngine` in this event loop (no sockets, no JSON)."""

    def __init__(self, serving: ServingEngine, *, owns_serving: bool = False) -> None:
        self.serving = serving
        self.owns_serving = owns_serving

    @classmethod
    async def from_model_dir(cls, model_path: str, **kwargs: Any) -> InProcessEngineClient:
        """Load a local HF directory, start its serving loop; `close()` stops it."""
        serving = ServingEngine.from_model_dir(model_path, **kwargs)
        await serving.start()
        return cls(serving, owns_serving=True)

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        _refuse_stream(payload)
        try:
            return await run_generate(self.serving, self.serving.tokenizer, payload)
        except ProtocolError as error:
            raise EngineError(error.status, error.body) from error

    async def health(self) -> bool:
        return self.serving.is_alive

    async def health_generate(self, timeout_s: float = 20.0) -> bool:
        return await control.probe_generation(self.serving, timeout_s)

    async def pause_generation(self, mode: str = "abort") -> None:
        try:
            await control.run_pause(self.serving, {"mode": mode})
        except ProtocolError as error:
            raise EngineError(error.status, error.body) from error

    async def continue_generation(self) -> None:
        await self.serving.resume()

    async def flush_cache(self) -> bool:
        return await self.serving.flush_cache()

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await control.run_abort(self.serving, {"rid": rid, "abort_all": abort_all})

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> dict[str, Any]:
        payload = {"model_path": model_path, "weight_version": weight_version}
        status, body = await control.run_update_weights_from_disk(self.serving, payload)
        if status != 200:
            raise EngineError(status, body)
        return body

    async def get_weight_version(self) -> str:
        return self.serving.weight_version

    async def update_weights_from_tensors(
        self,
        named_tensors: Any,
        weight_version: str | None = None,
        *,
        lora_name: str | None = None,
        lora_config: dict[str, Any] | None = None,
    ) -> None:
        """In-process only: copy tensors straight into the engine (no serialisation); with
        `lora_name`, into that LoRA adapter."""
        ok, message = await self.serving.update_weights_from_tensors(
            named_tensors, weight_version, lora_name=lora_name, lora_config=lora_config
        )
        if not ok:
            raise EngineError(400, {"success": False, "message": message})

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        return await self._control_call(
            control.run_load_lora_adapter, {"lora_name": name, "lora_path": path}
        )

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        return await self._control_call(control.run_unload_lora_adapter, {"lora_name": name})

    async def _control_call(self, run: Any, body: dict[str, Any]) -> dict[str, Any]:
        try:
            status, reply = await run(self.serving, body)
        except ProtocolError as error:
            raise EngineError(error.status, error.body) from error
        if status != 200:
            raise EngineError(status, reply)
        return reply

    async def init_weights_update_group(self, **body: Any) -> None:
        status, reply = await control.run_init_weights_update_group(self.serving, body)
        if status != 200:
            raise EngineError(status, reply)

    async def update_weights_from_distributed(self, body: dict[str, Any]) -> None:
        status, reply = await control.run_update_weights_from_distributed(self.serving, body)
        if status != 200:
            raise EngineError(status, reply)

    async def update_weights_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._control_call(control.run_update_weights_from_tensor, body)

    async def update_weights_from_buffers(self, body: dict[str, Any]) -> dict[str, Any]:
        """verst's whole-update request (`verst.sync.buffer_layouts`)."""
        return await self._control_call(control.run_update_weights_from_buffers, body)

    async def update_weights_whole_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        """verst's whole update over the broadcast group (`verst.sync.broadcast`)."""
        return await self._control_call(control.run_update_weights_whole_from_distributed, body)

    async def takes_whole_updates(self) -> bool:
        """Whether the engine answers verst's whole-update requests: always, in-process."""
        return True

    async def update_weight_version(self, version: str, *, abort_all: bool = False) -> None:
        await control.run_update_weight_version(
            self.serving, {"new_version": version, "abort_all_requests": abort_all}
        )

    async def get_load(self) -> dict[str, Any]:
        return control.loads_body(self.serving)

    async def metric_families(self) -> list[Metric]:
        return self.serving.metrics.families()

    async def close(self) -> None:
        if self.owns_serving:
            await self.serving.stop()


class HttpEngineClient:
    """An `EngineClient` over HTTP to a verst (`verst serve`) or SGLang server; with `api_keys`
    it sends `Authorization: Bearer` (the admin key on control routes, when set)."""

    def __init__(
        self, base_url: str, *, timeout_s: float | None = None, api_keys: ApiKeys | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.api_keys = api_keys or ApiKeys()
        self._session: Any = None
        self._verst_server: bool | None = None  # `takes_whole_updates`, once known

    def _client(self) -> Any:
        try:
            import aiohttp
        except ImportError as error:
            message = "HttpEngineClient needs aiohttp: pip install 'verst[serve]'"
            raise ImportError(message) from error
        # Created lazily: an aiohttp session belongs to the event loop that first uses it.
        if self._session is None or self._session.closed:
            # No cap on connections: with aiohttp's default of 100, control calls (pause,
            # weight updates) would queue behind 100 long generations, which wait for them.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    async def _request(
        self, method: str, path: str, payload: Any = None, *, ok: tuple[int, ...] = (200,)
    ) -> tuple[int, Any]:
        url = self.base_url + path
        admin = path in CONTROL_PATHS or (
            path == "/abort_request" and bool(payload and payload.get("abort_all"))
        )
        headers = self.api_keys.headers(admin=admin)
        async with self._client().request(method, url, json=payload, headers=headers) as response:
            raw = await response.read()
            try:
                body = await response.json(content_type=None) if raw.strip() else None
            except ValueError:
                body = raw.decode(errors="replace")
            if response.status not in ok and not 200 <= response.status < 300:
                raise EngineError(response.status, body, url=url)
            return response.status, body

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        _refuse_stream(payload)
        return (await self._request("POST", "/generate", payload))[1]

    async def health(self) -> bool:
        return await self._answers_ok("/health")

    async def health_generate(self) -> bool:
        """SGLang's `/health_generate`: the engine generated a token (False if unreachable)."""
        return await self._answers_ok("/health_generate")

    async def _answers_ok(self, path: str) -> bool:
        """Whether GET `path` answers 200 (503, an error or no answer: False)."""
        import aiohttp

        try:
            status, _ = await self._request("GET", path, ok=(200, 503))
        except (aiohttp.ClientError, OSError, EngineError):
            return False
        return status == 200

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        status, _ = await self._request("POST", "/flush_cache", ok=(200, 400))
        return status == 200

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return (await self._request("POST", "/update_weights_from_disk", payload))[1]

    async def get_weight_version(self) -> str:
        # /model_info carries weight_version on SGLang 0.5.9+ and on verst; /get_weight_version
        # is gone from SGLang.
        return str((await self._request("GET", "/model_info"))[1]["weight_version"])

    async def init_weights_update_group(self, **body: Any) -> None:
        await self._request("POST", "/init_weights_update_group", body)

    async def update_weights_from_distributed(self, body: dict[str, Any]) -> None:
        await self._request("POST", "/update_weights_from_distributed", body)

    async def update_weights_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        return (await self._request("POST", "/update_weights_from_tensor", body))[1]

    async def update_weights_from_buffers(self, body: dict[str, Any]) -> dict[str, Any]:
        """verst's whole-update request (`verst.sync.buffer_layouts`); a verst server only."""
        return (await self._request("POST", BUFFERS_PATH, body))[1]

    async def update_weights_whole_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        """verst's whole update over the broadcast group (`verst.sync.broadcast`); a verst
        server only."""
        return (await self._request("POST", WHOLE_UPDATE_PATH, body))[1]

    async def takes_whole_updates(self) -> bool:
        """Whether the server is a `verst serve` (its `/server_info` version reads "verst..."),
        which answers verst's whole-update requests; an SGLang server is sent SGLang's calls.
        Asked once per client."""
        if self._verst_server is None:
            try:
                info = (await self._request("GET", "/server_info"))[1]
            except EngineError:
                info = None  # a server without /server_info (vLLM) is no verst server
            version = info.get("version") if isinstance(info, dict) else None
            self._verst_server = isinstance(version, str) and version.startswith("verst")
        return self._verst_server

    async def update_weight_version(self, version: str, *, abort_all: bool = False) -> None:
        payload = {"new_version": version, "abort_all_requests": abort_all}
        await self._request("POST", "/update_weight_version", payload)

    async def get_load(self) -> dict[str, Any]:
        return (await self._request("GET", "/v1/loads"))[1]

    async def metric_families(self) -> list[Metric]:
        """`GET /metrics` parsed (an SGLang server answers it with `--enable-metrics`)."""
        from prometheus_client.parser import text_string_to_metric_families

        url = self.base_url + "/metrics"
        async with self._client().get(url, headers=self.api_keys.headers()) as response:
            text = await response.text()
            if response.status != 200:
                raise EngineError(response.status, text, url=url)
        return list(text_string_to_metric_families(text))

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        body = {"lora_name": name, "lora_path": path}
        return (await self._request("POST", "/load_lora_adapter", body))[1]

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        return (await self._request("POST", "/unload_lora_adapter", {"lora_name": name}))[1]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
