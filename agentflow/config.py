"""The one `Settings` object, read from the environment (prefix `AGENTFLOW_`)."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./agentflow.db"
_DEV_SECRET = "agentflow-development-secret"


class Settings(BaseSettings):
    """Process-wide settings. Every field maps to `AGENTFLOW_<NAME>`."""

    model_config = SettingsConfigDict(env_prefix="AGENTFLOW_", extra="ignore")

    environment: str = Field(
        default="development",
        description="`development` or `production`; production refuses unsafe defaults",
    )
    database_url: str = Field(
        default=DEFAULT_DATABASE_URL,
        description="SQLAlchemy async URL: sqlite+aiosqlite:///file.db or postgresql+asyncpg://...",
    )
    api_key: str | None = Field(
        default=None,
        description="when set, every route but the probes, the docs and the agents' own routes "
        "needs `Bearer <key>`",
    )
    max_body_bytes: int = Field(
        default=1 << 20, ge=1024, description="requests with larger bodies get 422"
    )
    max_chat_body_bytes: int = Field(
        default=32 << 20,
        ge=1024,
        description="the body limit of the OpenAI-compatible chat routes, whose requests "
        "carry images inline as base64",
    )
    max_image_bytes: int = Field(
        default=8 << 20, ge=1, description="the largest image (decoded) a chat request may carry"
    )
    db_echo: bool = Field(default=False, description="log every SQL statement")
    db_synchronous_commit: bool = Field(
        default=False,
        description="PostgreSQL: wait for the WAL fsync on every commit (see docs/decisions.md)",
    )
    secret_key: str = Field(
        default=_DEV_SECRET,
        min_length=16,
        description="signs the per-episode keys handed to black-box agents",
    )
    public_url: str | None = Field(
        default=None,
        description="base URL black-box agents use to reach this gateway; unset: the "
        "address `agentflow serve` actually binds (checked at startup when set)",
    )

    blob_store: Literal["auto", "file", "database"] = Field(
        default="auto",
        description="where image bytes (screenshots) go: `file` (a directory), `database` "
        "(the `blob_data` table), or `auto`: file beside a SQLite database, the table on "
        'PostgreSQL (docs/decisions.md, "Images as blobs")',
    )
    blob_dir: str | None = Field(
        default=None,
        description="the file store's directory; unset: `<sqlite file>-blobs` beside the "
        "database file",
    )

    gc_threshold: str = Field(
        default="500000,50,100",
        description="the cyclic garbage collector's thresholds (`gc.set_threshold`) for "
        "`agentflow serve` and `agentflow train`; empty: Python's own (700,10,10). With "
        "thousands of live episodes Python's own spend half the gateway's CPU in "
        "collections, and 100000,50,100 still 5-7% at 10,000 episodes (docs/performance.md, "
        '"The controller at scale")',
    )

    @field_validator("gc_threshold")
    @classmethod
    def _three_thresholds(cls, value: str) -> str:
        value = value.strip()
        if not value:
            return value
        parts = value.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError("three non-negative integers, comma-separated, or empty")
        return ",".join(p.strip() for p in parts)

    def apply_gc_threshold(self) -> None:
        """Set this process's collector thresholds as `gc_threshold` says."""
        import gc

        if self.gc_threshold:
            first, second, third = (int(p) for p in self.gc_threshold.split(","))
            gc.set_threshold(first, second, third)

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, value: str) -> str:
        # Normalise the plain schemes users type to the async drivers the gateway needs.
        if value.startswith("postgresql://") or value.startswith("postgres://"):
            value = "postgresql+asyncpg://" + value.split("://", 1)[1]
        elif value.startswith("sqlite:///"):
            value = "sqlite+aiosqlite:///" + value[len("sqlite:///") :]
        if not (
            value.startswith("postgresql+asyncpg://") or value.startswith("sqlite+aiosqlite://")
        ):
            raise ValueError("must be a postgresql+asyncpg:// or sqlite+aiosqlite:// URL")
        return value

    @field_validator("environment")
    @classmethod
    def _known_environment(cls, value: str) -> str:
        if value not in ("development", "production"):
            raise ValueError("must be 'development' or 'production'")
        return value

    @model_validator(mode="after")
    def _safe_in_production(self) -> Settings:
        if self.environment == "production" and not self.api_key:
            raise ValueError("AGENTFLOW_API_KEY must be set when AGENTFLOW_ENVIRONMENT=production")
        if self.environment == "production" and self.secret_key == _DEV_SECRET:
            raise ValueError(
                "AGENTFLOW_SECRET_KEY must be set when AGENTFLOW_ENVIRONMENT=production"
            )
        return self


@lru_cache
def get_settings() -> Settings:
    return Settings()
