"""Build an Alembic ``Config`` for this project without an ini file."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config


def alembic_config(database_url: str) -> Config:
    """An Alembic config whose scripts are this package's revisions and whose URL is ``database_url``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    """Apply revisions up to ``revision`` (default: the newest)."""
    from alembic import command

    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    """Revert revisions down to ``revision`` (``base`` = empty schema)."""
    from alembic import command

    command.downgrade(alembic_config(database_url), revision)
