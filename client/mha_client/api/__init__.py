"""Generated gRPC stubs for mha.v1 (made by protos/generate.py; never edit)."""
