"""The ``backfill`` command line.

Client commands (``submit``, ``batches``, ``files``, ``enqueue``, ``keys``) find the stack that
``backfill up`` runs on their ``--data-dir`` (default ``.data``) through its ``stack.json``.

Every service and tool is a subcommand. Each lives in its own package and is imported only when it
is run, so ``backfill --help`` stays fast and one broken optional dependency never breaks the rest:

    backfill up            whole stack on one machine (embedded Postgres/Redis unless URLs are set)
    backfill migrate       apply Alembic migrations
    backfill gateway       the Files + Batches API
    backfill worker        the Celery worker; ``backfill beat`` its scheduler
    backfill keys create   print a new API key for a tenant
    backfill submit FILE   upload a batch file, create a batch (``--wait``: follow it, download)
    backfill batches …     list, show, cancel, download batches; ``backfill files …`` the same for files
    backfill enqueue       put one request on a queue lane of the stack (``--wait``: print its result)
    backfill demo [FILE]   start the stack, run a batch file through it, stop
    backfill engine-sim    one simulated vLLM engine; ``backfill engine`` a real one
    backfill bench NAME    benchmarks (see docs/benchmarks.md)
"""

from __future__ import annotations

import importlib

import click

# name -> ("module:attribute" of a click command, one-line help); imported on first use.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("backfill.up:up_command", "Run the whole stack on this machine."),
    "migrate": ("backfill.commands:migrate_command", "Apply database migrations (Alembic)."),
    "gateway": ("backfill.commands:gateway_command", "Serve the Files + Batches API."),
    "worker": ("backfill.commands:worker_command", "Run a Celery worker of the batch lifecycle."),
    "beat": ("backfill.commands:beat_command", "Run the Celery beat scheduler."),
    "keys": ("backfill.commands:keys_group", "Manage tenants' API keys."),
    "tenants": ("backfill.commands:tenants_group", "List tenants (admin key); set their webhooks and quotas."),
    "submit": ("backfill.submit:submit_command", "Upload a batch file and create a batch."),
    "demo": ("backfill.submit:demo_command", "Start the stack, run an example batch, stop."),
    "batches": ("backfill.batches:batches_group", "List, show, cancel and download batches."),
    "files": ("backfill.batches:files_group", "List, show, download and delete files."),
    "bench": ("backfill.bench:bench_group", "Run a benchmark."),
    "simulate": ("lab.simulate.cli:simulate_command", "Run the whole fleet in virtual time (real scheduler)."),
    "router": ("router.cli:router_command", "Serve the router (flow control + prefix-aware scheduling)."),
    "engine-sim": ("engine_twin.cli:engine_sim_command", "Serve one simulated vLLM engine."),
    "engine": ("engine_twin.cli:engine_command", "Run a real vLLM engine for the fleet."),
    "processor": ("async_processor.cli:processor_command", "Pump queued requests to the router, publish results."),
    "enqueue": ("backfill.enqueue:enqueue_command", "Put one request on a queue lane (--wait: print its result)."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when invoked or listed in help."""

    def __init__(self, *args, lazy: dict[str, tuple[str, str]], **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Names of the eager and lazy subcommands, sorted."""
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The subcommand, importing its module on first use."""
        if cmd_name in self.lazy:
            module_name, attr = self.lazy[cmd_name][0].split(":")
            return getattr(importlib.import_module(module_name), attr)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List subcommands with their one-line help without importing them."""
        rows = [(name, self.lazy[name][1]) for name in self.list_commands(ctx) if name in self.lazy]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="backfill")
def main() -> None:
    """backfill: OpenAI batch jobs and queued LLM requests on the spare capacity of a vLLM fleet."""
