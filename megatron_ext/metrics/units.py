"""How the console writes a duration: the run log's time left and the planner's run and checkpoint times (no torch
here: the planner's command imports it)."""

from __future__ import annotations


def format_duration(seconds: float) -> str:
    """A time left, to the two largest units that matter: '2 d 3 h', '3 h 12 min', '4 min 10 s', '12 s'."""
    seconds = max(0, round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{secs} s"
