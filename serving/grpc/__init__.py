"""`trtbuild serve`: the trtbuild.v1.Generation gRPC service (server.py), its client (client.py) and proto/."""
