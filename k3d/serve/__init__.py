"""The request loop: the ROUTER socket, the wire format, who may connect, the order
requests are served in (turns, pacing), and the arena handout.  ``loop.Server`` owns
the socket and calls into the cache for every op."""
