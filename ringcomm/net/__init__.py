"""The network: the data plane's ZeroMQ transport, peer liveness, authentication, and the rendezvous server and client."""
