"""The routes an RL trainer drives a rollout server with: vLLM's names first (its RLHF and dev-mode
routes), SGLang's as aliases, each answered once the engine did it, with the body those projects
answer. Bad input gets one OpenAI-shaped error naming the parameter (SGLang's weight routes also
carry ``success: false`` and ``message``, as SGLang answers). Long calls (a weight sync waits for
the trainer's broadcast) wait on a future, holding no thread of the HTTP process.

vLLM: ``POST /pause?mode=abort|wait|keep`` -> ``{"status": "paused"}``, ``POST /resume`` ->
``{"status": "resumed"}``, ``GET /is_paused`` -> ``{"is_paused": bool}``, ``POST /sleep?level=1|2&mode=``
and ``POST /wake_up?tags=weights&tags=kv_cache`` (empty 200), ``GET /is_sleeping``,
``POST /reset_prefix_cache`` (empty 200), ``POST /abort_requests`` ``{"request_ids": [...]}`` (none:
all) -> ``{"status": "aborted", "aborted": n}``, ``GET /get_world_size``, ``GET /weight_info``,
``POST /init_weight_transfer_engine`` ``{"init_info": {...}}`` and ``POST /update_weights``
``{"update_info": {...}}`` (the NCCL backend's fields).

SGLang: ``POST /pause_generation`` ``{"mode": "abort"|"in_place"}``, ``POST /continue_generation``,
``POST /abort_request`` ``{"rid", "abort_all"}``, ``GET|POST /flush_cache``,
``POST /init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/update_weights_from_disk``, ``/update_weights_from_tensor``
(``{"success", "message"}``),
``GET|POST /release_memory_occupation`` and ``/resume_memory_occupation`` ``{"tags"}``,
``GET /get_weight_version``, ``GET /get_model_info`` (and ``/model_info``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from bi_core.serve.api_errors import ApiError
from bi_core.serve.control_bodies import (  # noqa: F401 - REQUEST_MODELS, SUCCESS_STYLE: app.py reads them here
    DEFAULT_GROUP,
    REQUEST_MODELS,
    SUCCESS_STYLE,
    WAKE_TAGS,
    AbortRequestBody,
    AbortRequestsBody,
    ContinueGenerationBody,
    DestroyWeightsUpdateGroupBody,
    InitWeightsUpdateGroupBody,
    InitWeightTransferBody,
    MemoryOccupationBody,
    PauseGenerationBody,
    ReleaseMemoryBody,
    UpdateWeightsBody,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
)
from bi_core.serve.messages import (
    AbortRequests,
    DestroyWeightsUpdateGroup,
    GetWeightVersion,
    InitWeightsUpdateGroup,
    IsPaused,
    IsSleeping,
    PauseGeneration,
    PauseMode,
    ResetPrefixCache,
    ResumeGeneration,
    Sleep,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    WakeUp,
)


def _weight_version(v: int | str | None) -> int | None:
    if isinstance(v, str):
        if not v.isdigit():
            raise ApiError(400, f"weight_version must be an integer (the engine's versions are integers), got {v!r}",
                           param="weight_version")
        return int(v)
    if v is not None and v < 0:
        raise ApiError(400, f"weight_version must be >= 0, got {v}", param="weight_version")
    return v


def _check_lengths(names: list[str], dtypes: list[str], shapes: list[list[int]], dtype_param: str) -> None:
    if len(dtypes) != len(names):
        raise ApiError(400, f"{dtype_param} has {len(dtypes)} entries for {len(names)} names", param=dtype_param)
    if len(shapes) != len(names):
        raise ApiError(400, f"shapes has {len(shapes)} entries for {len(names)} names", param="shapes")


def _tags(tags: list[str] | None) -> list[str] | None:
    if tags is not None:
        bad = [t for t in tags if t not in WAKE_TAGS]
        if bad or not tags:
            raise ApiError(400, f"tags must be a non-empty list of {', '.join(WAKE_TAGS)} (or left out: all); got "
                                f"{tags}", param="tags")
    return tags


def weights_root(config, model_path: str | None) -> Path | None:
    """Where ``/update_weights_from_disk`` may read: serve.weights_root, else the served checkpoint's
    parent directory (its siblings: the checkpoints a trainer writes beside it); None for a random
    model without serve.weights_root."""
    if config.weights_root is not None:
        return Path(config.weights_root).resolve()
    return Path(model_path).resolve().parent if model_path else None


def checkpoint_path(model_path: str, root: Path | None) -> Path:
    """The checkpoint directory a disk update names, inside ``root`` (see ``dir_under_root``)."""
    return dir_under_root(model_path, root, param="model_path", route="update_weights_from_disk",
                          reads="checkpoints", kind="checkpoint")


def dir_under_root(given: str, root: Path | None, *, param: str, route: str, reads: str, kind: str) -> Path:
    """The directory ``given`` names, inside ``root`` (a relative path is taken from there; links
    are followed first, so none leads out). ApiError otherwise: 403 outside the root (or with
    none), 400 for no such directory."""
    if root is None:
        raise ApiError(403, f"{route} reads {reads} under serve.weights_root, which is not set (and this model was "
                            "not loaded from a directory): set serve.weights_root", "permission_error", param=param,
                       code="outside_weights_root")
    path = (root / given).resolve()  # an absolute path replaces the root
    if not path.is_relative_to(root):
        raise ApiError(403, f"{param} {given!r} is outside the directory {route} may read ({root}: "
                            "serve.weights_root, default the served checkpoint's parent)", "permission_error",
                       param=param, code="outside_weights_root")
    if not path.is_dir():
        raise ApiError(400, f"{param} {given!r} is not a{'n' if kind[0] in 'aeiou' else ''} {kind} directory ({path} "
                            f"{'is not a directory' if path.exists() else 'does not exist'})", param=param)
    return path


def install(app: FastAPI, server) -> None:
    call = server.call

    # ------------------------------------------------------------------ pause / resume / abort (vLLM)

    @app.post("/pause")
    async def pause(mode: Annotated[PauseMode | None, Query()] = None,
                    clear_cache: Annotated[bool | None, Query()] = None,
                    wait_for_inflight_requests: Annotated[bool, Query()] = False):
        """vLLM's pause: abort the requests in flight, wait for them, or keep them frozen until
        /resume; new requests wait. ``clear_cache`` (default true, false with keep) drops the
        prefix cache once paused. ``wait_for_inflight_requests`` is vLLM's older spelling of wait."""
        if wait_for_inflight_requests:
            if mode not in (None, "wait"):
                raise ApiError(400, f"wait_for_inflight_requests=true means mode=wait; got mode={mode}", param="mode")
            mode = "wait"
        mode = mode or "abort"
        if clear_cache and mode == "keep":
            raise ApiError(400, "clear_cache cannot be used with mode=keep: the kept requests go on from their "
                                "cache", param="clear_cache")
        await call(PauseGeneration, mode=mode, clear_cache=mode != "keep" if clear_cache is None else clear_cache)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await call(ResumeGeneration)
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": await call(IsPaused)}

    @app.post("/abort_requests")
    async def abort_requests(body: AbortRequestsBody | None = None):
        """vLLM's: abort these requests (by the ids their responses carry), or all of them."""
        ids = body.request_ids if body is not None else None
        if not ids:
            return {"status": "aborted", "aborted": await call(AbortRequests, request_ids=None)}
        missing = [i for i in ids if i not in server.requests]
        if missing:
            raise ApiError(404, f"no unfinished request with id {missing[0]!r} (finished already, or never sent)",
                           param="request_ids", code="request_not_found")
        engine_ids = sorted({c.request_id for i in ids for c in server.requests[i] if c.output is None})
        await call(AbortRequests, request_ids=engine_ids)
        return {"status": "aborted", "aborted": len(ids)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: Annotated[bool, Query()] = False,
                                 reset_external: Annotated[bool, Query()] = False):
        if reset_running_requests:
            raise ApiError(400, "reset_running_requests is not supported: pause (or abort) the running requests "
                                "first", param="reset_running_requests")
        if reset_external:
            raise ApiError(400, "this engine has no external (connector) cache", param="reset_external")
        if not await call(ResetPrefixCache):
            raise ApiError(400, "the engine did not reset its prefix cache (requests are running, or prefix caching "
                                "is off)")
        return Response(status_code=200)

    # ------------------------------------------------------------------ sleep / wake (vLLM)

    @app.post("/sleep")
    async def sleep(level: Annotated[int, Query()] = 1, mode: Annotated[PauseMode, Query()] = "abort"):
        """vLLM's sleep: pause (mode, unless paused), then release the KV cache and the GDN state,
        and move the weights to host memory (level 1) or drop them (level 2)."""
        if level not in (1, 2):
            raise ApiError(400, f"level must be 1 (weights to host memory) or 2 (weights dropped), got {level}",
                           param="level")
        await call(Sleep, level=level, mode=mode)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None):
        await call(WakeUp, tags=_tags(tags))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": await call(IsSleeping)}

    # ------------------------------------------------------------------ facts (vLLM)

    @app.get("/get_world_size")
    async def get_world_size(include_dp: Annotated[bool, Query()] = True):
        return {"world_size": server.tensor_parallel_size}  # no data parallelism: the same with or without it

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": await call(GetWeightVersion)}

    # ------------------------------------------------------------------ weight transfer (vLLM, NCCL backend)

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitWeightTransferBody):
        i = body.init_info
        await call(InitWeightsUpdateGroup, master_address=i.master_address, master_port=i.master_port,
                   rank_offset=i.rank_offset, world_size=i.world_size, group_name=DEFAULT_GROUP, backend=None)
        return {"message": "Weight transfer initialized"}

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsBody):
        u = body.update_info
        _check_lengths(u.names, u.dtype_names, u.shapes, "dtype_names")
        await call(UpdateWeightsFromDistributed, names=u.names, dtypes=u.dtype_names, shapes=u.shapes,
                   group_name=DEFAULT_GROUP, flush_cache=True, weight_version=None, abort_all=False)
        return {"message": "Weights updated"}

    # ------------------------------------------------------------------ SGLang's names

    @app.post("/pause_generation")
    async def pause_generation(body: PauseGenerationBody | None = None):
        mode = body.mode if body is not None else "abort"
        if mode == "retract":
            raise ApiError(400, "mode retract (requests back to the queue, their cache recomputed) is not supported: "
                                "use in_place (they keep their cache and go on after /continue_generation) or abort",
                           param="mode")
        await call(PauseGeneration, mode="keep" if mode == "in_place" else "abort", clear_cache=False)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(body: ContinueGenerationBody | None = None):
        await call(ResumeGeneration)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequestBody):
        """SGLang's: abort the request with this ``rid`` (its ``meta_info.id``, or the rid it was sent
        with; an OpenAI response's id), or all with ``abort_all``; neither (verl's default call) aborts
        nothing, as SGLang answers it."""
        if body.abort_all:
            await call(AbortRequests, request_ids=None, message=body.message)
            return Response(status_code=200)
        if not body.rid:
            return Response(status_code=200)
        choices = server.requests.get(body.rid)
        if choices is None:
            raise ApiError(404, f"no unfinished request with id {body.rid!r} (finished already, or never sent)",
                           param="rid", code="request_not_found")
        await call(AbortRequests, request_ids=[c.request_id for c in choices if c.output is None], message=body.message)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        done = await call(ResetPrefixCache)
        return PlainTextResponse("Cache flushed.\n" if done else "Cache not flushed: the engine did not reset its "
                                 "prefix cache (requests are running, or prefix caching is off).\n",
                                 status_code=200 if done else 400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupBody):
        await call(InitWeightsUpdateGroup, master_address=body.master_address, master_port=body.master_port,
                   rank_offset=body.rank_offset, world_size=body.world_size, group_name=body.group_name,
                   backend=body.backend)
        return {"success": True, "message": f"Succeeded to initialize the weights update group {body.group_name!r}."}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody):
        _check_lengths(body.names, body.dtypes, body.shapes, "dtypes")
        version = _weight_version(body.weight_version)
        done = await call(UpdateWeightsFromDistributed, names=body.names, dtypes=body.dtypes, shapes=body.shapes,
                          group_name=body.group_name, flush_cache=body.flush_cache, weight_version=version,
                          abort_all=body.abort_all_requests)
        return {"success": True, "message": f"Succeeded to update parameter online from distributed: "
                                            f"{done['num_tensors']} tensors, weight version {done['weight_version']}.",
                "weight_version": done["weight_version"]}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorBody):
        version = _weight_version(body.weight_version)
        done = await call(UpdateWeightsFromTensor, payloads=body.serialized_named_tensors, load_format=body.load_format,
                          flush_cache=body.flush_cache, weight_version=version, abort_all=body.abort_all_requests)
        return {"success": True, "message": f"Succeeded to update model weights from tensors: "
                                            f"{done['num_tensors']} tensors, weight version {done['weight_version']}.",
                "weight_version": done["weight_version"]}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupBody | None = None):
        group = body.group_name if body is not None else DEFAULT_GROUP
        await call(DestroyWeightsUpdateGroup, group_name=group)
        return {"success": True, "message": f"Succeeded to destroy the weights update group {group!r}."}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskBody):
        path = checkpoint_path(body.model_path, weights_root(server.config, server.model_path))
        done = await call(UpdateWeightsFromDisk, path=str(path), abort_all=body.abort_all_requests)
        return {"success": True, "message": f"Succeeded to update model weights: {done['num_tensors']} tensors, "
                                            f"weight version {done['weight_version']}.",
                "num_paused_requests": 0, "weight_version": done["weight_version"]}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(body: ReleaseMemoryBody | None = None):
        """SGLang's: release the KV cache and the weights (kept in host memory: vLLM's sleep level 1)."""
        tags = _tags(body.tags if body is not None else None)
        if tags is not None and set(tags) != set(WAKE_TAGS):
            raise ApiError(400, f"release tags {tags}: this engine releases the KV cache and the weights together "
                                f"(leave tags out, or give {list(WAKE_TAGS)}); /resume_memory_occupation can restore "
                                "them one at a time", param="tags")
        await call(Sleep, level=1, mode="abort")
        return JSONResponse(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(body: MemoryOccupationBody | None = None):
        await call(WakeUp, tags=_tags(body.tags if body is not None else None))
        return JSONResponse(None)

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": await call(GetWeightVersion)}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info():
        return {"model_path": server.model_name, "tokenizer_path": None, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": await call(GetWeightVersion)}
