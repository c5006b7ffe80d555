"""``kvtier``: info, demo, serve, tenants, bench, calc. The composition root of kvtier.

The core (everything under ``kvtier/`` but this package) names none of the parts above
it; here they are put together: before any command runs, :func:`compose` adds
``kvtier.policies`` to the process (its names, and ``cost`` as the default placement),
and each command imports the wing it drives (the daemon, the benchmarks, the
calculator) when it runs, so ``kvtier --help`` stays fast and a missing optional
dependency only affects the command that needs it.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console

from kvtier.cli.console import print_error
from kvtier.errors import KVTierError

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig

app = typer.Typer(
    name="kvtier",
    help="Tiered KV-cache storage for LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: typer's rich help labels --help with a stray "<bool>".
    rich_markup_mode=None,
)
console = Console(stderr=True)

ConfigOpt = Annotated[
    Optional[Path],  # noqa: UP045 - typer needs Optional
    typer.Option("--config", "-c", help="TOML file layered over the embedded default."),
]
SetOpt = Annotated[
    Optional[list[str]],  # noqa: UP045
    typer.Option("--set", help="Override one setting: --set store.chunk_tokens=512 (repeatable)."),
]
DataDirOpt = Annotated[
    Optional[str],  # noqa: UP045 - str: a Path would turn "" (memory only) into "."
    typer.Option(
        "--data-dir",
        help="Where the persistent (nvme) tier and the key salt live; also KVTIER_DATA_DIR. "
        "Default ~/.local/share/kvtier; empty string: memory tiers only.",
    ),
]


def compose() -> None:
    """Put kvtier's parts together in this process: the policies beside the core."""
    from kvtier.policies import compose as compose_policies

    compose_policies()


@app.callback()
def _composed() -> None:
    compose()


def _data_dir_override(data_dir: str | None) -> list[str]:
    # --data-dir is service.data_dir, applied last (after KVTIER_DATA_DIR and the file).
    return [] if data_dir is None else [f"service.data_dir={data_dir}"]


def _setup_logging(cfg: KVTierConfig) -> None:
    from kvtier.cli.console import setup_logging

    setup_logging(cfg.log_level, cfg.log_format)


@app.command()
def info(
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the report as JSON.")
    ] = None,
    profile: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            help="Measure memory and disk bandwidth into a hardware TOML for kvtier calc."
        ),
    ] = None,
    disk_dir: Annotated[Path, typer.Option(help="Directory whose disk --profile measures.")] = Path(
        "."
    ),
) -> None:
    """Describe this machine: CUDA, NUMA nodes, CXL candidates, kvikio, disks."""
    from kvtier.cli.info import run_info

    run_info(json_out)
    if profile is not None:
        from kvtier.policies.measure import measure, to_toml

        profile.write_text(to_toml(measure(disk_dir)))
        console.print(
            f"hardware profile written to {profile} (use: kvtier calc --hardware {profile})"
        )


@app.command()
def demo(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    sequences: Annotated[int, typer.Option(help="Requests to replay from the trace.")] = 12,
    trace: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            help="Trace for context lengths and prefix reuse: mooncake-conversation (default), "
            "mooncake-synthetic, or a Mooncake-format .jsonl[.gz] file."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    data_dir: DataDirOpt = None,
) -> None:
    """Store and reload a long-context workload through the default store, verifying every byte."""
    from kvtier.cli.demo import run_demo
    from kvtier.config import load_config

    cfg = load_config(config, overrides=(*(set_ or ()), *_data_dir_override(data_dir)))
    _setup_logging(cfg)
    ok = run_demo(cfg, sequences=sequences, trace=trace, seed=seed)
    raise typer.Exit(0 if ok else 1)


@app.command()
def serve(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    host: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Address to bind (default 127.0.0.1; anything else needs tokens)."),
    ] = None,
    port: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="TCP port (default 8470)."),
    ] = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Run the cache daemon: the tiered store over REST (see docs/operations.md)."""
    from kvtier.config import load_config

    overrides = list(set_ or ())
    if host is not None:
        overrides.append(f"service.host={host}")
    if port is not None:
        overrides.append(f"service.port={port}")
    overrides += _data_dir_override(data_dir)
    cfg = load_config(config, overrides=tuple(overrides))
    _setup_logging(cfg)
    try:
        from kvtier.service.server import serve as run_server
    except ImportError as exc:
        print_error(
            console, f"the daemon needs the service extra: pip install 'kvtier[service]' ({exc})"
        )
        raise typer.Exit(2) from None
    run_server(cfg)


@app.command()
def tenants(
    url: Annotated[
        str, typer.Option(envvar="KVTIER_URL", help="The daemon's base URL.")
    ] = "http://127.0.0.1:8470",
    token: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            envvar="KVTIER_TOKEN",
            help="A tenant's bearer token, when the daemon has tokens (prefer the "
            "KVTIER_TOKEN variable: a command line is visible to other users).",
        ),
    ] = None,
    ca_file: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="PEM file of the CA that signed an https:// daemon's certificate."),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the figures as JSON instead of a table.")
    ] = False,
    timeout_s: Annotated[float, typer.Option(help="Seconds to wait for the daemon.")] = 10.0,
) -> None:
    """Print a running daemon's per-tenant, per-tier figures: hits, misses, bytes stored
    and read, evictions, quota use."""
    try:
        from kvtier.cli.tenants import run_tenants
    except ImportError as exc:
        print_error(
            console, f"this command needs the service extra: pip install 'kvtier[service]' ({exc})"
        )
        raise typer.Exit(2) from None
    raise typer.Exit(run_tenants(url, token, ca_file, as_json=json_out, timeout_s=timeout_s))


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def bench(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Benchmark: fragmentation, host, keys, ...")],
    json_out: Annotated[Path | None, typer.Option("--json", help="Write results as JSON.")] = None,
) -> None:
    """Run a benchmark from kvtier.bench; extra arguments go to the benchmark.

    ``kvtier bench NAME --help`` shows the benchmark's own options.
    """
    argv = list(ctx.args)
    if json_out is not None:
        argv += ["--json", str(json_out)]
    raise typer.Exit(run_bench(name, argv))


def run_bench(name: str, argv: list[str]) -> int:
    """Run benchmark ``name`` with its own arguments; its exit status (2: no such benchmark)."""
    from kvtier.bench import available

    module_name = name.replace("-", "_")
    if module_name not in available():
        print_error(console, f"no benchmark {name!r}; available: {', '.join(available())}")
        return 2
    module = importlib.import_module(f"kvtier.bench.{module_name}")
    status: int = module.main(argv)
    return status


def _register_calc() -> None:
    # The sub-app module imports only typer and rich; kvtier.policies loads per command.
    from kvtier.cli.calc import calc_app

    app.add_typer(calc_app, name="calc")


_register_calc()


def main() -> None:
    """Entry point: turn kvtier errors into one clear line and exit status 2."""
    argv = sys.argv[1:]
    try:
        compose()
        if len(argv) >= 2 and argv[0] == "bench" and not argv[1].startswith("-"):
            # A benchmark parses its own options, --help included (typer would answer
            # --help with this command's help instead).
            sys.exit(run_bench(argv[1], argv[2:]))
        app()
    except KVTierError as exc:
        print_error(console, str(exc))
        sys.exit(2)


if __name__ == "__main__":
    main()
