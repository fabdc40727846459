"""Request-scoped dependencies.

The request owns its transaction: a route makes one `await db.read(...)` or
`await db.write(...)` call, which commits once (writes) when the service returns and
rolls back if it raises; a write is acknowledged only after its commit.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from control_plane.db import Database


async def get_database(request: Request) -> Database:
    # async: FastAPI would run a plain function in a worker thread.
    database: Database = request.app.state.db
    return database


DatabaseDep = Annotated[Database, Depends(get_database)]
