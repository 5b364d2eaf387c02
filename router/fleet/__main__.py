"""``python -m router.fleet engine-sim …``: the same commands as ``backfill engine-sim`` / ``engine``
without the ``backfill`` script on the path."""

import click

from router.fleet.bench import bench_engine_sim_command
from router.fleet.cli import engine_command, engine_sim_command

main = click.Group(commands={"engine-sim": engine_sim_command, "engine": engine_command,
                             "bench-engine-sim": bench_engine_sim_command})

if __name__ == "__main__":
    main()
