"""``python -m engine_twin engine-sim …``: the same commands as ``backfill engine-sim`` / ``engine``
without the ``backfill`` script on the path."""

import click

from engine_twin.cli import engine_command, engine_sim_command

main = click.Group(commands={"engine-sim": engine_sim_command, "engine": engine_command})

if __name__ == "__main__":
    main()
