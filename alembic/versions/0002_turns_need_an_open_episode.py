"""turns need an open episode: enforced by a trigger on insert

A turn may only join an episode that is still pending or running. The database checks
it as each row goes in (under a share lock on the episode row on PostgreSQL, so a racing
completion either sees the new turn or makes the insert fail), which lets a batch of
turns be written with one autocommitted INSERT instead of a transaction with a check.

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MESSAGE = "episode is finished: it takes no more turns"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            f"""
            CREATE FUNCTION agentflow_turn_needs_open_episode() RETURNS trigger AS $$
            DECLARE current text;
            BEGIN
                SELECT status INTO current FROM episodes WHERE id = NEW.episode_id FOR SHARE;
                IF current IS NOT NULL AND current NOT IN ('pending', 'running') THEN
                    RAISE EXCEPTION '{MESSAGE}' USING ERRCODE = 'check_violation';
                END IF;
                RETURN NEW;
            END $$ LANGUAGE plpgsql
            """
        )
        op.execute(
            "CREATE TRIGGER turns_need_open_episode BEFORE INSERT ON turns "
            "FOR EACH ROW EXECUTE FUNCTION agentflow_turn_needs_open_episode()"
        )
    else:
        op.execute(
            f"""
            CREATE TRIGGER turns_need_open_episode BEFORE INSERT ON turns
            WHEN (SELECT status FROM episodes WHERE id = NEW.episode_id)
                 NOT IN ('pending', 'running')
            BEGIN SELECT RAISE(ABORT, '{MESSAGE}'); END
            """
        )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS turns_need_open_episode" + (
        " ON turns" if op.get_bind().dialect.name == "postgresql" else ""
    ))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS agentflow_turn_needs_open_episode()")
