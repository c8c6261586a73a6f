"""Schema fuzzing (issue 16): schemathesis builds /v1/chat/completions and /v1/completions
bodies from the app's own OpenAPI document (the pydantic request models), valid ones and ones
that break it on purpose, and sends them to a real server process. None may get a 5xx; every
refusal is OpenAI-shaped."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from served_helpers import ServerProcess, assert_error_shape, model_dir  # noqa: F401  (fixture)
from specdec.serve.app import ServeConfig, create_app

KEY = "sk-schema"
MAX_TOKENS = 4  # generated requests keep their fields; only the length is capped, to keep the run short
ROUTES = ("/v1/chat/completions", "/v1/completions")
SCHEMA = schemathesis.openapi.from_dict(create_app(ServeConfig()).openapi())
CASES = st.one_of([SCHEMA[route]["POST"].as_strategy(generation_mode=mode)
                   for route in ROUTES for mode in schemathesis.GenerationMode])


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    srv = ServerProcess(model_dir, "--api-key-env", "SPECDEC_SCHEMA_KEY", "--drafter", "ngram",
                        "--max-batch", "4", env={"SPECDEC_SCHEMA_KEY": KEY})
    yield srv
    srv.close()


def _capped(body):
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if value is None or (isinstance(value, int) and not isinstance(value, bool)
                                 and value > MAX_TOKENS):
                body[name] = MAX_TOKENS
    return body


def test_both_routes_and_both_modes_are_fuzzed():
    assert len(ROUTES) == 2 and {m.value for m in schemathesis.GenerationMode} >= {"positive", "negative"}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=CASES)
def test_generated_requests_never_get_a_5xx(server, case):
    case.body = _capped(case.body)
    response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert response.status_code < 500, (case.body, response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert_error_shape(response.json(), response.status_code)
