"""The one exception tree of AgentFlow, mapped to HTTP in one handler (`agentflow.api.app`).

    AgentFlowError                    500  base; never raised directly
     ├── InvalidInput                 422  a request field is wrong (names the field)
     ├── Unauthorized                 401  missing or wrong API key
     ├── Forbidden                    403  a dashboard action from another site
     ├── NotFound                     404  an id that does not exist
     ├── Conflict                     409  a duplicate, or a state that forbids the action
     │    └── WeightsNotFound         409  a run's newest published weights are gone
     ├── CapacityExceeded             503  a concurrency cap is full; retry later
     ├── SchemaOutOfDate              503  the database needs `agentflow db upgrade`
     ├── EnvTimeout                   504  an environment did not answer a step in time
     └── EngineError                  502  an inference engine failed
          ├── EngineRequestError      422  the engine refused this request (bad ids, lengths)
          └── EngineUnavailable       503  transport error or 5xx after retries

Each class carries its HTTP status so the handler needs no table; `field` (for
`InvalidInput`) lets the API answer in FastAPI's own 422 shape.
"""

from __future__ import annotations


class AgentFlowError(Exception):
    """Base of every error AgentFlow raises on purpose."""

    status_code: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(AgentFlowError):
    status_code = 422

    def __init__(self, message: str, *, field: str | tuple[str, ...] | None = None) -> None:
        super().__init__(message)
        self.field: tuple[str, ...] = (field,) if isinstance(field, str) else tuple(field or ())


class Unauthorized(AgentFlowError):
    status_code = 401


class Forbidden(AgentFlowError):
    """Signed in, but not allowed this way: a dashboard action without its page's token
    or from another origin."""

    status_code = 403


class NotFound(AgentFlowError):
    status_code = 404


class Conflict(AgentFlowError):
    status_code = 409


class WeightsNotFound(Conflict):
    """A run cannot start again: the newest weights it served are nowhere to load from."""


class CapacityExceeded(AgentFlowError):
    status_code = 503


class SchemaOutOfDate(AgentFlowError):
    status_code = 503


class EnvTimeout(AgentFlowError):
    status_code = 504


class EngineError(AgentFlowError):
    status_code = 502


class EngineRequestError(EngineError):
    status_code = 422


class EngineUnavailable(EngineError):
    status_code = 503


class EngineLost(EngineUnavailable):
    """The engine died (a Ray actor that exited, a server that is gone): its sessions
    and the requests on it are gone with it; a new session elsewhere can go on."""
