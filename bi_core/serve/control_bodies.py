"""The request bodies of the RL control routes (``control_routes.py``): vLLM's and SGLang's fields, each
refused with a reason when it asks for what this engine does not do (a no-op value is taken)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from bi_core.serve.openai_protocol import STRICT

WAKE_TAGS = ("weights", "kv_cache")  # vLLM's wake_up tags; SGLang's memory-occupation tags, as far as they go
DEFAULT_GROUP = "weight_update_group"


# ---------------------------------------------------------------------------------- request bodies


class AbortRequestsBody(BaseModel):
    """vLLM's ``/abort_requests``."""

    model_config = STRICT
    request_ids: list[str] | None = None


class AbortRequestBody(BaseModel):
    """SGLang's ``AbortReq``, as verl's adapter sends it (``{"rid": "", "abort_all": false}`` by
    default: nothing to abort, as SGLang answers it). ``abort_message`` (SGLang's older name) or
    ``aborted_message`` (its newer one) becomes the aborted requests' finish reason message
    (``/generate``: ``{"type": "abort", "message": ...}``). ``finished_reason`` is what SGLang's
    scheduler fills in for its own aborts: only null is taken."""

    model_config = STRICT
    rid: str | None = ""
    abort_all: bool = False
    abort_message: str | None = None
    aborted_message: str | None = None
    finished_reason: dict | None = None

    _no_reason = field_validator("finished_reason")(lambda cls, v: _only_none(
        v, "finished_reason is filled in by SGLang's scheduler; an aborted request here finishes with type abort "
           "(give its message as abort_message)"))

    @property
    def message(self) -> str | None:
        return self.abort_message if self.abort_message is not None else self.aborted_message


class PauseGenerationBody(BaseModel):
    """SGLang's ``PauseGenerationReqInput``: in_place keeps the requests (vLLM's keep)."""

    model_config = STRICT
    mode: Literal["abort", "in_place", "retract"] = "abort"


class ContinueGenerationBody(BaseModel):
    model_config = STRICT


class MemoryOccupationBody(BaseModel):
    """SGLang's ``Release/ResumeMemoryOccupationReqInput``."""

    model_config = STRICT
    tags: list[str] | None = None


class ReleaseMemoryBody(MemoryOccupationBody):
    """``/release_memory_occupation``, with the ``reset_connector`` flag RL frameworks pass along
    (vLLM's meaning: also drop the cache of its KV connector, an external KV store). This engine
    has no KV connector, so there is nothing of it to drop: either value does the same."""

    reset_connector: bool = False


class InitWeightsUpdateGroupBody(BaseModel):
    """SGLang's ``InitWeightsUpdateGroupReqInput``. ``backend`` null lets the engine choose (NCCL on
    GPUs, gloo on CPUs); SGLang's default is nccl."""

    model_config = STRICT
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=2)
    group_name: str = DEFAULT_GROUP
    backend: Literal["nccl", "gloo"] | None = None


class UpdateWeightsFromDistributedBody(BaseModel):
    """SGLang's ``UpdateWeightsFromDistributedReqInput`` (``weight_version`` an integer here: the
    engine numbers its versions; a string of digits is read as one)."""

    model_config = STRICT
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: int | str | None = None
    load_format: str | None = None

    _no_load_format = field_validator("load_format")(lambda cls, v: _only_none(v, "load formats are not supported"))


class UpdateWeightsFromTensorBody(BaseModel):
    """SGLang's ``UpdateWeightsFromTensorReqInput``: one payload per tensor-parallel rank, or one
    for all (``bi_core.rl.serialize_named_tensors``; base64 text, as over JSON). ``load_format``:
    None or "direct" (the engine refuses others by name); the draft model is the MTP head, updated
    with the rest, and the allocator's cache is left alone, so those two flags take no-op values only."""

    model_config = STRICT
    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: int | str | None = None
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False

    _draft = field_validator("disable_draft_model")(
        lambda cls, v: v if not v else _only_none(v, "the MTP head is updated with the model's weights"))
    _empty = field_validator("torch_empty_cache")(
        lambda cls, v: v if not v else _only_none(v, "the engine does not empty the allocator's cache on updates"))


class DestroyWeightsUpdateGroupBody(BaseModel):
    model_config = STRICT
    group_name: str = DEFAULT_GROUP


class UpdateWeightsFromDiskBody(BaseModel):
    """SGLang's ``UpdateWeightFromDiskReqInput``: the engine numbers the new weights itself (its
    version + 1), so ``weight_version`` is refused; the prefix cache is always dropped."""

    model_config = STRICT
    model_path: str = Field(min_length=1)  # "" would name the server's working directory
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: int | str | None = None
    flush_cache: bool = True

    _no_load_format = field_validator("load_format")(lambda cls, v: _only_none(v, "load formats are not supported"))
    _no_version = field_validator("weight_version")(lambda cls, v: _only_none(
        v, "the engine numbers the weights of a disk update itself (its version + 1)"))

    @field_validator("flush_cache")
    @classmethod
    def _always_flush(cls, v: bool) -> bool:
        if not v:
            raise ValueError("a weight update always drops the prefix cache (its entries were computed with the old "
                             "weights)")
        return v


class NcclInitInfo(BaseModel):
    """vLLM's ``NCCLWeightTransferInitInfo``."""

    model_config = STRICT
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=2)


class InitWeightTransferBody(BaseModel):
    model_config = STRICT
    init_info: NcclInitInfo


class NcclUpdateInfo(BaseModel):
    """vLLM's ``NCCLWeightTransferUpdateInfo``. The tensors come packed in buckets, as
    ``bi_core.rl.WeightSender`` sends them; one broadcast per tensor (``packed: false``) is not read."""

    model_config = STRICT
    names: list[str] = Field(min_length=1)
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = True

    @field_validator("packed")
    @classmethod
    def _packed(cls, v: bool) -> bool:
        if not v:
            raise ValueError("the trainer must send packed buckets (bi_core.rl.WeightSender); one broadcast per "
                             "tensor is not read")
        return v


class UpdateWeightsBody(BaseModel):
    model_config = STRICT
    update_info: NcclUpdateInfo


REQUEST_MODELS = {
    "/abort_requests": AbortRequestsBody, "/abort_request": AbortRequestBody, "/pause_generation": PauseGenerationBody,
    "/continue_generation": ContinueGenerationBody, "/release_memory_occupation": ReleaseMemoryBody,
    "/resume_memory_occupation": MemoryOccupationBody, "/init_weights_update_group": InitWeightsUpdateGroupBody,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedBody,
    "/update_weights_from_tensor": UpdateWeightsFromTensorBody,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupBody,
    "/update_weights_from_disk": UpdateWeightsFromDiskBody, "/init_weight_transfer_engine": InitWeightTransferBody,
    "/update_weights": UpdateWeightsBody,
}
# SGLang answers these {"success": bool, "message": str}, failures included
SUCCESS_STYLE = frozenset({"/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor",
                           "/destroy_weights_update_group", "/update_weights_from_disk"})


def _only_none(v, why: str):
    if v is not None:
        raise ValueError(f"{why}; leave it out (null)")
    return v
