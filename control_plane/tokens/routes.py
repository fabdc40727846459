"""Routes of viewer tokens (admin only, listing included)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response, status

from control_plane.auth import WriterDep
from control_plane.deps import DatabaseDep
from control_plane.schemas import ERRORS, NOT_FOUND
from control_plane.tokens import service
from control_plane.tokens.schemas import TokenCreated, TokenIn, TokenList

router = APIRouter(responses=ERRORS)


@router.post("/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
async def create_token(body: TokenIn, db: DatabaseDep, principal: WriterDep) -> TokenCreated:
    return await db.run(service.create_viewer_token, actor=principal.name, name=body.name)


@router.get("/tokens", response_model=TokenList)
async def list_tokens(db: DatabaseDep, _: WriterDep) -> TokenList:
    return await db.run(service.list_viewer_tokens)


@router.delete("/tokens/{token_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
async def revoke_token(
    token_id: Annotated[int, Path(ge=1, le=2**31 - 1)], db: DatabaseDep, principal: WriterDep
) -> Response:
    await db.run(service.revoke_viewer_token, actor=principal.name, token_id=token_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
