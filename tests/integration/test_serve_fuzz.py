"""Schema fuzzing of the REST routes against the app's own OpenAPI document (bounded).

Generated requests (valid and invalid) must never produce a server error, and every answer must
match the documented schema. The server's token limit is tiny so fuzzed generations stay short.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 6  # per operation: a few requests each, enough to cross every validator once


@pytest.fixture(scope="module")
def fuzz_schema(engine):
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    settings_ = ServeSettings(max_new_tokens=2, request_timeout_s=60, max_message_bytes=256 * 1024)
    with serve_in_thread(build_app(engine, settings_)) as url:
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


def test_rest_routes_never_fail_with_a_server_error(fuzz_schema):
    from hypothesis import given

    operations = [result.ok() for result in fuzz_schema.get_all_operations()]
    assert len(operations) >= 7, [op.label for op in operations]  # both APIs' REST routes are in the document
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=120)

        fuzz()
