"""Generated gRPC stubs for the Open Inference Protocol, package `inference` (made by
protos/generate.py; never edit). Triton's and KServe's clients carry their own copies of
these messages: importing both into one process would register `inference.*` twice."""
