"""Examples where a worker is lost and the program goes on (asyncrpc.on_caller_lost,
asyncrpc.on_peer_lost)."""
