# The two commands of the README.
.PHONY: demo test lint

# Set up (idempotent) and run the main job on the embedded default configuration.
demo:
	scripts/setup.sh core
	.venv/bin/kvtier demo

# Set up everything the tests need (idempotent) and run the whole test suite.
test:
	scripts/setup.sh test
	.venv/bin/python -m pytest -q -p no:cacheprovider

lint:
	.venv/bin/ruff check kvtier policies connectors service bench tests
	.venv/bin/mypy
