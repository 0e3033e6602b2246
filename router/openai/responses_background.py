"""Background responses (``background: true``): the create call returns at
once with ``status: in_progress``; the router that accepted it generates, and
the client polls ``GET /v1/responses/{id}`` (any router) until a final status.

    in_progress --(done)--------------------------> completed | incomplete
                --(generation error)--------------> failed (error says why)
                --(POST .../cancel, any router)---> cancelled
                --(its router died: lease gone)---> failed, by whichever router reads it next

No response is left ``in_progress`` by a router that stops: the running router
renews a lease beside the record every ``RENEW_S`` (it lasts ``LEASE_S``).
A read that finds the record in progress without a lease marks it failed.
A cancel asked on another router sets a flag the running router sees at its
next renewal; on the running router it cancels the generation at once (the
replica aborts the sequence and frees its blocks).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from router.openai.response_store import StoreUnavailable
from router.openai.responses import close_stream

logger = logging.getLogger(__name__)

LEASE_S = 10.0
RENEW_S = 1.0
LEASE, CANCEL = "lease", "cancel"
ROUTER_GONE = {"code": "server_error",
               "message": "the router running this background response stopped before it finished: create it again"}


class BackgroundRuns:
    """The background responses this router runs, over a ``ResponsesAPI``
    (its store, collection, finishing and saving)."""

    def __init__(self, api: Any, lease_s: float = LEASE_S, renew_s: float = RENEW_S) -> None:
        self.api = api
        self.lease_s = lease_s
        self.renew_s = renew_s
        self.tasks: dict[str, asyncio.Task] = {}

    async def start(self, parsed: Any, stream: AsyncIterator, response: dict, context: tuple) -> dict:
        """Saves the response in progress, starts generating; returns what the create call answers."""
        owner = context[0]
        running = {**response, "status": "in_progress"}
        store = self.api.store
        try:
            await store.set_flag(owner, running["id"], LEASE, self.lease_s)
            await self.api._save(context, running)
        except BaseException:
            await close_stream(stream)
            raise
        self.tasks[running["id"]] = asyncio.ensure_future(self._run(parsed, stream, running, context))
        return running

    async def _run(self, parsed: Any, stream: AsyncIterator, response: dict, context: tuple) -> None:
        owner, response_id = context[0], response["id"]
        task = asyncio.current_task()
        renewer = asyncio.ensure_future(self._renew(owner, response_id, task))
        try:
            try:
                outcome = await self.api._collect(parsed, stream)
                final = self.api._finish(response, outcome)
            except asyncio.CancelledError:
                final = {**response, "status": "cancelled"}
            except Exception as exc:  # noqa: BLE001 - the response says it failed
                logger.warning("background response %s failed: %s", response_id, exc)
                err = self.api._api_error(exc)
                final = {**response, "status": "failed", "error": {"code": err.code or "server_error",
                                                                      "message": err.message}}
            renewer.cancel()
            await close_stream(stream)
            await self.api._save(context, final)
            await self.api.store.drop_flag(owner, response_id, LEASE)
        except (StoreUnavailable, ValueError) as exc:  # nothing to write the outcome to: the lease expires
            logger.warning("background response %s: its outcome was not stored: %s", response_id, exc)
        finally:
            renewer.cancel()
            self.tasks.pop(response_id, None)

    async def _renew(self, owner: str, response_id: str, task: asyncio.Task) -> None:
        store = self.api.store
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                await store.set_flag(owner, response_id, LEASE, self.lease_s)
                if await store.has_flag(owner, response_id, CANCEL):
                    task.cancel()
                    return
            except StoreUnavailable as exc:
                logger.info("background response %s: lease not renewed: %s", response_id, exc)

    async def settle(self, owner: str, record: dict) -> dict:
        """The record as it stands: one in progress whose router is gone becomes failed."""
        response = record["response"]
        if response.get("status") != "in_progress" or not response.get("background"):
            return record
        if response["id"] in self.tasks or await self.api.store.has_flag(owner, response["id"], LEASE):
            return record
        failed = {**record, "response": {**response, "status": "failed", "error": ROUTER_GONE}}
        await self.api.store.put(owner, response["id"], failed)
        return failed

    async def cancel(self, owner: str, record: dict, wait_s: float = 5.0) -> dict:
        """Cancels a background response in progress (here, or flags it for its router);
        returns the response as it then stands."""
        response = record["response"]
        if not response.get("background"):
            from router.openai.responses_input import bad_request

            raise bad_request("only background responses can be cancelled")
        response_id = response["id"]
        task = self.tasks.get(response_id)
        if response.get("status") != "in_progress":
            return response
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:
            await self.api.store.set_flag(owner, response_id, CANCEL, self.lease_s * 2)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            while loop.time() < deadline:
                await asyncio.sleep(0.1)
                current = await self.api.store.get(owner, response_id)
                if current is None or current["response"]["status"] != "in_progress":
                    break
        current = await self.api.store.get(owner, response_id)
        return (await self.settle(owner, current))["response"] if current is not None else response
