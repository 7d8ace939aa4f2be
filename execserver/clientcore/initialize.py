"""The ``initialize`` params every client sends, from its connection options."""

from __future__ import annotations


def initialize_params(
    client_name: str,
    *,
    session_ttl_ms: int | None = None,
    resume_session_id: str | None = None,
    on_detached_full: str | None = None,
) -> dict[str, object]:
    """Only what is asked for goes on the wire: a baseline client's
    ``initialize`` stays exactly ``{"clientName": ...}``.

    ``on_detached_full`` defaults to ``"pause"`` when ``session_ttl_ms`` asks
    for a resumable session: a session that outlives a drop never drops
    output the client has not read.
    """
    params: dict[str, object] = {"clientName": client_name}
    if session_ttl_ms is not None:
        params["sessionTtlMs"] = session_ttl_ms
    if resume_session_id is not None:
        params["resumeSessionId"] = resume_session_id
    if on_detached_full is None and session_ttl_ms:
        on_detached_full = "pause"
    if on_detached_full is not None:
        params["onDetachedFull"] = on_detached_full
    return params
