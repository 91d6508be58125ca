"""The cache: which expert sits in which slot (``store``), which to evict
(``policy/``), the fetch service the loop calls for every op (``fetch``), the
clients' sessions and pins, fetches parked on reads, and warm restart."""
