"""``GET /v1/models`` and ``GET /v1/models/{model}``: the one model this server serves, under each of its names."""

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
        "max_model_len": engine.max_context_len if engine is not None else None,
    }


@router.get("/v1/models", summary="List the served model")
async def list_models(state: StateDep) -> dict[str, Any]:
    return {"object": "list", "data": [_card(state, name) for name in state.served_names]}


@router.get("/v1/models/{model:path}", summary="Describe the served model")
async def get_model(model: str, state: StateDep) -> dict[str, Any]:
    state.check_model(model)
    return _card(state, model if model in state.served_names else state.served_name)
