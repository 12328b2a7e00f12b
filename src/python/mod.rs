//! PyO3 bindings (only with the `python` feature).
