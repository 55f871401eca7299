"""The warm tier's socket lines (issue 23): one JSON object per line, bounded, versioned."""
from __future__ import annotations

import json
from dataclasses import dataclass

from vramshare.contract._json import ContractError

# -- the warm tier's fast channel (issue 23) --------------------------------------------------------------
#: A unix stream socket the node agent listens on in each container's quota directory (the container sees
#: it at ``/var/run/vramshare/warm.sock``: connecting to a socket works on the read-only mount). One JSON
#: object per line, at most :data:`WARM_MAX_LINE` bytes, ``"v": 1``. The engine (vLLM plugin) connects and
#: says ``hello``; the agent answers ``sleep`` when the quota loop found the tenant idle; a first request
#: makes the engine send ``wake`` and wait for ``grant`` before it takes its memory back.
WARM_SOCKET_NAME = "warm.sock"
WARM_VERSION = 1
WARM_MAX_LINE = 1024
#: engine -> agent
WARM_HELLO = "hello"  # engine, canSleep, weightsBytes (what a wake brings back), state (awake | sleeping |
#                      waking: an engine reconnecting to a restarted agent), model (<name>[@<revision>], what
#                      the node reports as resident), reason when it cannot sleep
WARM_SLEPT = "slept"  # seq (of the sleep it answers), freedBytes
WARM_WAKE = "wake"  # seq (the engine's own, increasing), needBytes: a request arrived while asleep
WARM_AWAKE = "awake"  # seq (of the wake), seconds (wake latency, request arrival to serving)
WARM_REFUSED = "refused"  # seq (of the sleep), reason (busy, not supported, failed)
#: agent -> engine
WARM_SLEEP = "sleep"  # seq (the agent's, increasing), level (1)
WARM_GRANT = "grant"  # seq (of the wake), bytes: the memory is free (measured) and the quota restored
WARM_PREWAKE = "prewake"  # seq (the agent's, increasing), bytes: wake ahead of a forecast request (additive
#                          in v1): the quota is restored out of memory measured free beyond the wake reserve.
#                          An idle sleeping engine wakes and answers ``awake`` with this seq; a busy or waking
#                          one ignores it; an engine that does not know it drops it and logs; no answer in
#                          time is a decline
WARM_OPS = (WARM_HELLO, WARM_SLEPT, WARM_WAKE, WARM_AWAKE, WARM_REFUSED, WARM_SLEEP, WARM_GRANT, WARM_PREWAKE)
_WARM_FIELDS: dict[str, type | tuple[type, ...]] = {
    "engine": str, "seq": int, "level": int, "canSleep": bool, "weightsBytes": int, "freedBytes": int,
    "needBytes": int, "bytes": int, "seconds": (int, float), "reason": str, "state": str, "model": str}


class WarmMessageError(ContractError):
    """A line on the warm channel that is not a message of this version; the reader drops it and logs."""


@dataclass(frozen=True)
class WarmMessage:
    op: str
    fields: tuple[tuple[str, object], ...] = ()

    def get(self, key: str, default: object = None) -> object:
        return dict(self.fields).get(key, default)

    @classmethod
    def of(cls, op: str, **fields: object) -> "WarmMessage":
        return cls(op, tuple(sorted((k, v) for k, v in fields.items() if v is not None)))


def encode_warm(msg: WarmMessage) -> bytes:
    """One line (``\n`` ended); raises :class:`WarmMessageError` for what :func:`decode_warm` refuses."""
    line = json.dumps({"v": WARM_VERSION, "op": msg.op, **dict(msg.fields)}, separators=(",", ":"))
    decode_warm(line)  # one definition of what is valid
    return (line + "\n").encode()


def decode_warm(line: str | bytes) -> WarmMessage:
    """A message from one line; unknown fields are ignored (additive within v1), bad ones refused."""
    if len(line) > WARM_MAX_LINE:
        raise WarmMessageError(f"warm message longer than {WARM_MAX_LINE} bytes")
    try:
        doc = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WarmMessageError(f"warm message is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != WARM_VERSION:
        raise WarmMessageError(f"warm message: want an object with \"v\": {WARM_VERSION}")
    op = doc.get("op")
    if op not in WARM_OPS:
        raise WarmMessageError(f"warm message: unknown op {op!r}")
    fields = {}
    for key, kind in _WARM_FIELDS.items():
        if key not in doc:
            continue
        value = doc[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise WarmMessageError(f"warm message {op}: {key} has the wrong type ({value!r})")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value <= 1 << 53:
            raise WarmMessageError(f"warm message {op}: {key} out of range ({value!r})")
        fields[key] = value
    return WarmMessage.of(op, **fields)


