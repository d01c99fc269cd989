"""pytest set-up: the multi-rank grids learn which cells this session reads (see [Note: one
spawn per world size] in support/rank_grid.py)."""

from support import rank_grid


def pytest_collection_finish(session):
    rank_grid.set_session_items(session.items)


def pytest_sessionfinish(session, exitstatus):
    rank_grid.end_session()
