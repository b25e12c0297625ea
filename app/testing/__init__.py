"""Testing support that ships with the package: `fake_engine.FakeEngine`, an `EngineClient` that
behaves like the engine as its clients see it, without a model. The test suite and the UI
benchmark (`localbatch bench research ui_cost`) use it."""
