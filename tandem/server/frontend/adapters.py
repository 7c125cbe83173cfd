"""LoRA adapters as a front end sees them. The engine cores own the adapters; a front end keeps
only a cache of their names, and the cores are asked whenever it could be wrong:

- a request names a model the front end does not know: the cores are asked which adapters they
  hold (`resolve`), so an adapter loaded through another front end is found at once;
- a request names an adapter the front end knows but the cores no longer hold (unloaded through
  another front end): its core refuses it with a 404, and the cache is dropped (`forget`);
- /v1/models asks the cores every time.

With several cores (data parallelism) an adapter counts as loaded once every core holds it:
a load goes to every core, and if one refuses it, the others unload it again, so the cores never
disagree for longer than a load takes. A load runs on each core's loader thread, never on its
step loop (`core/lora.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

from tandem.server.core import wire
from tandem.server.core.client import CoreClient, CoreUnavailable
from tandem.server.frontend.errors import APIError, unavailable


def held_by_all(lists: list[list[wire.LoraCard]]) -> list[wire.LoraCard]:
    """The adapters every core holds, in the first core's order."""
    if not lists:
        return []
    others = [{card.name for card in cards} for cards in lists[1:]]
    return [card for card in lists[0] if all(card.name in names for names in others)]


class Adapters:
    def __init__(self, client: CoreClient, enabled: bool, timeout_s: float = 60.0):
        """`enabled`: the cores run with LoRA (`Ready.enable_lora`); `timeout_s`: the longest a
        core's answer to a list is waited for (it answers between two steps)."""
        self.client = client
        self.enabled = enabled
        self.timeout_s = timeout_s
        self._known: dict[str, wire.LoraCard] = {}  # replaced whole, never changed in place
        self.remember([ready.adapters for ready in client.readies])
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._waiting: set[concurrent.futures.Future] = set()  # intake workers' questions

    def start(self) -> None:
        """On the event loop."""
        self._aloop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def close(self) -> None:
        """Release the intake workers still waiting for an answer (the loop is stopping)."""
        for future in list(self._waiting):
            future.cancel()

    # ------------------------------------------------------------ names
    def known(self, name: str) -> wire.LoraCard | None:
        return self._known.get(name)

    def list_known(self) -> list[wire.LoraCard]:
        """The adapters as this front end last heard of them (no question asked)."""
        return list(self._known.values())

    def resolve(self, name: str) -> wire.LoraCard | None:
        """From an intake worker (never the event loop): the adapter `name`, asking the cores
        if this front end has not heard of it. None: not every core holds such an adapter."""
        card = self._known.get(name)
        if card is not None or not self.enabled or self._aloop is None:
            return card
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("Adapters.resolve waits for the event loop: await aresolve there")
        future = asyncio.run_coroutine_threadsafe(self.refresh(), self._aloop)
        self._waiting.add(future)
        try:
            future.result(self.timeout_s + 1)
        except concurrent.futures.CancelledError:
            raise unavailable("the server is shutting down") from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise self._no_answer() from None
        finally:
            self._waiting.discard(future)
        return self._known.get(name)

    async def aresolve(self, name: str) -> wire.LoraCard | None:
        """`resolve`, on the event loop."""
        card = self._known.get(name)
        if card is not None or not self.enabled:
            return card
        await self.refresh()
        return self._known.get(name)

    def forget(self) -> None:
        """A core refused an adapter this front end took as loaded: ask again next time."""
        self._known = {}

    def remember(self, lists: list[list[wire.LoraCard]]) -> list[wire.LoraCard]:
        cards = held_by_all(lists)
        self._known = {card.name: card for card in cards}
        return cards

    # ------------------------------------------------------- operations
    async def list(self) -> list[wire.LoraCard]:
        """The adapters every core holds now (none without LoRA)."""
        if not self.enabled:
            return []
        return await self.refresh()

    async def refresh(self) -> list[wire.LoraCard]:
        answers = await self._ask(wire.LoraList, timeout_s=self.timeout_s)
        return self.remember([answer.adapters for answer in answers])

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> None:
        """Load on every core, or on none: APIError 400 names a bad adapter (the first core's
        reason). Finishes (and rolls back) even if the caller stops waiting."""
        task = asyncio.ensure_future(self._load(name, path, base_model_name))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read if nobody waits
        await asyncio.shield(task)

    async def unload(self, name: str | None, int_id: int | None = None) -> None:
        """Unload from every core that holds it; APIError 404 if none does."""
        answers = await self._ask(lambda q: wire.LoraUnload(q, name, int_id))
        self.remember([answer.adapters for answer in answers])
        refusals = [answer for answer in answers if answer.error is not None]
        if len(refusals) == len(answers):
            first = refusals[0]
            raise APIError(first.status, first.error or "", param="lora_name", code="not_found")

    # ------------------------------------------------------------ internals
    async def _load(self, name: str, path: str, base_model_name: str | None) -> None:
        answers = await self._ask(lambda q: wire.LoraLoad(q, name, path, base_model_name))
        refusals = [answer for answer in answers if answer.error is not None]
        if refusals:
            loaded = [i for i, answer in enumerate(answers) if answer.error is None]
            if loaded:  # the others refused it: no core keeps it
                await self._ask(lambda q: wire.LoraUnload(q, name), loaded)
            self.forget()
            first = refusals[0]
            raise APIError(first.status, first.error or "", param="lora_path")
        self.remember([answer.adapters for answer in answers])

    async def _ask(
        self,
        make: Callable[[int], wire.LoraLoad | wire.LoraUnload | wire.LoraList],
        cores: list[int] | None = None,
        timeout_s: float | None = None,
    ) -> list[wire.LoraAnswer]:
        try:
            return await asyncio.wait_for(self.client.ask_lora(make, cores), timeout_s)
        except CoreUnavailable as exc:
            raise unavailable(f"the engine is not running: {exc}") from None
        except asyncio.TimeoutError:
            raise self._no_answer() from None

    def _no_answer(self) -> APIError:
        return unavailable(f"the engine cores did not say which LoRA adapters they hold within "
                           f"{self.timeout_s:g} s")  # fmt: skip
