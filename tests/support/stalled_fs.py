"""An asynchronous fsspec filesystem that never answers (``stalled://``): a store that stopped answering, without a server.

Every call waits on fsspec's event loop until it is cancelled; ``StalledFileSystem.started`` and ``.cancelled`` count
the calls that began and those that were cancelled there. :func:`register` makes the scheme known to fsspec (by the
class's import path, as fsspec's own schemes are, so fabric's URL rule accepts it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fsspec.asyn import AsyncFileSystem

PROTOCOL = "stalled"


class StalledFileSystem(AsyncFileSystem):
    protocol = (PROTOCOL,)
    started = 0
    cancelled = 0

    async def _stall(self) -> Any:
        type(self).started += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            type(self).cancelled += 1
            raise

    async def _cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        return await self._stall()

    async def _pipe_file(self, path: str, value: Any, **kwargs: Any) -> Any:
        return await self._stall()

    async def _info(self, path: str, **kwargs: Any) -> Any:
        return await self._stall()

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return await self._stall()

    async def _rm_file(self, path: str, **kwargs: Any) -> Any:
        return await self._stall()


def register() -> None:
    import fsspec

    fsspec.register_implementation(PROTOCOL, f"{__name__}.StalledFileSystem", clobber=True)
    StalledFileSystem.clear_instance_cache()
