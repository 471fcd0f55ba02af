"""The LoRA routes (control routes: the Guard protects them, ``serve/auth.py``).

vLLM: ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}`` and
``POST /v1/unload_lora_adapter`` ``{"lora_name", "lora_int_id"}``, answered as vLLM answers (a plain
text ``Success: ...`` line; a name loaded already is a 400 unless ``load_inplace``, which loads it
as the name's next version; an unknown name to unload is a 404).

SGLang: ``POST /load_lora_adapter`` ``{"lora_name", "lora_path", "pinned"}``, ``POST
/unload_lora_adapter`` ``{"lora_name"}`` and ``POST /load_lora_adapter_from_tensors``
``{"lora_name", "config_dict", "serialized_tensors", "load_format"}`` (the adapter shared by
handle, ``bi_core.rl.serialize_named_tensors``), answered ``{"success": true, "error_message":
null, "loaded_adapters": {name: source}}``. From tensors, a loaded name takes them as its next
version (a trainer's adapter sync; SGLang refuses a loaded name). Slots are never evicted, so
``pinned`` changes nothing.

``lora_path`` is read only under ``serve.weights_root`` (default: the served checkpoint's parent),
as disk weight updates are."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from bi_core.serve.api_errors import ApiError
from bi_core.serve.control_routes import dir_under_root, weights_root
from bi_core.serve.messages import LoadLoraAdapter, LoadLoraAdapterFromTensor, UnloadLoraAdapter
from bi_core.serve.openai_protocol import STRICT


class LoadLoraAdapterBody(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest``."""

    model_config = STRICT
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoraAdapterBody(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest`` (``lora_int_id`` is vLLM's own id: accepted, unused)."""

    model_config = STRICT
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class SglangLoadBody(BaseModel):
    """SGLang's ``LoadLoRAAdapterReqInput`` (``lora_id`` is SGLang's own id: accepted, unused)."""

    model_config = STRICT
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False
    lora_id: str | None = None


class SglangUnloadBody(BaseModel):
    model_config = STRICT
    lora_name: str = Field(min_length=1)
    lora_id: str | None = None


class SglangFromTensorsBody(BaseModel):
    """SGLang's ``LoadLoRAAdapterFromTensorsReqInput``; ``load_format`` None or "direct" (a list of
    (name, tensor) pairs), no added tokens (the vocabulary is the base model's)."""

    model_config = STRICT
    lora_name: str = Field(min_length=1)
    config_dict: dict
    serialized_tensors: str = Field(min_length=1)
    pinned: bool = False
    added_tokens_config: None = None
    lora_id: str | None = None
    load_format: Literal["direct"] | None = None


REQUEST_MODELS = {"/v1/load_lora_adapter": LoadLoraAdapterBody, "/v1/unload_lora_adapter": UnloadLoraAdapterBody,
                  "/load_lora_adapter": SglangLoadBody, "/unload_lora_adapter": SglangUnloadBody,
                  "/load_lora_adapter_from_tensors": SglangFromTensorsBody}
SUCCESS_STYLE = frozenset({"/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter_from_tensors"})


def adapter_path(lora_path: str, root: Path | None) -> Path:
    """The adapter directory ``lora_path`` names, inside ``root`` (see ``dir_under_root``)."""
    return dir_under_root(lora_path, root, param="lora_path", route="load_lora_adapter", reads="adapters",
                          kind="adapter")


def _not_base(server, name: str) -> None:
    if name == server.model_name:
        raise ApiError(400, f"lora_name {name!r} is the base model's name", param="lora_name")


async def _load(server, name: str, lora_path: str, load_inplace: bool) -> None:
    _not_base(server, name)
    path = adapter_path(lora_path, weights_root(server.config, server.model_path))
    done = await server.call(LoadLoraAdapter, name=name, path=str(path), load_inplace=load_inplace)
    server.lora_names[name] = done["source"]


async def _unload(server, name: str) -> None:
    await server.call(UnloadLoraAdapter, name=name)
    server.lora_names.pop(name, None)


def _sglang_answer(server) -> dict:
    return {"success": True, "error_message": None, "loaded_adapters": dict(sorted(server.lora_names.items()))}


def install(app: FastAPI, server) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterBody):
        await _load(server, body.lora_name, body.lora_path, body.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterBody):
        await _unload(server, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/load_lora_adapter")
    async def sglang_load(body: SglangLoadBody):
        await _load(server, body.lora_name, body.lora_path, load_inplace=False)
        return _sglang_answer(server)

    @app.post("/unload_lora_adapter")
    async def sglang_unload(body: SglangUnloadBody):
        await _unload(server, body.lora_name)
        return _sglang_answer(server)

    @app.post("/load_lora_adapter_from_tensors")
    async def sglang_from_tensors(body: SglangFromTensorsBody):
        _not_base(server, body.lora_name)
        done = await server.call(LoadLoraAdapterFromTensor, name=body.lora_name, payload=body.serialized_tensors,
                                 config=body.config_dict)
        server.lora_names[body.lora_name] = done["source"]
        return _sglang_answer(server)
