"""Wire formats: pure functions between bytes and InferRequest / InferResponse."""
