"""Ray is started with usage-stats reporting off everywhere raylens starts it: the README's
recipe, the demo script and the tests."""

from __future__ import annotations

import os
import re

from tests.helpers import REPO


def test_every_ray_start_in_the_readme_disables_usage_stats():
    starts = [line for line in (REPO / "README.md").read_text().splitlines() if re.search(r"\bray start --", line)]
    assert starts, "the README has no `ray start` recipe any more"
    missing = [line for line in starts if "--disable-usage-stats" not in line]
    assert not missing, f"`ray start` without --disable-usage-stats in the README: {missing}"


def test_the_demo_script_turns_usage_stats_off_before_starting_ray():
    script = (REPO / "scripts" / "demo.sh").read_text()
    export = script.find("export RAY_USAGE_STATS_ENABLED=0")
    first_ray = min(i for i in (script.find("pipelines.jobs.generate"), script.find("ray start")) if i >= 0)
    assert 0 <= export < first_ray, "scripts/demo.sh must export RAY_USAGE_STATS_ENABLED=0 before Ray starts"


def test_the_test_session_runs_with_usage_stats_off():
    # set by tests/conftest.py before any test imports ray; every head and job a test starts inherits it
    assert os.environ.get("RAY_USAGE_STATS_ENABLED") == "0"
