"""Loading and unloading LoRA adapters while serving: vLLM's ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter`` too).

Off unless the server runs with ``--allow-runtime-lora-updating``: a load names a folder on the server's
machine. A loaded adapter is a model name at once (``/v1/models``, a request's ``model``); an adapter is unloaded
only while no request uses it, and one loaded again under the same name never meets the cached KV of the one
it replaced (``LoRAAdapter.key``). Answers are vLLM's plain-text lines; errors have the OpenAI shape.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from radixserve.server.deps import StateDep, require_api_key
from radixserve.server.errors import APIError, from_engine_error
from radixserve.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["LoRA"])


class LoadLoRARequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1, description="The PEFT adapter's folder, on the server's machine.")


class UnloadLoRARequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(None, description="vLLM's; not needed here (adapters are known by name).")


def _engine(state: ServerState) -> Any:
    """The engine to change, once the server allows changing it."""
    if not state.config.allow_runtime_lora_updating:
        raise APIError(
            400,
            "loading and unloading LoRA adapters is off on this server: start it with --allow-runtime-lora-updating "
            "(or serve the adapters with --lora-modules)",
            code="lora_updating_disabled",
        )
    return state.ready_engine()


@router.post("/v1/load_lora_adapter", summary="Load a LoRA adapter (with --allow-runtime-lora-updating)")
@router.post("/load_lora_adapter", include_in_schema=False)
async def load_lora_adapter(body: LoadLoRARequest, state: StateDep) -> PlainTextResponse:
    engine, name = _engine(state), body.lora_name.strip()
    try:
        state.check_adapter_names((name,))
    except ValueError as exc:
        raise APIError(400, str(exc).removeprefix("--lora-modules: "), param="lora_name") from None
    if not name:
        raise APIError(400, "lora_name must name the adapter (it is blank)", param="lora_name")
    try:
        await asyncio.to_thread(engine.load_lora, name, body.lora_path.strip())
    except ValueError as exc:
        param = "lora_name" if "already loaded" in str(exc) else "lora_path"
        raise APIError(400, str(exc), param=param) from None
    except Exception as exc:  # noqa: BLE001 - the engine stopped, or timed out: its own status
        raise from_engine_error(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", summary="Unload a LoRA adapter (with --allow-runtime-lora-updating)")
@router.post("/unload_lora_adapter", include_in_schema=False)
async def unload_lora_adapter(body: UnloadLoRARequest, state: StateDep) -> PlainTextResponse:
    engine, name = _engine(state), body.lora_name.strip()
    try:
        await asyncio.to_thread(engine.unload_lora, name)
    except LookupError as exc:
        raise APIError(404, str(exc), param="lora_name", code="not_found") from None
    except ValueError as exc:
        raise APIError(409, str(exc), param="lora_name") from None
    except Exception as exc:  # noqa: BLE001 - the engine stopped, or timed out: its own status
        raise from_engine_error(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
