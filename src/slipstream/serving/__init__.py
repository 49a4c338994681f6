"""The model-serving facade shared by the HTTP and gRPC front ends."""
