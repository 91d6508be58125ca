"""Unit: per-client metering of urgent reads (FairReads) with a recording pool."""

from k3d.reads.fair import FairReads
from k3d.reads.pool import Job


class Pool:
    """Records what would enter the real ReaderPool, in order."""

    def __init__(self):
        self.submitted = []

    def submit(self, jobs, urgent):
        assert urgent
        self.submitted.extend((j.load_id, j.part) for j in jobs)


def jobs(load_id, parts):
    return [Job(load_id, i, [], None, None) for i in range(parts)]


def test_big_fetch_is_metered_small_one_goes_first():
    pool = Pool()
    f = FairReads(pool, fair_jobs=2)
    f.submit(jobs(1, 3) + jobs(2, 3), owner=10)          # a big cold fetch
    assert pool.submitted == [(1, 0), (1, 1)] and f.held_back() == 4
    f.submit(jobs(3, 1), owner=20)                        # another client's small miss
    assert pool.submitted[-1] == (3, 0)
    f.part_done(1, 0)
    assert pool.submitted[-1] == (1, 2) and f.held_back() == 3


def test_work_conserving_and_drains():
    pool = Pool()
    f = FairReads(pool, fair_jobs=2)
    f.submit(jobs(1, 4), owner=10)
    for i in range(4):
        f.part_done(1, i)
    assert len(pool.submitted) == 4 and f.held_back() == 0
    assert f.backlog == {} and f.in_pool == {} and f.owner == {}


def test_waiting_client_releases_held_back_read():
    pool = Pool()
    f = FairReads(pool, fair_jobs=1)
    f.submit(jobs(1, 1) + jobs(2, 2), owner=10)
    assert pool.submitted == [(1, 0)]
    f.waited_on(2, client=20)                             # another client needs slot 2 now
    assert pool.submitted[1:] == [(2, 0), (2, 1)] and f.held_back() == 0
    f.waited_on(1, client=10)                             # its own read: nothing changes
    assert len(pool.submitted) == 3


def test_release_all_for_shutdown_and_dead_owner():
    pool = Pool()
    f = FairReads(pool, fair_jobs=1)
    f.submit(jobs(1, 3), owner=10)
    f.submit(jobs(2, 3), owner=20)
    f.release(10)
    assert f.held_back() == 2
    f.release_all()
    assert f.held_back() == 0 and len(pool.submitted) == 6


class BothPool(Pool):
    def submit(self, jobs, urgent):
        self.submitted.extend((j.load_id, j.part, urgent) for j in jobs)


def test_dead_owners_backlog_goes_unmetered_to_the_background():
    pool = BothPool()
    f = FairReads(pool, fair_jobs=1)
    f.submit(jobs(1, 3), owner=10)
    moved = f.release(10, urgent=False)
    assert [(j.load_id, j.part) for j in moved] == [(1, 1), (1, 2)]
    assert pool.submitted == [(1, 0, True), (1, 1, False), (1, 2, False)]
    for part in range(3):
        f.part_done(1, part)
    assert f.owner == {} and f.in_pool == {} and f.backlog == {}


def test_promoted_parts_are_metered_per_part():
    """A predicted load with one part already running (unmetered) and two taken back from
    the background queue for a waiting client: only those two count against its share."""
    pool = BothPool()
    f = FairReads(pool, fair_jobs=1)
    taken = jobs(5, 3)[1:]                     # parts 1 and 2; part 0 runs unmetered
    f.submit(taken, owner=20)
    assert pool.submitted == [(5, 1, True)] and f.held_back() == 1
    f.part_done(5, 0)                          # the unmetered part: no share freed
    assert f.held_back() == 1 and f.in_pool == {20: 1}
    f.part_done(5, 1)
    assert pool.submitted[-1] == (5, 2, True)
    f.part_done(5, 2)
    assert f.owner == {} and f.in_pool == {} and f.backlog == {}
