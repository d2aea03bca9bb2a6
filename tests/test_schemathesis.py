"""Property-based fuzzing of every operation in the app's own /openapi.json (schemathesis)."""
from collections import Counter

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode


def test_no_5xx_and_every_4xx_is_openai_shaped(serve_url):
    """...or Anthropic-shaped, under /v1/messages."""
    schema = schemathesis.openapi.from_url(f"{serve_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "GET /v1/models"} <= \
        {op.label for op in operations}
    statuses: dict[str, Counter] = {}

    def check(case) -> None:
        response = case.call(timeout=120)
        statuses.setdefault(case.operation.label, Counter())[response.status_code] += 1
        assert response.status_code < 500, (response.status_code, response.text[:500], case.as_curl_command())
        if 400 <= response.status_code < 500:
            body = response.json()
            if case.operation.path.startswith("/v1/messages"):
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
            else:
                assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body

    for op in operations:
        # parameterless GETs have no invalid form to generate: negative cases only where there is a body
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if op.method.upper() == "POST" else (GenerationMode.POSITIVE,)
        for mode in modes:
            @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(case=op.as_strategy(generation_mode=mode))
            def fuzz(case):
                check(case)
            fuzz()
    print({op: dict(c) for op, c in statuses.items()})
    total = sum(sum(c.values()) for c in statuses.values())
    assert total > 300, statuses  # many examples really went over HTTP
    for op in ("POST /v1/completions", "POST /v1/chat/completions"):  # both validation and routing errors seen
        assert statuses[op][400] > 0 and statuses[op][404] > 0, statuses[op]
