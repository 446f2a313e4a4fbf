"""SGLang's control routes as plain functions over a `ServingEngine`: model, server and load
information, pause / continue / abort, and every weight update (from disk, tensors, a
torch.distributed group, the version alone), request body in, response body out. The request
path (`/generate`) is in `sglang_api`, the error envelopes in `protocol_errors`; the aiohttp
app and the in-process client both call these, so their answers cannot drift.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from verst.engine.sampling import SamplingParams
from verst.engine.server.protocol_errors import validation_error, value_error
from verst.engine.serving import PAUSE_MODES, ServingEngine

# SGLang's fixed answers to pause, continue and a cache flush
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
PAUSE_OK = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUE_OK = {"message": "Generation continued successfully.", "status": "ok"}

# ---- control ---------------------------------------------------------------------------------


def model_info_body(serving: ServingEngine, served_model_name: str) -> dict[str, Any]:
    config = getattr(serving.scheduler.model, "config", None)
    return {
        "model_path": serving.model_path,
        "tokenizer_path": serving.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": serving.weight_version,
        "served_model_name": served_model_name,
        "load_format": "auto",
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def max_total_num_tokens(serving: ServingEngine) -> int:
    """The tokens the KV pool holds (SGLang's `max_total_num_tokens`)."""
    pool = serving.scheduler.pool
    return pool.num_pages * pool.page_size


def max_req_input_len(serving: ServingEngine) -> int:
    """The longest prompt served: below the context and within the KV pool (SGLang's
    `max_req_input_len`, `min(context_len - 1, max_total_num_tokens - 1)`)."""
    total = max_total_num_tokens(serving) - 1
    return min(serving.context_len - 1, total) if serving.context_len else total


def loads_body(serving: ServingEngine) -> dict[str, Any]:
    """`/v1/loads`: one DP rank; the used-token counts and rates are 0 (not tracked)."""
    load = serving.load()
    return {
        "timestamp": time.time(),
        "version": _version(),
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": load["num_running_reqs"],
                "num_waiting_reqs": load["num_waiting_reqs"],
                "num_used_tokens": 0,
                "num_total_tokens": 0,
                "max_total_num_tokens": max_total_num_tokens(serving),
                "token_usage": 0.0,
                "gen_throughput": 0.0,
                "cache_hit_rate": 0.0,
            }
        ],
    }


