"""Routes of API keys: created and revoked by the admin, listed by any token."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Response, status

from control_plane.auth import ReaderDep, WriterDep
from control_plane.deps import DatabaseDep, KeyCreationsDep, SettingsDep
from control_plane.keys import service
from control_plane.keys.schemas import KeyCreated, KeyIn, KeyList
from control_plane.schemas import CONFLICT, ERRORS, NOT_FOUND, ErrorOut, UserPath
from output_rate_core.keys import KEY_ID_PATTERN

router = APIRouter(responses=ERRORS)

KeyIdPath = Annotated[str, Path(alias="id", pattern=KEY_ID_PATTERN)]
TOO_MANY: dict[int | str, dict[str, Any]] = {
    429: {"model": ErrorOut, "description": "Created too fast; see Retry-After"}
}


@router.post(
    "/users/{user}/keys",
    status_code=status.HTTP_201_CREATED,
    response_model=KeyCreated,
    responses={**CONFLICT, **TOO_MANY},
    summary="Create an API key for the user (the key is shown only in this response)",
)
async def create_key(
    user: UserPath,
    db: DatabaseDep,
    settings: SettingsDep,
    bucket: KeyCreationsDep,
    principal: WriterDep,
    _body: Annotated[KeyIn | None, Body()] = None,
) -> KeyCreated:
    change = await db.run(
        service.create_key,
        actor=principal.name,
        user=user,
        max_keys_per_user=settings.max_keys_per_user,
        bucket=bucket,
    )
    return change.result


@router.get("/users/{user}/keys", response_model=KeyList)
async def list_keys(user: UserPath, db: DatabaseDep, _: ReaderDep) -> KeyList:
    return await db.run(service.list_keys, user=user)


@router.delete("/keys/{id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
async def revoke_key(key_id: KeyIdPath, db: DatabaseDep, principal: WriterDep) -> Response:
    await db.run(service.revoke_key, actor=principal.name, key_id=key_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
