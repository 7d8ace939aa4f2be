"""``initialize`` as the resume tests send it: extra parameters (say
``resumeSessionId``) merged in, the whole response returned (a refusal is an
error response, not an exception), ``initialized`` sent only on success.
"""

from __future__ import annotations

from typing import Any

from tests.support.ws_harness import WsClientProtocol


async def initialize(client: WsClientProtocol, **params: Any) -> dict[str, Any]:
    response = await client.request("initialize", {"clientName": "resume-test", **params})
    if "result" in response:
        client.notify("initialized", {})
    return response
