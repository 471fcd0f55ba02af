"""vLLM's LoRA routes (control routes: the Guard protects them, ``serve/auth.py``):
``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}`` and
``POST /v1/unload_lora_adapter`` ``{"lora_name", "lora_int_id"}``, answered as vLLM answers (a plain
text ``Success: ...`` line; a name loaded already is a 400 unless ``load_inplace``, which loads it
as the name's next version; an unknown name to unload is a 404). ``lora_path`` is read only under
``serve.weights_root`` (default: the served checkpoint's parent), as disk weight updates are."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from bi_core.serve.api_errors import ApiError
from bi_core.serve.control_routes import weights_root
from bi_core.serve.messages import LoadLoraAdapter, UnloadLoraAdapter
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


REQUEST_MODELS = {"/v1/load_lora_adapter": LoadLoraAdapterBody, "/v1/unload_lora_adapter": UnloadLoraAdapterBody}


def adapter_path(lora_path: str, root: Path | None) -> Path:
    """The adapter directory ``lora_path`` names, inside ``root`` (links followed first); 403
    outside it (or with no root), 400 for no such directory."""
    if root is None:
        raise ApiError(403, "load_lora_adapter reads adapters under serve.weights_root, which is not set (and this "
                            "model was not loaded from a directory): set serve.weights_root", "permission_error",
                       param="lora_path", code="outside_weights_root")
    path = (root / lora_path).resolve()
    if not path.is_relative_to(root):
        raise ApiError(403, f"lora_path {lora_path!r} is outside the directory adapters may be read from ({root}: "
                            "serve.weights_root, default the served checkpoint's parent)", "permission_error",
                       param="lora_path", code="outside_weights_root")
    if not path.is_dir():
        raise ApiError(400, f"lora_path {lora_path!r} is not an adapter directory ({path} "
                            f"{'is not a directory' if path.exists() else 'does not exist'})", param="lora_path")
    return path


def install(app: FastAPI, server) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterBody):
        if body.lora_name == server.model_name:
            raise ApiError(400, f"lora_name {body.lora_name!r} is the base model's name", param="lora_name")
        path = adapter_path(body.lora_path, weights_root(server.config, server.model_path))
        await server.call(LoadLoraAdapter, name=body.lora_name, path=str(path), load_inplace=body.load_inplace)
        server.lora_names.add(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterBody):
        await server.call(UnloadLoraAdapter, name=body.lora_name)
        server.lora_names.discard(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
