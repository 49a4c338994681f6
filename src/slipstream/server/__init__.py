"""Network front ends: the HTTP and gRPC servers in front of the serving core."""
