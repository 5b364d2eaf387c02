"""Client of vLLM's KV-event replay socket (``ZmqEventPublisher`` with ``replay_endpoint``).

vLLM keeps the last ``buffer_steps`` (default 10,000) published batches and binds a ROUTER socket
at ``replay_endpoint`` (``vllm/distributed/kv_events.py``). Framing, from the client's DEALER side
(the ROUTER adds and strips the identity frame):

* request: ``[b"", start]`` — ``start`` is the first sequence number wanted, 8 bytes big-endian;
* replies: ``[b"", seq, payload]`` for every buffered batch with ``seq >= start``, oldest first
  (``payload`` is the same msgpack ``EventBatch`` the PUB socket sent; there is no topic frame);
* end: ``[b"", END_SEQ, b""]`` with ``END_SEQ`` = -1 as 8 signed big-endian bytes.

A request of another shape gets no reply (vLLM logs it and drops it), and an engine started
without ``replay_endpoint`` has no socket at all: both look like a timeout here. Each request uses
a fresh DEALER socket, closed afterwards, so a late answer to a timed-out request never reaches
the next one.
"""

from __future__ import annotations

import time

import zmq
import zmq.asyncio

from router.kv_index.events import KVEventDecodeError

#: vLLM's ``ZmqEventPublisher.END_SEQ``: the sequence frame of the end-of-replay reply.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: Seconds to wait for the whole replay (the end marker) before calling replay unavailable: a
#: replay of vLLM's full 10,000-batch buffer is a few MB on a local network, well under a second.
DEFAULT_REPLAY_TIMEOUT_S = 2.0


class ReplayUnavailable(RuntimeError):
    """No complete replay came back: no replay socket, no answer in time, or a malformed reply."""


def encode_request(start: int) -> list[bytes]:
    """The DEALER frames asking for every buffered batch from ``start`` on.

    Raises:
        ValueError: ``start`` is negative or does not fit 8 bytes.
    """
    if start < 0 or start >= 1 << 64:
        raise ValueError(f"replay start must be in [0, 2**64): {start}")
    return [b"", start.to_bytes(8, "big")]


def decode_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """One reply as the DEALER receives it → ``(seq, payload)``; None for the end marker.

    Raises:
        KVEventDecodeError: not ``[b"", seq(8 bytes), payload]``, or an end marker with a payload.
    """
    if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
        raise KVEventDecodeError(f"replay reply must be [b'', seq(8), payload], got {len(frames)} frames")
    if frames[1] == END_SEQ:
        if frames[2]:
            raise KVEventDecodeError("replay end marker with a payload")
        return None
    return int.from_bytes(frames[1], "big"), bytes(frames[2])


async def request_replay(context: zmq.asyncio.Context, address: str, start: int,
                         timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
                         max_batches: int = 1_000_000) -> list[tuple[int, bytes]]:
    """Ask the replay socket at ``address`` (``tcp://host:port``) for the batches from ``start``.

    Returns ``(seq, payload)`` in the order sent (vLLM: ascending), possibly empty (nothing at or
    after ``start`` is buffered). ``timeout_s`` bounds the whole exchange; ``max_batches`` the
    replies accepted (vLLM's buffer holds ``buffer_steps``).

    Raises:
        ReplayUnavailable: no end marker within ``timeout_s``, a malformed reply, more than
            ``max_batches`` replies, or a ZMQ error (bad address).
    """
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    deadline = time.monotonic() + timeout_s
    out: list[tuple[int, bytes]] = []
    try:
        sock.connect(address)
        await sock.send_multipart(encode_request(start))
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await sock.poll(max(1, int(left * 1000))):
                raise ReplayUnavailable(f"no complete replay from {address} within {timeout_s} s")
            reply = decode_reply(await sock.recv_multipart())
            if reply is None:
                return out
            out.append(reply)
            if len(out) > max_batches:
                raise ReplayUnavailable(f"replay from {address} sent more than {max_batches} batches")
    except KVEventDecodeError as exc:
        raise ReplayUnavailable(f"malformed replay from {address}: {exc}") from exc
    except zmq.ZMQError as exc:
        raise ReplayUnavailable(f"replay from {address} failed: {exc}") from exc
    finally:
        sock.close(linger=0)
