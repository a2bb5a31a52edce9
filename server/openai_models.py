"""``GET /v1/models`` and ``GET /v1/models/{model}``: the model this server serves, under each of its names, and
each LoRA adapter it serves (``--lora-modules``) as a model whose ``parent`` is the base model, as vLLM lists them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from radixserve.server.deps import StateDep, require_api_key
from radixserve.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["OpenAI"])


def _card(state: ServerState, name: str) -> dict[str, Any]:
    engine = state.engine
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "radixserve",
        "root": state.model_spec,
        "parent": None,
        "max_model_len": engine.max_context_len if engine is not None else None,
    }


def _adapter_card(state: ServerState, name: str) -> dict[str, Any]:
    return {**_card(state, name), "root": name, "parent": state.served_name}


@router.get("/v1/models", summary="List the served model and its LoRA adapters")
async def list_models(state: StateDep) -> dict[str, Any]:
    cards = [_card(state, name) for name in state.served_names]
    return {"object": "list", "data": cards + [_adapter_card(state, name) for name in state.lora_names]}


@router.get("/v1/models/{model:path}", summary="Describe the served model or one of its LoRA adapters")
async def get_model(model: str, state: StateDep) -> dict[str, Any]:
    if state.check_model(model) is not None:
        return _adapter_card(state, model)
    return _card(state, model if model in state.served_names else state.served_name)
