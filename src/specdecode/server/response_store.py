"""The Responses API's stored responses, in this process's memory: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns. Each is kept with the conversation it ends (as chat messages, its reply's
included), under the API key that made it (another key finds nothing), the most recently stored first to stay:
past `max_responses` or `max_bytes` of their JSON, the oldest go, and naming one then gets a 404 that says so."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import SpecDecodeError


class ResponseNotFound(SpecDecodeError):
    http_status = 404


@dataclass
class StoredResponse:
    body: dict
    conversation: list[dict]  # the chat messages it ends, its own reply last (no system message: instructions)
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = 1024, max_bytes: int = 256 << 20):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._kept: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # Ray Serve's ingress may answer from several threads

    def put(self, owner: str, body: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(body)) + len(json.dumps(conversation))
        with self._lock:
            self._drop((owner, body["id"]))
            self._kept[(owner, body["id"])] = StoredResponse(body, conversation, size)
            self._bytes += size
            while self._kept and (len(self._kept) > self.max_responses or self._bytes > self.max_bytes):
                self._drop(next(iter(self._kept)))

    def get(self, owner: str, response_id: str) -> StoredResponse:
        with self._lock:
            kept = self._kept.get((owner, response_id))
        if kept is None:
            raise ResponseNotFound(
                f"no response {response_id!r} is stored here: it was made with store=false, under another API key, "
                f"or it left this server's memory (it keeps the last {self.max_responses}); send the whole "
                "conversation as input instead"
            )
        return kept

    def delete(self, owner: str, response_id: str) -> None:
        self.get(owner, response_id)
        with self._lock:
            self._drop((owner, response_id))

    def _drop(self, key: tuple[str, str]) -> None:
        gone = self._kept.pop(key, None)
        if gone is not None:
            self._bytes -= gone.size
