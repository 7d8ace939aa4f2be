"""A scripted stand-in for the OpenAI Responses API, enough to drive ``codex exec``.

usage: python -m tests.codex.fake_model LOG   (the spec is read from $FAKE_MODEL_SPEC)

The spec (JSON): ``{"cmd": str, "tty": bool, "stdin": str, "yield_ms": int,
"max_output_tokens": int, "then": [str]}``. Each ``POST /v1/responses`` is
answered as a server-sent event stream with one output item:

* no tool output in the request yet: a call of Codex's ``exec_command`` tool
  running ``cmd`` (with ``tty`` if asked);
* after the Nth tool output, while ``then`` has an Nth command: a call of
  ``exec_command`` running it (one command after another, each once the
  previous one's output came back);
* the last tool output says the command is still running ("session ID N"):
  a ``write_stdin`` of ``stdin`` to that session;
* otherwise: a final assistant message (the turn ends).

``GET .../models`` is an empty list; other paths are 404. Every request body
is appended to LOG, one JSON line each. Once it listens, the port (chosen
by the kernel) is printed as one line on stdout.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from twisted.internet import reactor
from twisted.web import resource, server
from twisted.web.server import Request

USAGE = {
    "input_tokens": 10,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 5,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 15,
}
_RUNNING = re.compile(r"session ID (\d+)")


class Model(resource.Resource):
    isLeaf = True

    def __init__(self, spec: dict[str, Any], log_path: str) -> None:
        super().__init__()
        self.spec = spec
        self.log_path = log_path
        self.count = 0

    def _log(self, entry: object) -> None:
        with open(self.log_path, "a") as log:
            log.write(json.dumps(entry) + "\n")

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        if request.path.endswith(b"/models"):
            return b'{"object": "list", "data": [], "models": []}'
        request.setResponseCode(404)
        return b'{"error": {"message": "not served by the fake model"}}'

    def render_POST(self, request: Request) -> bytes:
        assert request.content is not None
        body = json.loads(request.content.read() or b"{}")
        self._log({"path": request.path.decode(), "body": body})
        if not request.path.endswith(b"/responses"):
            return self.render_GET(request)
        self.count += 1
        item = self._reply(body)
        self._log({"reply": item})
        rid = f"resp_{self.count}"
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": {"id": rid}},
            {"type": "response.output_item.added", "output_index": 0, "item": item},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {
                "type": "response.completed",
                "response": {"id": rid, "status": "completed", "output": [item], "usage": USAGE},
            },
        ]
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)

    def _reply(self, body: dict[str, Any]) -> dict[str, Any]:
        n = self.count
        outputs = [
            i
            for i in body.get("input", [])
            if isinstance(i, dict) and i.get("type") == "function_call_output"
        ]
        if not outputs:
            args: dict[str, Any] = {
                "cmd": self.spec["cmd"],
                "yield_time_ms": self.spec.get("yield_ms", 10_000),
            }
            if "max_output_tokens" in self.spec:
                args["max_output_tokens"] = self.spec["max_output_tokens"]
            if self.spec.get("tty"):
                args["tty"] = True
            return _call(n, "exec_command", args)
        then = self.spec.get("then", [])
        if len(outputs) <= len(then):
            args = {
                "cmd": then[len(outputs) - 1],
                "yield_time_ms": self.spec.get("yield_ms", 10_000),
            }
            return _call(n, "exec_command", args)
        last = outputs[-1].get("output")
        text = last if isinstance(last, str) else json.dumps(last)
        running = _RUNNING.search(text)
        if running and "stdin" in self.spec and not self.spec.get("_wrote"):
            self.spec["_wrote"] = True
            args = {
                "session_id": int(running.group(1)),
                "chars": self.spec["stdin"],
                "yield_time_ms": 5_000,
            }
            return _call(n, "write_stdin", args)
        return {
            "type": "message",
            "id": f"msg_{n}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "done", "annotations": []}],
        }


def _call(n: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{n}",
        "call_id": f"call_{n}",
        "name": name,
        "arguments": json.dumps(args),
        "status": "completed",
    }


def main() -> None:
    spec = json.loads(os.environ["FAKE_MODEL_SPEC"])
    site = server.Site(Model(spec, sys.argv[1]))
    the_reactor: Any = reactor
    port = the_reactor.listenTCP(0, site, interface="127.0.0.1")
    print(port.getHost().port, flush=True)
    the_reactor.run()


if __name__ == "__main__":
    main()
