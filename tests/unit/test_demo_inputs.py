"""The README's first command runs scripts/demo.sh: its prompts file must pass the job's own
checks and every mod file it names must exist, or the demo breaks on a fresh clone."""

from __future__ import annotations

import re

from pipelines.jobs.generate import read_prompts
from tests.helpers import REPO


def test_the_demo_prompts_pass_the_jobs_checks_and_name_existing_mods():
    lines = read_prompts(REPO / "scripts" / "demo-prompts.jsonl")  # raises on a bad line or a missing mod file
    assert len(lines) >= 3
    mods = [mod for line in lines for mod in line.request.mods]
    assert mods and all(mod["source"] and mod["entrypoint"] for mod in mods)  # read into payloads for the job


def test_the_demo_script_names_existing_files_and_the_readme_runs_it():
    script = (REPO / "scripts" / "demo.sh").read_text()
    for path in re.findall(r"(?:tests|scripts)/[\w/.-]+\.(?:py|jsonl)", script):
        assert (REPO / path).is_file(), path
    assert "./scripts/setup.sh && ./scripts/demo.sh" in (REPO / "README.md").read_text()
