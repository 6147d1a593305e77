"""The negative control of tests/reliability/test_memory.py: with MHA_TEST_LEAK_BYTES set,
a server started with this folder on PYTHONPATH keeps that many bytes per Attend forever
(an injected leak), so that the memory check can be seen to fail."""

import os

_LEAK_BYTES = int(os.environ.get("MHA_TEST_LEAK_BYTES", "0"))

if _LEAK_BYTES:
    from mha_serve.transport.servicer import AttentionServicer

    _kept: list[bytearray] = []
    _attend = AttentionServicer.Attend

    async def _leaky_attend(self, request, context):
        _kept.append(bytearray(os.urandom(16)) * (_LEAK_BYTES // 16))  # touched: resident
        return await _attend(self, request, context)

    AttentionServicer.Attend = _leaky_attend
