"""The engine process's end of the link (serving/host.py) in the small: how a connection's
replies leave (the rest, over a real socket against the real engine: test_remote.py)."""

from __future__ import annotations

import asyncio

from mha_serve.serving.host import _Outbox


class _Writer:
    def __init__(self) -> None:
        self.written: list[list[bytes]] = []
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def writelines(self, parts: list[bytes]) -> None:
        self.written.append(list(parts))


def test_a_turns_first_reply_leaves_at_once_the_rest_together_in_order():
    async def main() -> None:
        writer = _Writer()
        box = _Outbox(writer)
        assert box.put([b"a1", b"a2"]) and writer.written == [[b"a1", b"a2"]]
        assert box.put([b"b"]) and box.put([b"c"])
        assert writer.written == [[b"a1", b"a2"]]  # until the turn ends
        await asyncio.sleep(0)
        assert writer.written == [[b"a1", b"a2"], [b"b", b"c"]]
        assert box.put([b"d"]) and writer.written[-1] == [b"d"]  # a new turn: at once
        box.put([b"e"])
        box.flush()  # the connection ending: what was answered still leaves
        assert writer.written[-1] == [b"e"]
        writer.closing = True
        assert not box.put([b"f"])  # the caller cleans its shared memory
        await asyncio.sleep(0)
        assert writer.written[-1] == [b"e"]

    asyncio.run(main())
