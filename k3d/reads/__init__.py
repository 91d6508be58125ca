"""Reads: getting expert bytes from the source into slot memory.

- ``loads``: the one ``Load`` type (an explicit token per read) and the books of
  reads in flight; the server's only door to this package;
- ``pool``: the reader threads and their urgent/background queues;
- ``fair``: each client's fair share of the readers for urgent reads;
- ``plan``: how a batch of experts is cut into parts;
- ``inline``: small experts already in the page cache, copied on the server
  thread as their reads start (no Load, no hand-over; ``Loads.take_inline``).

Thread: the server thread drives all of it; reader threads only run
``source.read`` into slot memory and report through the pool's queue + eventfd.
"""