def server_info_body(
    serving: ServingEngine, served_model_name: str, host: str = "", port: int = 0
) -> dict[str, Any]:
    load = serving.load()
    return {
        "model_path": serving.model_path,
        "tokenizer_path": serving.model_path,
        "served_model_name": served_model_name,
        "host": host,
        "port": port,
        "tp_size": 1,
        "dp_size": 1,
        "context_length": serving.context_len,
        "max_running_requests": serving.max_batch_size,
        "max_total_num_tokens": max_total_num_tokens(serving),
        "max_req_input_len": max_req_input_len(serving),
        "random_seed": None,
        "weight_version": serving.weight_version,
        "num_running_reqs": load["num_running_reqs"],
        "num_waiting_reqs": load["num_waiting_reqs"],
        "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {}, **load}],
        "version": _version(),
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"verst-{version('verst')}"
    except PackageNotFoundError:
        return "verst"


def _body_dict(payload: Any) -> dict[str, Any]:
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        raise validation_error("the request body must be a JSON object")
    return payload


async def run_pause(serving: ServingEngine, payload: Any) -> dict[str, Any]:
    mode = _body_dict(payload).get("mode") or "abort"
    if mode not in PAUSE_MODES:
        raise validation_error(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
    await serving.pause(mode)
    return PAUSE_OK


async def run_abort(serving: ServingEngine, payload: Any) -> None:
    body = _body_dict(payload)
    rid = body.get("rid") or None
    await serving.abort(None if rid is None else str(rid), abort_all=bool(body.get("abort_all")))


async def run_update_weights_from_disk(
    serving: ServingEngine, payload: Any
) -> tuple[int, dict[str, Any]]:
    body = _body_dict(payload)
    model_path = body.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        raise validation_error("model_path: Field required")
    version = body.get("weight_version")
    ok, message = await serving.update_weights_from_disk(
        model_path,
        None if version is None else str(version),
        abort_all_requests=bool(body.get("abort_all_requests")),
    )
    return (200 if ok else 400), {"success": ok, "message": message, "num_paused_requests": 0}


async def run_init_weights_update_group(
    serving: ServingEngine, payload: Any
) -> tuple[int, dict[str, Any]]:
    body = _body_dict(payload)
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        if body.get(key) is None:
            raise validation_error(f"{key}: Field required")
    ok, message = await serving.init_weights_update_group(
        master_address=str(body["master_address"]),
        master_port=int(body["master_port"]),
        rank_offset=int(body["rank_offset"]),
        world_size=int(body["world_size"]),
        group_name=str(body.get("group_name") or "weight_update_group"),
        backend=str(body.get("backend") or "nccl"),
    )
    return (200 if ok else 400), {"success": ok, "message": message}


async def run_destroy_weights_update_group(
    serving: ServingEngine, payload: Any
) -> tuple[int, dict[str, Any]]:
    body = _body_dict(payload)
    ok, message = await serving.destroy_weights_update_group(
        str(body.get("group_name") or "weight_update_group")
    )
    return (200 if ok else 400), {"success": ok, "message": message}


async def run_update_weights_from_distributed(
    serving: ServingEngine, payload: Any
) -> tuple[int, dict[str, Any]]:
    """SGLang's parallel lists `names`, `dtypes`, `shapes`; `load_format` null (tensor by tensor)
    or "flattened_bucket" (one buffer)."""
    from verst.sync.broadcast import bucket_specs

    body = _body_dict(payload)
    try:
        specs = bucket_specs(body)
    except ValueError as error:
        raise validation_error(str(error)) from None
    load_format = body.get("load_format")
    if load_format not in (None, "flattened_bucket"):
        raise value_error(f"load_format {load_format!r} is not supported")
    if body.get("abort_all_requests"):
        await serving.abort(None, abort_all=True, message="Abort by weight update.")
    version = body.get("weight_version")
    ok, message = await serving.update_weights_from_distributed(
        specs,
        group_name=str(body.get("group_name") or "weight_update_group"),
        flattened=load_format == "flattened_bucket",
        weight_version=None if version is None else str(version),
        **_adapter_target(body),
    )
    return (200 if ok else 400), {"success": ok, "message": message}


async def run_update_weights_whole_from_distributed(
    serving: ServingEngine, payload: Any
) -> tuple[int, dict[str, Any]]:
    """verst's `/verst/update_weights_from_distributed` (`verst.sync.broadcast`): the whole
    update over the broadcast group, with the pause, the flush, the version and the continue in
    the same request; the buckets' names, dtypes and shapes travel through the group."""
    body = _body_dict(payload)
    mode = body.get("pause_mode")
    if mode is not None and mode not in PAUSE_MODES:
        raise validation_error(f"pause_mode must be null or one of {', '.join(PAUSE_MODES)}")
    version = body.get("weight_version")
    ok, message = await serving.update_weights_whole_from_distributed(
        group_name=str(body.get("group_name") or "weight_update_group"),
        pause_mode=mode,
        flush_cache=bool(body.get("flush_cache")),
        weight_version=None if version is None else str(version),
        continue_generation=bool(body.get("continue_generation")),
    )
    return (200 if ok else 400), {
        "success": ok,
        "message": message,
        "weight_version": serving.weight_version,
    }


async def run_update_weights_from_tensor(
    serving: ServingEngine, payload: Any
) -> tuple[int, dict[str, Any]]:
    """SGLang's `serialized_named_tensors` (one base64 pickle per TP rank; this engine has one
    rank and reads the first), `load_format` (null, "direct" or "flattened_bucket"),
    `flush_cache`, `abort_all_requests`, `weight_version`. The tensors arrive as handles to the
    trainer's memory (`verst.sync.ipc`); the bytes are copied in place."""
    body = _body_dict(payload)
    entries = body.get("serialized_named_tensors")
    if (
        not isinstance(entries, list)
        or not entries
        or not all(isinstance(e, str) and e for e in entries)
    ):
        raise validation_error(
            "serialized_named_tensors: Field required (a list of base64 strings, one per TP rank)"
        )
    load_format = body.get("load_format")
    if load_format not in (None, "direct", "flattened_bucket"):
        raise value_error(
            f"load_format {load_format!r} is not supported (null, 'direct' or 'flattened_bucket')"
        )
    if body.get("abort_all_requests"):
        await serving.abort(None, abort_all=True, message="Abort by weight update.")
    version = body.get("weight_version")
    ok, message = await serving.update_weights_from_shared(
        entries[0],
        load_format=load_format,
        weight_version=None if version is None else str(version),
        **_adapter_target(body),
    )
    return (200 if ok else 400), {"success": ok, "message": message}


async def run_update_weights_from_buffers(
    serving: ServingEngine, payload: Any
) -> tuple[int, dict[str, Any]]:
    """verst's `/verst/update_weights_from_buffers` (`verst.sync.buffer_layouts`): the
    trainer's staging buffers by layout id, with the pause, the flush, the version and the
    continue in the same request. 409 (nothing changed) when a layout is not held."""
    from verst.sync.buffer_layouts import (
        UNKNOWN_LAYOUT_STATUS,
        UnknownLayouts,
        parse_entries,
        parse_released,
    )

    body = _body_dict(payload)
    try:
        entries = parse_entries(body.get("buffers"))
        released = parse_released(body.get("release_layouts"))
    except ValueError as error:
        raise validation_error(str(error)) from None
    mode = body.get("pause_mode")
    if mode is not None and mode not in PAUSE_MODES:
        raise validation_error(f"pause_mode must be null or one of {', '.join(PAUSE_MODES)}")
    version = body.get("weight_version")
    try:
        ok, message = await serving.update_weights_from_buffers(
            entries,
            pause_mode=mode,
            flush_cache=bool(body.get("flush_cache")),
            weight_version=None if version is None else str(version),
            continue_generation=bool(body.get("continue_generation")),
            release_layouts=released,
        )
    except UnknownLayouts as error:
        reply = {"success": False, "message": str(error), "unknown_layouts": error.ids}
        return UNKNOWN_LAYOUT_STATUS, reply
    return (200 if ok else 400), {
        "success": ok,
        "message": message,
        "weight_version": serving.weight_version,
    }


def _adapter_target(body: dict[str, Any]) -> dict[str, Any]:
    """verst's fields on an update that address it to a LoRA adapter of the registry:
    `lora_name` (and its peft `lora_config`); none for the model's own weights."""
    if body.get("lora_name") is None:
        return {}
    name = _lora_name(body)
    config = body.get("lora_config")
    if not isinstance(config, dict):
        raise validation_error("lora_config: Field required with lora_name (peft's keys)")
    return {"lora_name": name, "lora_config": config}


def _lora_name(body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise validation_error("lora_name: Field required (a non-empty string)")
    return name


async def run_load_lora_adapter(serving: ServingEngine, payload: Any) -> tuple[int, dict[str, Any]]:
    """SGLang's `/load_lora_adapter`: `{lora_name, lora_path, pinned}` (a peft directory)."""
    body = _body_dict(payload)
    name, path = _lora_name(body), body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise validation_error("lora_path: Field required (a peft adapter directory)")
    ok, message = await serving.load_lora_adapter(name, path)
    return _adapter_reply(serving, ok, message)


async def run_unload_lora_adapter(
    serving: ServingEngine, payload: Any
) -> tuple[int, dict[str, Any]]:
    ok, message = await serving.unload_lora_adapter(_lora_name(_body_dict(payload)))
    return _adapter_reply(serving, ok, message)


def _adapter_reply(serving: ServingEngine, ok: bool, message: str) -> tuple[int, dict[str, Any]]:
    body = {
        "success": ok,
        "error_message": "" if ok else message,
        "loaded_adapters": serving.loaded_adapters(),
    }
    return (200 if ok else 400), body


async def run_get_weights_by_name(serving: ServingEngine, payload: Any) -> tuple[int, Any]:
    """SGLang's `/get_weights_by_name`: `{"name", "truncate_size": 100}` → the parameter's first
    `truncate_size` rows as float32 lists (a test helper, as in SGLang)."""
    body = _body_dict(payload)
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise validation_error("name: Field required")
    truncate = body.get("truncate_size", 100)
    if not isinstance(truncate, int) or isinstance(truncate, bool) or truncate < 0:
        raise validation_error("truncate_size must be a non-negative int")
    values = await serving.get_weights_by_name(name, truncate)
    if values is None:
        return 400, {"error": {"message": f"Get parameter by name failed: unknown name {name!r}"}}
    return 200, values


async def run_update_weight_version(serving: ServingEngine, payload: Any) -> dict[str, Any]:
    body = _body_dict(payload)
    new_version = body.get("new_version")
    if new_version is None:
        raise validation_error("new_version: Field required")
    await serving.update_weight_version(
        str(new_version), abort_all=body.get("abort_all_requests", True) is not False
    )
    return {
        "success": True,
        "message": f"Weight version updated to {new_version}",
        "new_version": str(new_version),
    }


async def probe_generation(serving: ServingEngine, timeout_s: float) -> bool:
    """SGLang's `/health_generate`: one greedy token through the scheduler within `timeout_s`."""
    probe = serving.generate(
        [0],
        SamplingParams(max_new_tokens=1, temperature=0.0),
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        return_logprob=False,
    )
    try:
        await asyncio.wait_for(probe, timeout=timeout_s)
    except (TimeoutError, RuntimeError):
        return False
    return True
