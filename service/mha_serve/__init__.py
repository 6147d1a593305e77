"""mha-serve: multi-head attention served over gRPC."""
