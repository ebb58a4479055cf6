"""splitserve: disaggregated LLM serving over gRPC."""

__version__ = "0.1.0"
