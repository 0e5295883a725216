"""initial schema

Revision ID: 0001
Revises: (none)
Create Date: 2026-12-02 15:14:12.668637
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table('environments',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('tools', sa.JSON(), nullable=False),
    sa.Column('max_concurrency', sa.Integer(), nullable=False),
    sa.Column('step_timeout_s', sa.Float(), nullable=False),
    sa.Column('description', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_environments')),
    sa.UniqueConstraint('name', 'version', name=op.f('uq_environments_name'))
    )
    with op.batch_alter_table('environments', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_environments_kind'), ['kind'], unique=False)
        batch_op.create_index(batch_op.f('ix_environments_name'), ['name'], unique=False)

    op.create_table('runs',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('weight_version', sa.Integer(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs'))
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_runs_name'), ['name'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_status'), ['status'], unique=False)

    op.create_table('episodes',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('run_id', sa.Uuid(), nullable=True),
    sa.Column('environment_id', sa.Uuid(), nullable=True),
    sa.Column('env_ref', sa.String(length=200), nullable=False),
    sa.Column('task', sa.JSON(), nullable=False),
    sa.Column('group_id', sa.String(length=64), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['environment_id'], ['environments.id'], name=op.f('fk_episodes_environment_id_environments'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_episodes_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_episodes'))
    )
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_episodes_group_id'), ['group_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_episodes_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_episodes_status'), ['status'], unique=False)

    op.create_table('run_environments',
    sa.Column('run_id', sa.Uuid(), nullable=False),
    sa.Column('environment_id', sa.Uuid(), nullable=False),
    sa.ForeignKeyConstraint(['environment_id'], ['environments.id'], name=op.f('fk_run_environments_environment_id_environments'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_environments_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'environment_id', name=op.f('pk_run_environments'))
    )
    with op.batch_alter_table('run_environments', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_run_environments_environment_id'), ['environment_id'], unique=False)

    op.create_table('weight_versions',
    sa.Column('run_id', sa.Uuid(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('uri', sa.Text(), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_weight_versions_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'version', name=op.f('pk_weight_versions'))
    )
    op.create_table('turns',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('episode_id', sa.Uuid(), nullable=False),
    sa.Column('parent_id', sa.Uuid(), nullable=True),
    sa.Column('depth', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('token_ids', sa.LargeBinary(), nullable=False),
    sa.Column('logprobs', sa.LargeBinary(), nullable=True),
    sa.Column('weight_versions', sa.LargeBinary(), nullable=True),
    sa.Column('loss_mask', sa.LargeBinary(), nullable=False),
    sa.Column('text', sa.Text(), nullable=True),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('finish_reason', sa.String(length=16), nullable=True),
    sa.Column('timings', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], name=op.f('fk_turns_episode_id_episodes'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['parent_id'], ['turns.id'], name=op.f('fk_turns_parent_id_turns'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_turns'))
    )
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_turns_episode_id'), ['episode_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_turns_parent_id'), ['parent_id'], unique=False)

    op.create_table('trajectories',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('run_id', sa.Uuid(), nullable=True),
    sa.Column('episode_id', sa.Uuid(), nullable=False),
    sa.Column('leaf_turn_id', sa.Uuid(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('times_served', sa.Integer(), nullable=False),
    sa.Column('min_weight_version', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], name=op.f('fk_trajectories_episode_id_episodes'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['leaf_turn_id'], ['turns.id'], name=op.f('fk_trajectories_leaf_turn_id_turns'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_trajectories_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_trajectories'))
    )
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_trajectories_episode_id'), ['episode_id'], unique=False)
        batch_op.create_index('ix_trajectories_run_status', ['run_id', 'status'], unique=False)




def downgrade() -> None:

    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.drop_index('ix_trajectories_run_status')
        batch_op.drop_index(batch_op.f('ix_trajectories_episode_id'))

    op.drop_table('trajectories')
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_turns_parent_id'))
        batch_op.drop_index(batch_op.f('ix_turns_episode_id'))

    op.drop_table('turns')
    op.drop_table('weight_versions')
    with op.batch_alter_table('run_environments', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_environments_environment_id'))

    op.drop_table('run_environments')
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_episodes_status'))
        batch_op.drop_index(batch_op.f('ix_episodes_run_id'))
        batch_op.drop_index(batch_op.f('ix_episodes_group_id'))

    op.drop_table('episodes')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_status'))
        batch_op.drop_index(batch_op.f('ix_runs_name'))

    op.drop_table('runs')
    with op.batch_alter_table('environments', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_environments_name'))
        batch_op.drop_index(batch_op.f('ix_environments_kind'))

    op.drop_table('environments')

