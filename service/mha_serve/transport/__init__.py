"""gRPC transport: the aio servicer, tensor wire format, server lifecycle and the mha-serve command."""
