"""`serve`'s restart policy (shared.lifecycle.RestartTracker): exponential backoff, capped, started
over after a long enough life; start-up failures in a row stop the stack."""

from __future__ import annotations

from shared.config import RestartConfig
from shared.flags import parse_serve
from shared.lifecycle import RestartTracker

POLICY = RestartConfig(restart_backoff_s=1.0, restart_backoff_max_s=8.0, restart_reset_after_s=60.0,
                       max_start_failures=3)


def crash_loop(tracker: RestartTracker, uptimes: list[float], *, healthy: bool) -> list[float | None]:
    """The delays the tracker answers to deaths after ``uptimes`` seconds of life each."""
    now, delays = 0.0, []
    for uptime in uptimes:
        tracker.started(now)
        if healthy:
            tracker.healthy()
        now += uptime
        delay = tracker.exited(now)
        delays.append(delay)
        now += delay or 0.0
    return delays


def test_backoff_doubles_up_to_the_cap():
    assert crash_loop(RestartTracker(POLICY), [5.0] * 6, healthy=True) == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_backoff_starts_over_after_a_long_life():
    tracker = RestartTracker(POLICY)
    assert crash_loop(tracker, [5.0, 5.0, 5.0], healthy=True) == [1.0, 2.0, 4.0]
    # up 60 s (restart_reset_after_s): the next restart is quick again, then doubles again
    assert crash_loop(tracker, [60.0, 5.0], healthy=True) == [1.0, 2.0]
    assert crash_loop(tracker, [59.0], healthy=True) == [4.0]


def test_a_child_that_never_becomes_healthy_gives_up_at_the_third_failure():
    tracker = RestartTracker(POLICY)
    assert crash_loop(tracker, [0.5, 0.5, 0.5], healthy=False) == [1.0, 2.0, None]
    assert tracker.num_start_failures == 3


def test_becoming_healthy_clears_the_start_up_failures():
    tracker = RestartTracker(POLICY)
    assert crash_loop(tracker, [0.5, 0.5], healthy=False) == [1.0, 2.0]
    assert crash_loop(tracker, [5.0], healthy=True) == [4.0]  # healthy, then died: a crash, not a failed start
    assert tracker.num_start_failures == 0
    # two more failed starts are not three in a row
    assert crash_loop(tracker, [0.5, 0.5], healthy=False) == [8.0, 8.0]
    assert crash_loop(tracker, [0.5], healthy=False) == [None]


def test_a_long_life_without_health_is_still_a_failed_start():
    """Uptime alone proves nothing (a child may hang while loading): only health clears failures."""
    assert crash_loop(RestartTracker(POLICY), [120.0, 120.0, 120.0], healthy=False) == [1.0, 1.0, None]


def test_serve_flags_fill_the_policy():
    config = parse_serve(["--restart-backoff", "0.5", "--restart-backoff-max", "4", "--restart-reset-after", "30",
                          "--max-start-failures", "5"])
    assert config.restart == RestartConfig(restart_backoff_s=0.5, restart_backoff_max_s=4.0,
                                           restart_reset_after_s=30.0, max_start_failures=5)
    assert parse_serve([]).restart == RestartConfig(restart_backoff_s=1.0, restart_backoff_max_s=30.0,
                                                    restart_reset_after_s=60.0, max_start_failures=3)
