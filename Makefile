# The two commands of the README: `make serve` (the main job) and `make test`.
.PHONY: serve demo test lint

# Set up (idempotent) and run the main job: the cache daemon on the embedded default
# configuration (host tier + an nvme tier under ~/.local/share/kvtier, 127.0.0.1:8470).
# exec: the daemon replaces the recipe's shell, so Ctrl-C or a SIGTERM (make forwards it)
# reaches it directly; it shuts down cleanly and exits 0, and make reports no error.
serve:
	@scripts/setup.sh core
	@exec .venv/bin/kvtier serve

# Set up (idempotent) and replay real prompts through the default store, verifying bytes.
demo:
	@scripts/setup.sh core
	@exec .venv/bin/kvtier demo

# Set up everything the tests need (idempotent) and run the whole test suite.
test:
	scripts/setup.sh test
	.venv/bin/python -m pytest -q -p no:cacheprovider

lint:
	.venv/bin/ruff check kvtier policies connectors service bench tests
	.venv/bin/ruff format --check kvtier policies connectors service bench tests examples
	.venv/bin/mypy
