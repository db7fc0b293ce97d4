"""Client and AsyncClient behind one face, so one suite of tests runs against both."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

from cyclone import AsyncClient, Client


class Blocking:
    """An AsyncClient whose coroutine methods are called like Client's: each is awaited on
    the client's own event loop, which runs in a thread of its own (as an app's would), so its
    listener keeps running between calls."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.await_(attr(*args, **kwargs))

        return call

    def await_(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.await_(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    @property
    def watch(self) -> Any:
        return self.client._watcher.watch if self.client._watcher else None


class Sync:
    """A Client with the same extras as Blocking."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    @property
    def watch(self) -> Any:
        return self.client._watcher.watch if self.client._watcher else None


KINDS = ["sync", "async"]


def make(kind: str, factory: Callable[[type], Any]) -> Sync | Blocking:
    """`factory(Client or AsyncClient)` -> the client, behind the common face."""
    if kind == "sync":
        return Sync(factory(Client))
    return Blocking(factory(AsyncClient))
