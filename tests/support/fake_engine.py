"""The test suite's fake engine lives in the package, `app.testing.fake_engine` (the UI benchmark
uses it too); the tests import it from here."""

from app.testing.fake_engine import (  # noqa: F401 - re-exported
    FAKE_FIM,
    FIM_TEXTS,
    FakeEngine,
    FakeTokenizer,
    ServerThread,
    Submitted,
    ToolTemplateEngine,
    check_constraints,
    constrained_reply,
    echo_reply,
    example_instance,
)
