"""mha-serve client: Python SDK (sync and async) and the mha-client CLI; needs only grpcio, protobuf and numpy."""
