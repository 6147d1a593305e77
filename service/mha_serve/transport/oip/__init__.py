"""The Open Inference Protocol (KServe v2, `inference.GRPCInferenceService`) as a second front
door over the same AsyncEngine as mha.v1: Triton's and KServe's clients work unchanged."""

from mha_serve.transport.oip.servicer import (
    SERVICE,
    SERVICE_NAME,
    InferenceServicer,
    add_inference_service,
)

__all__ = ["SERVICE", "SERVICE_NAME", "InferenceServicer", "add_inference_service"]
