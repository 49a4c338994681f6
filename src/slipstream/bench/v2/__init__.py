"""V2 mode of ``slipstream bench`` (Open Inference Protocol over HTTP, HTTP-binary and gRPC):
worker processes send pre-encoded requests and report stable measurement windows."""
